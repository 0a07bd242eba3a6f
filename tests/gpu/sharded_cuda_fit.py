"""Run by test_sharded_cuda.py: ``sharded_cuda_fit.py REPORT fsdp|fsdp2 [async]`` on
``LCKPT_TEST_DEVICES`` GPUs (default 1; with one, FSDP1 runs ``NO_SHARD`` and sees no sharded values).

Fits 2 epochs under ``ShardedFSDPStrategy`` (FSDP1, ``state_dict_type="sharded"``) or
``ShardedModelParallelStrategy`` (FSDP2), saving every epoch in our format; resumes from the
epoch-0 checkpoint to 2 epochs; reports whether the resumed run ends bit-identical, and writes the
final full model state to ``final.pt`` beside the report.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt as lc

MODE = sys.argv[2]
ASYNC = len(sys.argv) > 3 and sys.argv[3] == "async"
DEVICES = int(os.environ.get("LCKPT_TEST_DEVICES", "1"))


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))

    def configure_model(self) -> None:
        if MODE == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)), batch_size=8)


def run(folder: str, ckpt_path: str | None = None) -> Trainer:
    seed_everything(0)
    torch.use_deterministic_algorithms(True)
    if MODE == "fsdp":
        strategy = lc.ShardedFSDPStrategy(auto_wrap_policy={torch.nn.Linear})
    else:
        strategy = lc.ShardedModelParallelStrategy(data_parallel_size=DEVICES, tensor_parallel_size=1)
    trainer = Trainer(
        accelerator="cuda",
        devices=DEVICES,
        strategy=strategy,
        plugins=[lc.ShardedCheckpointIO(async_save=ASYNC)],
        callbacks=[lc.ShardedModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_epochs=1)],
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), ckpt_path=ckpt_path)
    return trainer


def full(trainer: Trainer) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(trainer.strategy.model, options=options)


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    report = sys.argv[1]
    folder = os.path.join(os.path.dirname(report), "ckpts")
    trainer = run(folder)
    first = full(trainer)  # a collective; the full state is on rank 0 only
    if trainer.is_global_zero:
        torch.save(first, os.path.join(os.path.dirname(report), "final.pt"))
    epoch0 = os.path.join(folder, sorted(n for n in os.listdir(folder) if n.startswith("epoch=0"))[0])
    resumed = full(run(folder + "-resumed", ckpt_path=epoch0))
    if not trainer.is_global_zero:
        sys.exit(0)
    with open(report, "w") as f:
        json.dump(
            {
                "checkpoints": sorted(os.listdir(folder)),
                "resumed_equals_uninterrupted": first.keys() == resumed.keys()
                and all(torch.equal(first[k], resumed[k]) for k in first),
            },
            f,
        )
