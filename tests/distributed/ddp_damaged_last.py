"""Run by test_resume_last_ddp.py as a script: Lightning's DDP launcher re-executes it for rank 1.

Fits 2 epochs (2 steps each: every rank has half the data) with 2 CPU ranks saving every 2 steps
(``last.ckpt`` too) with ``ShardedModelCheckpoint``; rank 0 damages ``last.ckpt`` (``argv[2]``:
``flip`` a byte of a model shard, or ``truncate-both``: truncate it and ``epoch=1-step=4.ckpt``'s);
then every rank resumes with ``ckpt_path="last"`` to 3 epochs. Each rank writes what it resumed
from to ``<report>.rank<r>``; rank 0 writes the report (do all ranks hold the same weights).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from helpers import close_process_group, flip_byte  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from models import TinyRegressor, trainer_kwargs  # noqa: E402

import lightning_ckpt as lc  # noqa: E402
from lightning_ckpt.format.reader import read_manifest  # noqa: E402


def fit(out: str, max_epochs: int, ckpt_path: str | None = None) -> tuple[Trainer, TinyRegressor]:
    seed_everything(0, workers=True)
    model = TinyRegressor()
    callback = lc.ShardedModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = Trainer(
        max_epochs=max_epochs,
        callbacks=[callback],
        plugins=[lc.ShardedCheckpointIO()],
        **trainer_kwargs(strategy="ddp", devices=2),
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def shard(checkpoint: str) -> str:
    """The last model shard (the one rank 1 wrote, in a multi-rank save)."""
    return os.path.join(checkpoint, read_manifest(checkpoint).components["model"][-1])


def damage(out: str, how: str) -> None:
    if how == "flip":
        path = shard(os.path.join(out, "last.ckpt"))
        flip_byte(path, os.path.getsize(path) - 5)
        return
    for name in ("last.ckpt", "epoch=1-step=4.ckpt"):
        path = shard(os.path.join(out, name))
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 7)


def main(report: str, how: str) -> None:
    out = os.path.join(os.path.dirname(report), "ckpts")
    first, _ = fit(out, 2)
    if first.global_rank == 0:
        damage(out, how)
    first.strategy.barrier()  # the damage is on disk before any rank resolves "last"
    resumed, model = fit(out, 3, ckpt_path="last")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = resumed.strategy.all_gather(weights)
    mine = {"rank": resumed.global_rank, "ckpt_path": resumed.ckpt_path, "global_step": resumed.global_step}
    with open(f"{report}.rank{resumed.global_rank}", "w") as f:
        json.dump(mine, f)
    if resumed.global_rank == 0:
        with open(report, "w") as f:
            json.dump({"world_size": resumed.world_size, "ranks_agree": bool(all(torch.equal(gathered[0], g) for g in gathered))}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    close_process_group()
