"""Run by test_ddp.py as a script: Lightning's DDP launcher re-executes it for rank 1.

Fits 2 epochs with 2 CPU ranks (gloo) saving through ShardedCheckpointIO, resumes from
``ckpt_path="last"`` to 4 epochs, and runs an uninterrupted 4-epoch reference; rank 0 writes a
JSON report to ``argv[1]``. ``argv[2] == "async"`` saves with ``async_save=True``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from models import TinyRegressor, fit_regressor  # noqa: E402

import lightning_ckpt as lc  # noqa: E402

ASYNC = len(sys.argv) > 2 and sys.argv[2] == "async"


def fit(out: str, max_epochs: int, checkpoint: bool, ckpt_path: str | None = None) -> tuple[Trainer, TinyRegressor]:
    return fit_regressor(
        max_epochs,
        dirpath=out if checkpoint else None,
        ckpt_path=ckpt_path,
        plugin=lc.ShardedCheckpointIO(async_save=ASYNC),
        strategy="ddp",
        devices=2,
    )


def main(report: str) -> None:
    out = os.path.join(os.path.dirname(report), "ckpts")
    fit(out, 2, checkpoint=True)
    files_after_first = sorted(os.listdir(out))
    resumed, resumed_model = fit(out, 4, checkpoint=True, ckpt_path="last")
    reference, reference_model = fit(out + "-unused", 4, checkpoint=False)
    same = all(
        torch.equal(a, b) for a, b in zip(resumed_model.state_dict().values(), reference_model.state_dict().values())
    )
    # Every rank must hold the same weights as rank 0.
    weights = torch.cat([p.detach().flatten() for p in resumed_model.parameters()])
    gathered = resumed.strategy.all_gather(weights)
    ranks_agree = bool(all(torch.equal(gathered[0], g) for g in gathered))
    if resumed.global_rank == 0:
        verified = []
        for name in sorted(os.listdir(out)):
            lc.verify_checkpoint(os.path.join(out, name))
            verified.append(name)
        with open(report, "w") as f:
            json.dump(
                {
                    "world_size": resumed.world_size,
                    "files_after_first": files_after_first,
                    "verified": verified,
                    "resumed_equals_reference": same,
                    "ranks_agree": ranks_agree,
                    "resumed_losses": resumed_model.losses,
                    "reference_losses": reference_model.losses,
                    "global_step": resumed.global_step,
                },
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1])
    close_process_group()
