"""``ShardedModelCheckpoint`` with Lightning's ``AsyncCheckpointIO``: a save's record never takes
the file an earlier save left at the same path (``last.ckpt``) for this save's, written and durable."""

from __future__ import annotations

import threading
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from models import TinyRegressor, trainer_kwargs

import lightning_ckpt as lc


class HeldTorchIO(TorchCheckpointIO):
    """Writes the save of step k only once step k + 1 began (or training ended), as a slow disk
    would, and step k + 1 runs once the save of step k is written (``Release``): when the callback
    records a save, the file at ``last.ckpt`` is the previous save's, complete."""

    def __init__(self) -> None:
        super().__init__()
        self.cond = threading.Condition()
        self.steps_begun = self.written = 0
        self.ended = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        step = checkpoint["global_step"]
        with self.cond:
            released = self.cond.wait_for(lambda: self.ended or self.steps_begun > step, timeout=300)
        assert released, f"step {step + 1} never began"
        super().save_checkpoint(checkpoint, path, storage_options)
        with self.cond:
            self.written = step
            self.cond.notify_all()


class Release(Callback):
    def __init__(self, io: HeldTorchIO) -> None:
        self.io = io

    def on_train_batch_start(self, *args: Any) -> None:
        with self.io.cond:
            self.io.steps_begun += 1
            self.io.cond.notify_all()
            step = self.io.steps_begun - 1  # the step whose save (if any) the writer may now write
            assert self.io.cond.wait_for(lambda: self.io.written >= step, timeout=300), f"the save of step {step} was not written"

    def on_train_end(self, *args: Any) -> None:
        with self.io.cond:
            self.io.ended = True
            self.io.cond.notify_all()


def test_an_async_checkpoint_io_save_is_not_recorded_as_written_when_its_call_returns(tmp_path):
    held = HeldTorchIO()
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=0, save_last=True)
    trainer = Trainer(max_steps=4, plugins=[AsyncCheckpointIO(held)], callbacks=[callback, Release(held)], **trainer_kwargs())
    trainer.fit(TinyRegressor())
    records = callback.save_records
    assert len(records) == 4 and (tmp_path / "last.ckpt").is_file()
    # From the second save on, last.ckpt existed (the previous save's) when each save returned.
    assert [(r["nbytes"], r["durable_s"]) for r in records] == [(None, None)] * 4, records
