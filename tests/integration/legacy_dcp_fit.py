"""Run by test_legacy_dcp.py as a script (Lightning's launcher re-executes it for rank 1).

Fits ``TinyRegressor`` for one epoch on 2 CPU ranks (gloo) with Lightning's own
``ModelParallelStrategy`` (FSDP2 ``fully_shard`` of each linear layer and the root) and AdamW,
checkpointed by Lightning's stock ``ModelCheckpoint``: no lightning_ckpt plugin, so the checkpoint
is a stock DCP folder (``.metadata``, ``__<rank>_0.distcp``, ``meta.pt``). Then every rank gathers
the full (unsharded) model and optimizer state and rank 0 saves it with ``torch.save`` to
``full.pt``; the JSON report at ``argv[1]`` names both.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from models import TinyRegressor, trainer_kwargs  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)


class ShardedRegressor(TinyRegressor):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):  # Linear(16, 1): rank 1's shard of dim 0 is empty
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def configure_optimizers(self):
        # No scheduler: an epoch-end scheduler step runs after ModelCheckpoint saves, so the
        # optimizer's lr after fit would no longer be the checkpoint's.
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(report: str) -> None:
    seed_everything(0, workers=True)
    model = ShardedRegressor()
    checkpoint = ModelCheckpoint(dirpath="checkpoints")
    trainer = Trainer(
        max_epochs=1,
        callbacks=[checkpoint],
        enable_checkpointing=True,
        **trainer_kwargs(devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)),
    )
    trainer.fit(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # Collectives: every rank gathers, rank 0 alone gets (and saves) the full state.
    full = {
        "state_dict": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, trainer.optimizers[0], options=options),
    }
    if trainer.global_rank == 0:
        torch.save(full, "full.pt")
        with open(report, "w") as f:
            json.dump(
                {
                    "checkpoint": os.path.abspath(checkpoint.best_model_path),
                    "full": os.path.abspath("full.pt"),
                    "world_size": trainer.world_size,
                    "global_step": trainer.global_step,
                },
                f,
            )


if __name__ == "__main__":
    main(sys.argv[1])
