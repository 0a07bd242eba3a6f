"""Run by test_read_once_ddp.py on each of 2 CPU ranks that Lightning sees as 2 nodes (``num_nodes=2``,
one device each; ``NODE_RANK`` and ``LOCAL_RANK=0`` set, as a multi-node launcher would).

Fits 2 steps with ``ShardedModelCheckpoint`` (rank 0 writes: ranks on several nodes do not spread
writes), then resumes with ``ckpt_path`` to 4 steps. ``argv[3]``: ``once`` (default options) or
``flip`` (rank 0 flips a byte of the largest shard before the resume, which must then fail on both
ranks naming it). Each rank writes ``<out>/rank<r>.json``: what its resume load read (the
plugin's ``last_load``, and the bytes its read system calls returned, /proc/self/io ``rchar``),
a digest of the state it loaded, and the error it raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from helpers import close_process_group, flip_byte  # noqa: E402
from lightning.pytorch import LightningModule, Trainer, seed_everything  # noqa: E402
from models import trainer_kwargs  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_ckpt as lc  # noqa: E402
from lightning_ckpt.format.reader import read_manifest, shard_names  # noqa: E402


class Wide(LightningModule):
    """~3.1 MB of weights and twice that of AdamW state: a dozen shard files at 1 MB."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(12)))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 256, generator=torch.Generator().manual_seed(0))), batch_size=4)


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def digest(checkpoint: dict) -> str:
    h = hashlib.sha256()
    for key, value in sorted(checkpoint["state_dict"].items()):
        h.update(key.encode() + value.numpy().tobytes())
    for state in checkpoint["optimizer_states"][0]["state"].values():
        h.update(state["exp_avg"].numpy().tobytes() + state["exp_avg_sq"].numpy().tobytes())
    return h.hexdigest()


def fit(ckpts: str, steps: int, ckpt_path: str | None, report: dict) -> Trainer:
    seed_everything(0)
    io = lc.ShardedCheckpointIO(max_shard_size="1MB")
    load = io.load_checkpoint

    def counted(path, *args, **kwargs):
        before = rchar()
        checkpoint = load(path, *args, **kwargs)
        report.update(rchar=rchar() - before, loaded_digest=digest(checkpoint))
        return checkpoint

    io.load_checkpoint = counted
    callback = lc.ShardedModelCheckpoint(dirpath=ckpts, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(
        max_steps=steps, callbacks=[callback], plugins=[io], **trainer_kwargs(strategy="ddp", devices=1, num_nodes=2)
    )
    try:
        trainer.fit(Wide(), ckpt_path=ckpt_path)
    except lc.CorruptCheckpointError as err:
        report.update(error=str(err), error_file=err.file)
    record = callback.load_record
    if record is not None:
        report.update(
            read_once=record.read_once, bytes_read=record.bytes_read, total_bytes=record.total_bytes,
            load_s=record.seconds, metrics=record.metrics(),
        )
    return trainer


def main(out: str, ckpts: str, how: str) -> None:
    first: dict = {}
    trainer = fit(ckpts, 2, None, first)
    rank = trainer.global_rank
    trainer.strategy.barrier()  # rank 0 wrote the checkpoint alone: committed before any rank reads it
    saved = os.path.join(ckpts, "step=2.ckpt")
    report = {"rank": rank, "world_size": trainer.world_size, "num_nodes": trainer.num_nodes, "first_load": first}
    manifest = read_manifest(saved)
    report["shard_files"] = len(shard_names(manifest))
    report["saved_digest"] = digest(lc.load_checkpoint(saved))
    if how == "flip" and rank == 0:
        name = max(shard_names(manifest), key=lambda n: manifest.files[n].size)
        flip_byte(os.path.join(saved, name), manifest.files[name].size - 9)
        report["flipped"] = name
    trainer.strategy.barrier()
    resumed = fit(ckpts, 4, saved, report)
    report["global_step"] = resumed.global_step
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "once")
    close_process_group()
