"""ChunkedOffloadStrategy under a real Trainer on the CPU: exactness against the default strategy
with ChunkedAdamW, budget adherence, streaming, tied and frozen parameters, accumulation,
clipping, and checkpoints moving between the two strategies."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from models import trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt as lc

WIDTH = 128
VOCAB = 16


class Stack(LightningModule):
    """Tied embedding / head around a stack of linear layers; optionally one frozen layer."""

    def __init__(self, layers: int = 8, frozen: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        if frozen:
            self.layers[2].requires_grad_(False)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return lc.ChunkedAdamW(params, lr=1e-2, weight_decay=0.1, chunk_size="64KiB")

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(3)
        return DataLoader(TensorDataset(torch.randint(0, VOCAB, (12, 4), generator=gen)), batch_size=1)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def budget_for(model: torch.nn.Module) -> int:
    return param_bytes(model) // 3


def fit(strategy=None, max_steps: int = 6, frozen: bool = False, ckpt_path=None, dirpath=None, **overrides):
    seed_everything(0, workers=True)
    model = Stack(frozen=frozen)
    callbacks = [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)] if dirpath else []
    kwargs = trainer_kwargs(max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(dirpath))
    if strategy is not None:
        kwargs["strategy"] = strategy
    kwargs.update(overrides)
    trainer = Trainer(**kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    trainer.optimizers[0].wait()
    return trainer, model


def offload(**options) -> lc.ChunkedOffloadStrategy:
    budget = budget_for(Stack())
    return lc.ChunkedOffloadStrategy(device_memory_budget=budget, chunk_size="66KiB", **options)


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("prefetch", [0, 2])
def test_streams_within_budget_and_equals_the_default_strategy(prefetch):
    reference_trainer, reference = fit()
    strategy = offload(prefetch=prefetch)
    trainer, model = fit(strategy)
    assert model.losses == reference.losses
    assert_same(model, reference)
    stats = strategy.memory_stats()
    assert param_bytes(model) >= 3 * stats["device_memory_budget"]
    assert 0 < stats["peak_device_bytes"] <= stats["device_memory_budget"]
    assert stats["streamed_chunks"] > 0
    # Every step fetched more parameter bytes than the device may hold at once.
    assert stats["h2d_bytes"] > 6 * stats["device_memory_budget"]
    assert stats["d2h_bytes"] > 0
