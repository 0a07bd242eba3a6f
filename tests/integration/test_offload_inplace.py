"""ChunkedAdamW under ChunkedOffloadStrategy with fp32 parameters: the strategy's host chunks are
the master weights (no copy of them in the optimizer's arena), stepped in place bit-identically
to torch's fused AdamW, across the warm-up's re-layout, streaming, writes from outside, and
checkpoints (sync and async)."""

from __future__ import annotations

import time

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback
from models import trainer_kwargs
from test_offload_strategy import EPOCH, Stack, assert_same, fit, offload

import lightning_ckpt as lc
from lightning_ckpt.hostmem import aligned


def assert_in_place(optimizer: lc.ChunkedAdamW) -> None:
    """Every chunk's master weights are its parameters: the arena holds the two moments alone."""
    assert optimizer._chunks and all(c.params_are_master and c.master_flat.numel() == 0 for c in optimizer._chunks)
    assert optimizer.host_bytes == sum(2 * aligned(4 * c.spec.numel) for c in optimizer._chunks)


class FusedAdamWStack(Stack):
    """The same model and hyper-parameters, stepped by torch's fused AdamW."""

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


class WriteBetweenSteps(Callback):
    """Before each batch: records where the parameters are; before batch 3 writes one of them in
    place (after the optimizer's step is done, as a user must), which the next step starts from."""

    def __init__(self) -> None:
        self.where: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.where.append([p.data_ptr() for p in pl_module.parameters()])
        if batch_idx == 3:
            optimizer = trainer.optimizers[0]
            if isinstance(optimizer, lc.ChunkedAdamW):
                optimizer.wait()
            with torch.no_grad():
                pl_module.layers[1].weight.fill_(0.01)


def run(model_class: type[Stack], strategy: lc.ChunkedOffloadStrategy | None = None, callback: Callback | None = None) -> tuple:
    """A seeded 6-step fit with ``callback`` (default: :class:`WriteBetweenSteps`): (trainer, model, callback)."""
    seed_everything(0, workers=True)
    callback = callback or WriteBetweenSteps()
    kwargs = trainer_kwargs(max_steps=6, callbacks=[callback], enable_checkpointing=False)
    trainer = Trainer(**kwargs, **({"strategy": strategy} if strategy else {}))
    model = model_class()
    trainer.fit(model)
    return trainer, model, callback


def test_fp32_host_chunks_are_stepped_in_place_equal_to_fused_adamw():
    _, reference, _ = run(FusedAdamWStack)
    strategy = offload()  # a third of the parameters: streamed
    trainer, model, writes = run(Stack, strategy)
    trainer.optimizers[0].wait()
    assert_in_place(trainer.optimizers[0])
    assert model.losses == reference.losses
    assert_same(model, reference)
    # The warm-up re-laid the host chunks out after the first backward: the parameters moved.
    assert writes.where[0] != writes.where[1] and writes.where[1] == writes.where[2]
    assert strategy.memory_stats()["streamed_chunks"] > 0


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_resume_bit_identical(tmp_path, async_save):
    _, reference = fit(max_steps=2 * EPOCH)
    folder = tmp_path / "ckpts"
    # Two steps after the save at the epoch's end: they write the chunks while an async save is staged.
    fit(offload(), max_steps=EPOCH + 2, dirpath=folder, plugins=[lc.ShardedCheckpointIO(async_save=async_save)])
    trainer, resumed = fit(
        offload(), max_steps=2 * EPOCH, ckpt_path=str(folder / f"epoch=0-step={EPOCH}.ckpt"),
        plugins=[lc.ShardedCheckpointIO(async_save=async_save)],
    )
    assert_in_place(trainer.optimizers[0])
    assert resumed.losses == reference.losses[EPOCH:]
    assert_same(resumed, reference)


class SwapOptimizer(Callback):
    """Before batch 2: a new ChunkedAdamW over the same parameters, with the old one's state, takes
    over through ``trainer.optimizers`` (as the learning-rate finder and user code assign it); its
    worker is slowed down, so a fetch that does not wait for its steps reads half-stepped chunks."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx != 2:
            return
        old = trainer.optimizers[0]
        if isinstance(old, lc.ChunkedAdamW):
            old.wait()
        new = pl_module.configure_optimizers()
        new.load_state_dict(old.state_dict())
        if isinstance(new, lc.ChunkedAdamW):
            run = new._worker.run
            new._worker.run = lambda job: (time.sleep(0.01), run(job))[1]
        trainer.optimizers = [new]


def test_an_optimizer_assigned_mid_training_is_waited_for_before_fetches():
    _, reference, _ = run(FusedAdamWStack, callback=SwapOptimizer())
    trainer, model, _ = run(Stack, offload(), SwapOptimizer())
    trainer.optimizers[0].wait()
    assert model.losses == reference.losses
    assert_same(model, reference)
