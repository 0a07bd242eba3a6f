"""Run by test_stock_strategies.py as a script: Lightning's launcher re-executes it for the other ranks.

Lightning's own strategies, unchanged, with the plugin and ``ShardedModelCheckpoint`` (the three
lines): STRATEGY is ``fsdp2`` (``ModelParallelStrategy``), ``fsdp2-full``
(``ModelParallelStrategy(save_distributed_checkpoint=False)``: rank 0 writes the gathered full
state) or ``fsdp1`` (``FSDPStrategy(state_dict_type="sharded")``). Lightning refuses
``FSDPStrategy`` itself on the CPU (by exact type), so FSDP runs as a user's subclass of it, which
must keep working anyway. ``FSDPStrategy()``'s full-state save does not run on the CPU (torch
crashes gathering FSDP1's full state with ``offload_to_cpu`` there): ``fsdp2-full`` covers loading
full-state saves.

``stock_fit.py REPORT fit STRATEGY N``: on N CPU ranks (gloo), ``sharded_fit.fit_and_resume``: fit,
save every epoch, resume from epoch 0; are the resumed losses and final state bit-identical?

``stock_fit.py REPORT reshard STRATEGY N CKPT FULL``: on N ranks, resumes from ``CKPT`` and compares
the full state right after the restore with ``FULL`` (the state gathered when CKPT was saved).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from distributed.sharded_fit import (  # noqa: E402
    CaptureRestored,
    FSDP1Net,
    ShardedNet,
    fit_and_resume,
    states_equal,
)
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

import lightning_ckpt as lc  # noqa: E402


class UserFSDPStrategy(FSDPStrategy):
    """A user's subclass: Lightning's CPU refusal checks for ``FSDPStrategy`` exactly."""


def trainer(strategy: str, devices: int, callbacks: list, max_epochs: int) -> Trainer:
    stock = {
        "fsdp2": lambda: ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1),
        "fsdp2-full": lambda: ModelParallelStrategy(devices, 1, save_distributed_checkpoint=False),
        "fsdp1": lambda: UserFSDPStrategy(state_dict_type="sharded"),
    }[strategy]()
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=stock,
        plugins=[lc.ShardedCheckpointIO()],
        callbacks=callbacks,
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit(report: str, strategy: str, devices: int) -> None:
    ckpts = os.path.join(os.path.dirname(report), f"ckpts-{strategy}")
    net = FSDP1Net if strategy.startswith("fsdp1") else ShardedNet
    fit_and_resume(report, ckpts, net, lambda callbacks, epochs: trainer(strategy, devices, callbacks, epochs))


def reshard(report: str, strategy: str, devices: int, ckpt: str, full: str) -> None:
    folder = os.path.dirname(report)
    restored = os.path.join(folder, f"restored-{devices}.pt")
    net = FSDP1Net if strategy.startswith("fsdp1") else ShardedNet
    seed_everything(0)
    callbacks = [CaptureRestored(restored), lc.ShardedModelCheckpoint(dirpath=os.path.join(folder, f"reshard-{devices}"))]
    run = trainer(strategy, devices, callbacks, 3)
    run.fit(net(), ckpt_path=ckpt)
    if run.is_global_zero:
        same = states_equal(torch.load(full, weights_only=True), torch.load(restored, weights_only=True))
        with open(report, "w") as f:
            json.dump({"world_size": run.world_size, "restored_equals_saved": same}, f)


if __name__ == "__main__":
    report, mode, strategy, devices = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if mode == "fit":
        fit(report, strategy, devices)
    else:
        reshard(report, strategy, devices, sys.argv[5], sys.argv[6])
    close_process_group()
