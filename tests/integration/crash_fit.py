"""Run by test_crash.py: trains forever, saving every step, until it is SIGKILLed.

argv: OUT MODE(sync|async) PIDFILE. Top-k (monitored) + save_last, so every step both writes
new checkpoints and removes old ones. PIDFILE appears once this run trains and saves; it holds
the async writer's pid (empty for sync).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from models import TinyRegressor, trainer_kwargs  # noqa: E402

import lightning_ckpt as lc  # noqa: E402


class Pace(Callback):
    def __init__(self, io: lc.ShardedCheckpointIO, pid_file: str) -> None:
        self.io, self.pid_file = io, pid_file

    def on_train_batch_end(self, *args) -> None:
        # The marker says "this run is training and saving" (async: and its writer is running).
        pid = self.io._worker.pid
        if (pid is not None or not self.io.async_save) and not os.path.exists(self.pid_file):
            with open(self.pid_file + ".tmp", "w") as f:
                f.write(str(pid or ""))
            os.replace(self.pid_file + ".tmp", self.pid_file)
        time.sleep(0.01)


class Ballast(TinyRegressor):
    """64 MB more state, so that saves take most of each step and kills land inside them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.randn(16_000_000))

    def training_step(self, batch, batch_idx):
        self.ballast.add_(1.0)  # changes every step, like real state
        return super().training_step(batch, batch_idx)


def main(out: str, mode: str, pid_file: str) -> None:
    seed_everything(0)
    io = lc.ShardedCheckpointIO(async_save=mode == "async")
    checkpoint = lc.ShardedModelCheckpoint(
        dirpath=out,
        every_n_train_steps=1,
        save_top_k=2,
        monitor="train_loss",
        save_last=True,
        metrics_file=None,
        release_memory=False,  # keep each step's time in the saves, where the kills should land
    )
    trainer = Trainer(max_epochs=100_000, callbacks=[checkpoint, Pace(io, pid_file)], plugins=[io], **trainer_kwargs())
    trainer.fit(Ballast())


if __name__ == "__main__":
    main(*sys.argv[1:4])
