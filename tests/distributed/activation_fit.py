"""Run by test_activation_distributed.py as a script (Lightning's launcher re-executes it for rank 1).

``argv[2]`` picks the strategy: ``ddp``, ``fsdp2`` (``ModelParallelStrategy``, FSDP2
``fully_shard`` of every block and the root inside ``configure_model``) or ``fsdp1``
(``ShardedFSDPStrategy``, each block an FSDP unit wrapped in ``configure_model``), 2 CPU ranks
over gloo.
Fits a few steps without activation checkpointing, with the ``ActivationCheckpointing`` callback,
and (fsdp2) with ``apply_activation_checkpointing`` called in ``configure_model`` before
``fully_shard``; rank 0 writes a JSON report to ``argv[1]`` comparing losses and full weights.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from activation_models import Block, fit_decoder  # noqa: E402
from activation_models import Decoder as _Decoder  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402

import lightning_ckpt as lc  # noqa: E402
from lightning_ckpt.lightning.activation import checkpointed_paths  # noqa: E402

LAYERS, STEPS = 2, 3
STRATEGY = sys.argv[2]


class Decoder(_Decoder):
    """Two blocks; with ``helper``, ``apply_activation_checkpointing`` in ``configure_model``
    before (fsdp2) ``fully_shard`` of every block and the root."""

    def __init__(self, helper: bool = False) -> None:
        super().__init__(layers=LAYERS, samples=4 * STEPS * 2)
        self.helper = helper

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        super().configure_model()
        if self.helper:  # explicitly before fully_shard
            lc.apply_activation_checkpointing(self, {Block})
        if STRATEGY == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)
        elif STRATEGY == "fsdp1":  # each block its own FSDP unit (Lightning 2.6 cannot wrap on CPU)
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            for i, block in enumerate(self.blocks):
                self.blocks[i] = FSDP(block, device_id=torch.device("cpu"), use_orig_params=True)


def fit(callbacks=(), helper: bool = False) -> tuple[Trainer, Decoder]:
    seed_everything(0, workers=True)
    if STRATEGY == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    elif STRATEGY == "fsdp1":
        strategy = lc.ShardedFSDPStrategy()
    else:
        strategy = "ddp"
    return fit_decoder(Decoder(helper=helper), callbacks, max_steps=STEPS, devices=2, strategy=strategy)


def full_weights(model: Decoder) -> list[torch.Tensor]:
    """Every parameter as a full tensor (FSDP2's DTensors are gathered: a collective)."""
    return [
        (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone() for t in model.state_dict().values()
    ]


def main(report: str) -> None:
    plain_trainer, plain = fit()
    runs = {"callback": fit([lc.ActivationCheckpointing(policy={Block})])}
    if STRATEGY == "fsdp2":
        runs["helper"] = fit(helper=True)
    reference = full_weights(plain)
    result = {"world_size": plain_trainer.world_size, "keys": list(plain.state_dict())}
    for name, (trainer, model) in runs.items():
        weights = full_weights(model)
        result[name] = {
            "losses_equal": model.losses == plain.losses,
            "weights_equal": all(torch.equal(a, b) for a, b in zip(weights, reference)),
            "keys_equal": list(model.state_dict()) == result["keys"],
            "checkpointed": model.seen_checkpointed,
            "block_runs": [b.runs for b in model.blocks],
            "removed_after_fit": checkpointed_paths(model) == [] if name == "callback" else None,
        }
    # Every rank must reach the same verdicts (rank 1's losses are on its own half of the data).
    verdicts = torch.tensor([int(r["losses_equal"] and r["weights_equal"]) for r in result.values() if isinstance(r, dict)])
    gathered = plain_trainer.strategy.all_gather(verdicts)
    result["all_ranks_equal"] = bool(gathered.all())
    result["plain_block_runs"] = [b.runs for b in plain.blocks]
    if plain_trainer.global_rank == 0:
        with open(report, "w") as f:
            json.dump(result, f)
    close_process_group()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main(sys.argv[1])
