"""Run by test_s3_ddp.py as a script: Lightning's DDP launcher re-executes it for rank 1.

Fits 2 epochs on 2 CPU ranks (gloo) with ``ShardedModelCheckpoint`` saving to the S3 URL
``argv[3]`` (the server's endpoint comes in ``AWS_ENDPOINT_URL``), resumes from its ``last.ckpt``
to 4 epochs, and compares with an uninterrupted 4-epoch run. ``argv[2]``: ``"rank0"`` (no local
tier: rank 0 uploads alone) or ``"local_tier"`` (every rank writes its part into a local tier on
this node, rank 0 uploads). Rank 0 writes a JSON report to ``argv[1]``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from models import TinyRegressor, trainer_kwargs  # noqa: E402

import lightning_ckpt as lc  # noqa: E402

MODE, URL = sys.argv[2], sys.argv[3]


def fit(report: str, max_epochs: int, checkpoint: bool, ckpt_path: str | None = None) -> tuple[Trainer, TinyRegressor]:
    seed_everything(0, workers=True)
    local_dir = os.path.join(os.path.dirname(report), "tier") if MODE == "local_tier" else None
    callbacks = [lc.ShardedModelCheckpoint(dirpath=URL, every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True)] if checkpoint else []
    trainer = Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        enable_checkpointing=checkpoint,
        plugins=[lc.ShardedCheckpointIO(local_dir=local_dir)],
        **trainer_kwargs(strategy="ddp", devices=2),
    )
    model = TinyRegressor()
    trainer.fit(model, ckpt_path=ckpt_path)
    trainer.strategy.checkpoint_io.teardown()
    return trainer, model


def main(report: str) -> None:
    fit(report, 2, checkpoint=True)
    resumed, resumed_model = fit(report, 4, checkpoint=True, ckpt_path=f"{URL}/last.ckpt")
    reference, reference_model = fit(report, 4, checkpoint=False)
    same = all(torch.equal(a, b) for a, b in zip(resumed_model.state_dict().values(), reference_model.state_dict().values()))
    weights = torch.cat([p.detach().flatten() for p in resumed_model.parameters()])
    gathered = resumed.strategy.all_gather(weights)
    if resumed.global_rank == 0:
        import fsspec

        fs, root = fsspec.core.url_to_fs(URL)
        fs.invalidate_cache()
        names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False))
        manifests = {name: lc.verify_checkpoint(f"{URL}/{name}") for name in names}
        with open(report, "w") as f:
            json.dump(
                {
                    "world_size": resumed.world_size,
                    "checkpoints": names,
                    "ranks_in_last": sorted({r.rank for r in manifests["last.ckpt"].files.values() if r.rank is not None}),
                    "resumed_equals_reference": same,
                    "ranks_agree": bool(all(torch.equal(gathered[0], g) for g in gathered)),
                    "global_step": resumed.global_step,
                },
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1])
    close_process_group()
