"""Run by test_collectives.py: counts torch.distributed collectives per training step in the
checkpoint callback's hook, for Lightning's ModelCheckpoint and for ShardedModelCheckpoint, on
2 CPU ranks (gloo). Rank 0 writes a JSON report to ``argv[1]``."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import TinyRegressor, trainer_kwargs  # noqa: E402

import lightning_ckpt as lc  # noqa: E402

COLLECTIVES = (
    "barrier", "all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
    "reduce", "gather", "scatter", "all_to_all", "reduce_scatter", "all_gather_into_tensor",
)
CALLS: list[str] = []


def _count(name, fn):
    def wrapper(*args, **kwargs):
        CALLS.append(name)
        return fn(*args, **kwargs)

    return wrapper


for _name in COLLECTIVES:
    if hasattr(dist, _name):
        setattr(dist, _name, _count(_name, getattr(dist, _name)))


TIME_MODE = len(sys.argv) > 2 and sys.argv[2] == "time"


def run(callback_cls, out: str, io=None) -> tuple[list[dict], list[str], bool]:
    seed_everything(0)
    if TIME_MODE:  # 240 steps of >= 10 ms (Slow): >= 2.4 s of training, so >= 2 saves 1 s apart
        callback = callback_cls(dirpath=out, train_time_interval=timedelta(seconds=1), save_top_k=-1, save_last=True)
    else:
        callback = callback_cls(dirpath=out, every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True)
    steps: list[dict] = []
    files: list[str] = []
    hook, save = callback.on_train_batch_end, callback._save_checkpoint

    def counted_save(trainer, filepath):
        files.append(os.path.basename(filepath))
        save(trainer, filepath)

    def counted(trainer, *args, **kwargs):
        before, files_before = len(CALLS), len(files)
        hook(trainer, *args, **kwargs)
        saved = files[files_before:]
        steps.append({"step": trainer.global_step, "saved": bool(saved), "files": saved, "collectives": CALLS[before:]})

    callback._save_checkpoint = counted_save
    callback.on_train_batch_end = counted
    trainer = Trainer(
        max_epochs=60 if TIME_MODE else 3,
        callbacks=[callback, *([Slow()] if TIME_MODE else [])],
        plugins=[io or lc.ShardedCheckpointIO()],
        **trainer_kwargs(strategy="ddp", devices=2),
    )
    trainer.fit(TinyRegressor())
    kept = sorted(n for n in os.listdir(out) if n.endswith(".ckpt")) if trainer.is_global_zero else []
    return steps, kept, trainer.is_global_zero


class Slow(Callback):
    """~10 ms more per step, so the run spans several intervals."""

    def on_train_batch_start(self, *args) -> None:
        time.sleep(0.01)


def main(report: str) -> None:
    root = os.path.dirname(report)
    stock_steps, stock_kept, _ = run(ModelCheckpoint, os.path.join(root, "stock"))
    ours_steps, ours_kept, is_global_zero = run(lc.ShardedModelCheckpoint, os.path.join(root, "ours"))
    # An IO that can skip a save: each save step ends with one broadcast telling every rank.
    skip_steps: list[dict] = []
    skip_kept: list[str] = []
    if not TIME_MODE:
        skip_io = lc.ShardedCheckpointIO(async_save=True, when_busy="skip")
        skip_steps, skip_kept, _ = run(lc.ShardedModelCheckpoint, os.path.join(root, "skip"), skip_io)
    if is_global_zero:
        with open(report, "w") as f:
            json.dump(
                {"stock": stock_steps, "ours": ours_steps, "skip": skip_steps,
                 "stock_kept": stock_kept, "ours_kept": ours_kept, "skip_kept": skip_kept},
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1])
    close_process_group()
