"""Run by test_incremental_ddp.py as a script: Lightning's DDP launcher re-executes it for rank 1.

Fits a frozen backbone under a trained head with 2 CPU ranks (gloo), saving every step through
ShardedModelCheckpoint, every rank writing its part (DDP on one node spreads the writes). Rank 0
writes a JSON report to ``argv[1]``: each checkpoint's stable shard files and their inodes, the
save records, and whether each checkpoint verifies and loads as the state it was saved from once
every other checkpoint is deleted. ``argv[2] == "async"`` saves with ``async_save=True``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from helpers import close_process_group, each_alone  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from models import FrozenBackbone, trainer_kwargs  # noqa: E402

import lightning_ckpt as lc  # noqa: E402


class Capture(Callback):
    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.states[checkpoint["global_step"]] = {k: v.clone() for k, v in checkpoint["state_dict"].items()}


def stands_alone(folder: str, states: dict[int, dict[str, torch.Tensor]]) -> dict[str, bool]:
    """Per checkpoint: verifies and loads as its state with every other one deleted."""
    result = {}
    for keep, alone in each_alone(folder, sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))):
        lc.verify_checkpoint(alone)
        loaded = lc.load_checkpoint(alone)
        expected = states[loaded["global_step"]]
        result[keep] = loaded["state_dict"].keys() == expected.keys() and all(
            torch.equal(loaded["state_dict"][k], v) for k, v in expected.items()
        )
    return result


def main(report: str, mode: str) -> None:
    out = os.path.join(os.path.dirname(report), "ckpts")
    seed_everything(0, workers=True)
    capture = Capture()
    checkpoint = lc.ShardedModelCheckpoint(
        dirpath=out, filename="{step}", every_n_train_steps=1, save_top_k=-1, metrics_file=None
    )
    io = lc.ShardedCheckpointIO(async_save=mode == "async")
    trainer = Trainer(
        max_steps=4, callbacks=[checkpoint, capture], plugins=[io], strategy="ddp", **trainer_kwargs(devices=2)
    )
    trainer.fit(FrozenBackbone(width=256))
    if trainer.global_rank == 0:
        stable = {
            name: {
                f: os.stat(os.path.join(out, name, f)).st_ino
                for f in sorted(os.listdir(os.path.join(out, name)))
                if "-stable-" in f
            }
            for name in sorted(os.listdir(out))
        }
        with open(report, "w") as f:
            json.dump(
                {
                    "world_size": trainer.world_size,
                    "stable": stable,
                    "records": [
                        {k: r[k] for k in ("global_step", "nbytes", "reused_bytes")} for r in checkpoint.save_records
                    ],
                    "stands_alone": stands_alone(out, capture.states),
                },
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    close_process_group()
