"""Hugging Face models from small configs (random init, no downloads) under a real ``Trainer``:
a kill-free resume through ``ShardedCheckpointIO`` equals the uninterrupted run bit for bit, and
``ChunkedAdamW`` equals ``torch.optim.AdamW(fused=True)`` bit for bit with tied embeddings."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from models import trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt as lc

transformers = pytest.importorskip("transformers")

VOCAB = 128
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    ),
    # no dropout: Lightning does not restore the RNG a resumed run's masks would need
    "gpt2-tied": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
}  # fmt: skip


class CausalLM(LightningModule):
    def __init__(self, name: str, chunked: bool = False) -> None:
        super().__init__()
        self.lm = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager")
        self.chunked = chunked

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.lm(input_ids=ids, labels=ids, use_cache=False).loss

    def configure_optimizers(self):
        if self.chunked:
            return lc.ChunkedAdamW(self.parameters(), lr=1e-2, weight_decay=0.1, chunk_size="64KiB")
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randint(0, VOCAB, (16, 16), generator=gen)), batch_size=4)


def run(name: str, max_steps: int, chunked: bool = False, ckpt_path=None, callbacks=(), plugins=None) -> CausalLM:
    seed_everything(0)
    module = CausalLM(name, chunked)
    trainer = Trainer(**trainer_kwargs(
        max_steps=max_steps, gradient_clip_val=1.0, callbacks=list(callbacks), plugins=plugins,
        enable_checkpointing=bool(callbacks),
    ))  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    return module


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (key, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), key


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_resume_through_sharded_checkpoints_equals_the_uninterrupted_run(tmp_path, name):
    # saved at the last batch of the first epoch (4 batches): Lightning 2.6 resumes a plain
    # DataLoader exactly from there, not from mid-epoch
    uninterrupted = run(name, max_steps=8)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    run(name, max_steps=4, callbacks=[checkpoint], plugins=[lc.ShardedCheckpointIO()])
    resumed = run(name, max_steps=8, ckpt_path=str(tmp_path / "step=4.ckpt"), plugins=[lc.ShardedCheckpointIO()])
    assert_same(resumed, uninterrupted)


def test_chunked_adamw_equals_fused_adamw_with_tied_embeddings():
    reference = run("gpt2-tied", max_steps=4)
    chunked = run("gpt2-tied", max_steps=4, chunked=True)
    assert chunked.lm.lm_head.weight is chunked.lm.transformer.wte.weight  # still tied
    assert_same(chunked, reference)
