"""Run by test_crash.py: trains forever, saving every step, until it is SIGKILLed.

argv: OUT MODE(sync|async) PIDFILE WAIT_FOR(started|committed) [MODEL(ballast|frozen)]. Top-k (monitored) + save_last, so
every step both writes new checkpoints and removes old ones. PIDFILE appears once the test may
kill this run; it holds the async writer's pid (empty for sync):

* ``started``: after the first step. Sync, its checkpoints are committed; async, they were handed
  to the writer process, which may still be starting or writing them (a kill lands in the first
  saves: the top-k file of step 1 may be committed and its ``last`` not yet).
* ``committed``: once this run's ``last`` checkpoint is committed (its directory exists under the
  final name), so a kill lands in the steady state of saves and removals.
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
    def __init__(
        self, io: lc.ShardedCheckpointIO, checkpoint: lc.ShardedModelCheckpoint, pid_file: str, wait_for: str
    ) -> None:
        self.io, self.checkpoint, self.pid_file, self.wait_for = io, checkpoint, pid_file, wait_for

    def on_train_batch_end(self, trainer, *args) -> None:
        # Lightning runs checkpoint callbacks after the others: at the end of step 2, step 1's
        # saves have returned (sync: committed; async: staged, and the writer process runs).
        ready = trainer.global_step >= 2
        if self.wait_for == "committed":  # a directory under its final name is a committed one
            ready = ready and bool(self.checkpoint.last_model_path) and os.path.isdir(self.checkpoint.last_model_path)
        if ready and not os.path.exists(self.pid_file):
            with open(self.pid_file + ".tmp", "w") as f:
                saver = self.io.async_saver  # None in sync mode: no writer process
                f.write(str(saver.worker.pid or "") if saver is not None else "")
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


class FrozenBallast(TinyRegressor):
    """64 MB of frozen weights beside the trained ones: incremental saves link their shard from
    the previous checkpoint, so kills land in saves that reuse files."""

    def __init__(self) -> None:
        super().__init__()
        self.ballast = torch.nn.Parameter(torch.randn(16_000_000), requires_grad=False)


def main(out: str, mode: str, pid_file: str, wait_for: str, model: str = "ballast") -> None:
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
    pace = Pace(io, checkpoint, pid_file, wait_for)
    trainer = Trainer(max_epochs=100_000, callbacks=[checkpoint, pace], plugins=[io], **trainer_kwargs())
    trainer.fit(FrozenBallast() if model == "frozen" else Ballast())


if __name__ == "__main__":
    main(*sys.argv[1:6])
