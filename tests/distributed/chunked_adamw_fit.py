"""Run by test_chunked_adamw_ddp.py as a script: Lightning's DDP launcher re-executes it for rank 1.

2 CPU ranks (gloo), DDP: ChunkedAdamW (each rank holding and stepping its share of the chunks)
against torch.optim.AdamW(fused=True) under the same DDP run, against one process on the same
global batch, and a ShardedCheckpointIO save at the end of epoch 1 resumed to the end of epoch 2
against the uninterrupted run. Rank 0 writes a JSON report to ``argv[1]``.

``argv[2] == "gpu"`` (2 CUDA devices, NCCL): the updated values sent over NCCL
(``exchange="device"``) against the host exchange (``exchange="host"``): the same CPU kernel
on the same gradients, so the weights must be equal bit for bit.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import trainer_kwargs  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_ckpt as lc  # noqa: E402
from lightning_ckpt.offload.chunks import plan_chunks  # noqa: E402

BATCH = 4  # per rank; the single-process run takes 2 * BATCH
EPOCH = 4  # optimizer steps per epoch on 2 ranks


class Net(LightningModule):
    def __init__(self, chunked: bool, exchange: str = "auto") -> None:
        super().__init__()
        self.chunked = chunked
        self.exchange = exchange
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(9, 31), torch.nn.Tanh(), torch.nn.Linear(31, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3)
        )
        self.losses: list[float] = []
        self.host_bytes: int | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layers(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.chunked:
            # the one-process reference runs on rank 0 beside the live 2-rank group: not sharded
            shard = self.trainer.world_size > 1
            optimizer = lc.ChunkedAdamW(
                self.parameters(), lr=1e-2, chunk_size=400, shard_across_ranks=shard, exchange=self.exchange
            )
            self.host_bytes = optimizer.host_bytes
            self.exchange_backend = optimizer.exchange_backend
            return optimizer
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(2 * BATCH * EPOCH, 9, generator=gen)
        y = torch.randn(2 * BATCH * EPOCH, 3, generator=gen)
        world = self.trainer.world_size
        if world > 1:  # rank r takes the r-th half of every global batch of the one-process run
            rank = self.trainer.global_rank
            x, y = (t.view(EPOCH, world, BATCH, -1)[:, rank].reshape(EPOCH * BATCH, -1) for t in (x, y))
        return DataLoader(TensorDataset(x, y), batch_size=2 * BATCH // world)


def fit(chunked: bool, max_steps: int, devices: int = 2, dirpath=None, ckpt_path=None, exchange="auto", accelerator="cpu"):
    seed_everything(0, workers=True)
    model = Net(chunked, exchange)
    callbacks = [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=EPOCH, save_top_k=-1)] if dirpath else []
    strategy = "ddp" if devices > 1 else "auto"
    trainer = Trainer(
        **trainer_kwargs(
            devices=devices, strategy=strategy, max_steps=max_steps, callbacks=callbacks,
            enable_checkpointing=bool(dirpath), plugins=[lc.ShardedCheckpointIO()] if dirpath or ckpt_path else None,
            use_distributed_sampler=False, accelerator=accelerator,
        )
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    if chunked:
        trainer.optimizers[0].wait()
    return trainer, model


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def main(report: str) -> None:
    folder = os.path.join(os.path.dirname(report), "ckpts")
    trainer, chunked = fit(True, 2 * EPOCH)
    optimizer = trainer.optimizers[0]
    # the arena one rank would need for every chunk (the same 4 KiB alignment per tensor)
    unsharded_bytes = plan_chunks([(0, p.numel(), p.dtype) for p in chunked.parameters()], 100).nbytes
    owned = [c.spec.index for c in optimizer._chunks if c.owned]
    _, adamw = fit(False, 2 * EPOCH)
    fit(True, EPOCH, dirpath=folder)
    (name,) = sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))
    resumed_trainer, resumed = fit(True, 2 * EPOCH, ckpt_path=os.path.join(folder, name))
    gathered = resumed_trainer.strategy.all_gather(flat(resumed))
    owned_all = resumed_trainer.strategy.all_gather(torch.tensor([len(owned)]))
    rank = trainer.global_rank
    if rank == 0:
        _, single = fit(True, 2 * EPOCH, devices=1)
        saved = lc.load_checkpoint(os.path.join(folder, name))
        with open(report, "w") as f:
            json.dump(
                {
                    "world_size": trainer.world_size,
                    "exchange_backend": chunked.exchange_backend,
                    "chunks": len(optimizer._chunks),
                    "owned_per_rank": [int(n) for n in owned_all.flatten()],
                    "host_bytes": chunked.host_bytes,
                    "unsharded_bytes": unsharded_bytes,
                    "equals_adamw_ddp": torch.equal(flat(chunked), flat(adamw)),
                    "losses_equal_adamw_ddp": chunked.losses == adamw.losses,
                    "max_diff_single_process": float((flat(chunked) - flat(single)).abs().max()),
                    "resumed_equals_uninterrupted": torch.equal(flat(resumed), flat(chunked)),
                    "ranks_agree": all(torch.equal(gathered[0], g) for g in gathered),
                    "saved_state_params": len(saved["optimizer_states"][0]["state"]),
                    "saved_state_keys": sorted(saved["optimizer_states"][0]["state"][0]),
                },
                f,
            )


def main_gpu(report: str) -> None:
    _, host = fit(True, 2 * EPOCH, exchange="host", accelerator="gpu")
    device_trainer, device = fit(True, 2 * EPOCH, exchange="device", accelerator="gpu")
    # fit's teardown moved the model to the CPU; NCCL gathers CUDA tensors
    gathered = device_trainer.strategy.all_gather(flat(device).to(device_trainer.strategy.root_device))
    if device_trainer.global_rank == 0:
        with open(report, "w") as f:
            json.dump(
                {
                    "world_size": device_trainer.world_size,
                    "backends": [host.exchange_backend, device.exchange_backend],
                    "device_equals_host": torch.equal(flat(device).cpu(), flat(host).cpu()),
                    "losses_equal": device.losses == host.losses,
                    "ranks_agree": all(torch.equal(gathered[0], g) for g in gathered),
                },
                f,
            )


if __name__ == "__main__":
    if sys.argv[2:] == ["gpu"]:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic=True on CUDA
        main_gpu(sys.argv[1])
    else:
        main(sys.argv[1])
    close_process_group()
