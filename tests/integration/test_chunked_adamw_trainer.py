"""ChunkedAdamW under a real Trainer on the CPU: exactness against torch.optim.AdamW and resumes."""

from __future__ import annotations

import os
import time

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from models import cli_trainer_yaml, trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt as lc

MAX_STEPS = 6  # optimizer steps; 2 batches each (accumulate_grad_batches=2): 3 per epoch


class TiedNet(LightningModule):
    """Two param groups, a frozen layer, a tied embedding/head, StepLR."""

    def __init__(self, chunked: bool) -> None:
        super().__init__()
        self.chunked = chunked
        self.embed = torch.nn.Embedding(11, 13)
        self.body = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 13))
        self.frozen = torch.nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(13, 11, bias=False)
        self.head.weight = self.embed.weight
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.head(self.frozen(self.body(self.embed(tokens[:, :-1]))))
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 11), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        decay = [self.embed.weight, self.body[0].weight, self.body[2].weight, self.frozen.weight]
        rest = [self.body[0].bias, self.body[2].bias, self.frozen.bias]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]
        if self.chunked:
            optimizer = lc.ChunkedAdamW(groups, lr=2e-2, chunk_size="1KiB")
        else:
            optimizer = torch.optim.AdamW(groups, lr=2e-2, fused=True)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(7)
        return DataLoader(TensorDataset(torch.randint(0, 11, (24, 6), generator=gen)), batch_size=4)


def fit(chunked: bool, max_steps: int = MAX_STEPS, ckpt_path=None, dirpath=None, plugin=None, save_every: int = 1, **overrides):
    seed_everything(0, workers=True)
    model = TiedNet(chunked)
    callbacks = [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=save_every, save_top_k=-1)] if dirpath else []
    kwargs = trainer_kwargs(
        max_steps=max_steps,
        gradient_clip_val=0.1,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        enable_checkpointing=bool(dirpath),
        plugins=[plugin] if plugin is not None else None,
    )
    kwargs.update(overrides)
    trainer = Trainer(**kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


def test_trainer_weights_equal_torch_adamw_bit_for_bit():
    _, reference = fit(chunked=False)
    trainer, model = fit(chunked=True)
    assert trainer.global_step == MAX_STEPS
    assert model.losses == reference.losses
    assert_same(model, reference)
    optimizer = trainer.optimizers[0]
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr() == [2e-2 * 0.5**3, 5e-3 * 0.5**3]
    assert float(optimizer.state[model.embed.weight]["step"]) == MAX_STEPS
    assert model.frozen.weight not in optimizer.state


def test_trainer_bf16_mixed_within_tolerance():
    """bf16 autocast (fp32 parameters): the weights agree with fused AdamW to within 1e-6 (equal in
    practice: the step is exact, only autocast rounds). No clipping here: Lightning refuses it for
    torch's fused AdamW under a precision plugin (not for ChunkedAdamW, checked after)."""
    _, reference = fit(chunked=False, precision="bf16-mixed", gradient_clip_val=None)
    _, model = fit(chunked=True, precision="bf16-mixed", gradient_clip_val=None)
    for (name, x), y in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6, msg=name)
    trainer, _ = fit(chunked=True, precision="bf16-mixed")  # with gradient_clip_val
    assert trainer.global_step == MAX_STEPS


class SlowWorker(Callback):
    """Every chunk's step starts 50 ms late on the worker thread: the last step is still queued
    when the fit loop ends."""

    def on_train_start(self, trainer, pl_module) -> None:
        worker = trainer.optimizers[0]._worker
        run = worker.run
        worker.run = lambda job: (time.sleep(0.05), run(job))[1]


def test_fit_returns_with_the_last_step_applied():
    """Lightning's teardown reads the optimizer's state before it moves the module to the CPU;
    that read waits for the steps in flight, so ``trainer.fit`` returns final weights (on CUDA a
    write-back after the move would be lost, or land in freed device memory)."""
    _, reference = fit(chunked=False)
    seed_everything(0, workers=True)
    model = TiedNet(chunked=True)
    trainer = Trainer(**trainer_kwargs(
        max_steps=MAX_STEPS, gradient_clip_val=0.1, accumulate_grad_batches=2, callbacks=[SlowWorker()],
        enable_checkpointing=False,
    ))  # fmt: skip
    trainer.fit(model)
    assert all(chunk.done.is_set() for chunk in trainer.optimizers[0]._chunks)  # no wait() of ours
    assert_same(model, reference)


# Resumes from a checkpoint taken at the last batch of an epoch, without accumulation. (A
# checkpoint taken at ``on_train_epoch_end`` (``every_n_epochs``) resumes one batch out of phase in
# Lightning 2.6, with torch.optim.AdamW too: the resumed run replays the epoch's first batch.)
RESUME = {"accumulate_grad_batches": 1}
EPOCH = 6  # batches per epoch


def first_then_resume(tmp_path, first_chunked: bool, then_chunked: bool, async_save: bool = False):
    folder = tmp_path / f"{first_chunked}-{then_chunked}"
    plugin = lc.ShardedCheckpointIO(async_save=async_save)
    fit(first_chunked, max_steps=EPOCH, dirpath=folder, plugin=plugin, save_every=EPOCH, **RESUME)
    (name,) = [n for n in os.listdir(folder) if n.endswith(".ckpt")]
    plugin = lc.ShardedCheckpointIO(async_save=async_save)
    _, resumed = fit(then_chunked, max_steps=2 * EPOCH, ckpt_path=str(folder / name), plugin=plugin, **RESUME)
    return lc.load_checkpoint(folder / name), resumed


@pytest.mark.parametrize("async_save", [False, True])
def test_sharded_checkpoint_resume_is_bit_identical(tmp_path, async_save):
    _, reference = fit(chunked=True, max_steps=2 * EPOCH, **RESUME)
    _, adamw_reference = fit(chunked=False, max_steps=2 * EPOCH, **RESUME)
    assert_same(reference, adamw_reference)
    saved, resumed = first_then_resume(tmp_path, True, True, async_save)
    state = saved["optimizer_states"][0]["state"]
    assert set(state[0]) == {"step", "exp_avg", "exp_avg_sq"} and state[0]["exp_avg"].shape == (11, 13)
    assert float(state[0]["step"]) == EPOCH
    assert resumed.losses == reference.losses[EPOCH:]
    assert_same(resumed, reference)


class StateAtSave(Callback):
    """Clones the optimizer state each save hands the plugin, and counts the steps that ran while
    the first save was not durable yet (``poll``). Runs before ModelCheckpoint's batch-end hook."""

    def __init__(self, plugin: lc.ShardedCheckpointIO) -> None:
        self.plugin = plugin
        self.saved: dict[int, dict] = {}
        self.weights: dict[int, dict] = {}
        self.durable: list[str] = []
        self.steps_while_writing = 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        state = checkpoint["optimizer_states"][0]["state"]
        self.saved[trainer.global_step] = {k: {n: t.clone() for n, t in e.items()} for k, e in state.items()}
        self.weights[trainer.global_step] = {k: t.clone() for k, t in checkpoint["state_dict"].items()}

    def on_train_batch_end(self, trainer, *args) -> None:
        self.durable += [r.path for r in self.plugin.poll()]
        if self.saved and not self.durable:
            self.steps_while_writing += 1


def test_async_checkpoint_holds_the_state_at_the_save_while_later_steps_run(tmp_path):
    """A slow writer (``max_write_rate``): the next steps run while the save is being written; the
    checkpoint still holds the state as of the save, and the moments were copied into the staging
    pool once per staged save (top-k file and last.ckpt share one), none on the training thread."""
    plugin = lc.ShardedCheckpointIO(async_save=True, buffer_size="4KiB", max_write_rate="32KiB")
    record = StateAtSave(plugin)
    seed_everything(0, workers=True)
    model = TiedNet(chunked=True)
    save = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, save_last=True)
    trainer = Trainer(**trainer_kwargs(max_steps=EPOCH, callbacks=[record, save], plugins=[plugin], **RESUME))
    trainer.fit(model)
    plugin.wait()
    assert record.steps_while_writing >= 1  # the premise: steps 4.. ran before step 3's save was durable

    loaded = lc.load_checkpoint(tmp_path / "epoch=0-step=3.ckpt")["optimizer_states"][0]["state"]
    assert loaded.keys() == record.saved[3].keys()
    for k, entry in record.saved[3].items():
        for name, value in entry.items():
            assert torch.equal(loaded[k][name], value), (k, name)
            assert name == "step" or not torch.equal(record.saved[6][k][name], value)  # training moved on
    # The weights too (on the CPU the parameters are the arena's master weights, updated in place):
    # each checkpoint holds its own step's, not bytes staged for an earlier save.
    for step in (3, 6):
        weights = lc.load_checkpoint(tmp_path / f"epoch=0-step={step}.ckpt")["state_dict"]
        assert all(torch.equal(weights[k], v) for k, v in record.weights[step].items()), step
    assert not torch.equal(record.weights[3]["embed.weight"], record.weights[6]["embed.weight"])
    moment_bytes = sum(t.numel() * t.element_size() for e in record.saved[3].values() for n, t in e.items() if n != "step")
    arena = trainer.optimizers[0]._arena
    assert arena.snapshot_bytes == 2 * moment_bytes  # steps 3 and 6, each byte once


@pytest.mark.parametrize("chunked_first", [True, False])
def test_checkpoints_resume_across_torch_adamw_and_chunked(tmp_path, chunked_first):
    _, reference = fit(chunked=False, max_steps=2 * EPOCH, **RESUME)
    _, resumed = first_then_resume(tmp_path, chunked_first, not chunked_first)
    assert resumed.losses == reference.losses[EPOCH:]
    assert_same(resumed, reference)


class PlainNet(LightningModule):
    """No configure_optimizers: LightningCLI adds one from the config's ``optimizer``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(5, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 5)), batch_size=4)


def test_chunked_adamw_from_a_lightning_cli_config(tmp_path):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        cli_trainer_yaml(tmp_path)
        + """optimizer:
  class_path: lightning_ckpt.ChunkedAdamW
  init_args:
    lr: 0.01
    weight_decay: 0.0
    chunk_size: 1KiB
"""
    )
    cli = LightningCLI(PlainNet, args=["fit", "--config", str(config)], save_config_callback=None)
    (optimizer,) = cli.trainer.optimizers
    assert isinstance(optimizer, lc.ChunkedAdamW)
    optimizer.wait()  # the last step may still be running: optimizer.state is read directly below
    assert optimizer.param_groups[0]["lr"] == 0.01 and optimizer.param_groups[0]["weight_decay"] == 0.0
    assert cli.trainer.global_step == 2 and float(optimizer.state[cli.model.layer.weight]["step"]) == 2


def test_fabric_training_equals_torch_adamw():
    from lightning.fabric import Fabric

    results = []
    for chunked in (True, False):
        fabric = Fabric(accelerator="cpu", devices=1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 19), torch.nn.ReLU(), torch.nn.Linear(19, 2))
        optimizer = lc.ChunkedAdamW(model.parameters(), lr=1e-2, chunk_size=256) if chunked else torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        model, optimizer = fabric.setup(model, optimizer)
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            loss = model(torch.randn(4, 7, generator=g)).pow(2).mean()
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(results[0], results[1])
