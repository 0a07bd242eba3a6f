"""Run by test_stock_strategies.py as a script: Lightning's launcher re-executes it for the other ranks.

Lightning's own strategies, unchanged, with the plugin and ``ShardedModelCheckpoint`` (the three
lines): STRATEGY is ``fsdp2`` (``ModelParallelStrategy``), ``fsdp1`` (``FSDPStrategy(state_dict_type=
"sharded")``) or ``fsdp1-full`` (``FSDPStrategy()``, whose full-state saves rank 0 writes alone).
Lightning refuses ``FSDPStrategy`` itself on the CPU (by exact type), so FSDP runs as a user's
subclass of it, which is what must keep working anyway.

``stock_fit.py REPORT fit STRATEGY N``: on N CPU ranks (gloo), fits 2 epochs saving every epoch
(and ``last``), with the full state at each save written to ``full-epoch<E>.pt``; then resumes
from the epoch-0 checkpoint to 2 epochs. Reports whether the resumed run's losses and final state
are bit-identical to the uninterrupted run's.

``stock_fit.py REPORT reshard STRATEGY N CKPT FULL``: on N ranks, resumes from ``CKPT`` and compares
the full state right after the restore with ``FULL`` (the state gathered when CKPT was saved).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from distributed.sharded_fit import Capture, CaptureRestored, FSDP1Net, ShardedNet, full_state, states_equal  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

import lightning_ckpt as lc  # noqa: E402


class UserFSDPStrategy(FSDPStrategy):
    """A user's subclass: Lightning's CPU refusal checks for ``FSDPStrategy`` exactly."""


class Losses(Callback):
    """Every training step's loss on this rank, by global step."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.by_step[trainer.global_step] = outputs["loss"].item()


def trainer(strategy: str, devices: int, callbacks: list, max_epochs: int) -> Trainer:
    stock = {
        "fsdp2": lambda: ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1),
        "fsdp2-full": lambda: ModelParallelStrategy(devices, 1, save_distributed_checkpoint=False),
        "fsdp1": lambda: UserFSDPStrategy(state_dict_type="sharded"),
        "fsdp1-full": lambda: UserFSDPStrategy(),
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
    folder = os.path.dirname(report)
    ckpts = os.path.join(folder, f"ckpts-{strategy}")
    net = FSDP1Net if strategy.startswith("fsdp1") else ShardedNet
    seed_everything(0)
    first_losses = Losses()
    checkpoint = lc.ShardedModelCheckpoint(dirpath=ckpts, save_top_k=-1, every_n_epochs=1, save_last=True)
    first = trainer(strategy, devices, [Capture(folder), checkpoint, first_losses], 2)
    first.fit(net())
    final = full_state(first, first.lightning_module)
    epoch0 = os.path.join(ckpts, sorted(n for n in os.listdir(ckpts) if n.startswith("epoch=0"))[0])
    seed_everything(0)
    resumed_losses = Losses()
    callbacks = [lc.ShardedModelCheckpoint(dirpath=ckpts + "-resumed", save_top_k=-1), resumed_losses]
    resumed = trainer(strategy, devices, callbacks, 2)
    resumed.fit(net(), ckpt_path=epoch0)
    after = full_state(resumed, resumed.lightning_module)
    if first.is_global_zero:
        with open(report, "w") as f:
            json.dump(
                {
                    "world_size": first.world_size,
                    "strategy": type(resumed.strategy).__name__,
                    "checkpoints": sorted(os.listdir(ckpts)),
                    "resumed_steps": sorted(resumed_losses.by_step),
                    "losses_equal": resumed_losses.by_step == {s: first_losses.by_step[s] for s in resumed_losses.by_step},
                    "resumed_equals_uninterrupted": states_equal(final, after),
                    "global_step": resumed.global_step,
                },
                f,
            )


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
