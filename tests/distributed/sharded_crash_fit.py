"""Run by test_sharded_crash.py, once per rank: the test starts both ranks itself (``LOCAL_RANK``,
``MASTER_PORT`` set, as torchrun would), in one process group, so that it can kill one rank or all.

2 CPU ranks (gloo), FSDP2 under ``ShardedModelParallelStrategy``; every save is a multi-rank save
(each rank writes its shards of the model and AdamW state, about 19 MB, in 4 MB shard files; rank 0
commits). ``part_timeout`` is 20 s, so a rank 0 whose peer died fails the save instead of waiting.

``sharded_crash_fit.py OUT CKPTS train [PAUSE_RANK PAUSE_STEP]``: trains until killed, saving every
step (``step=N`` checkpoints, all kept, and ``last``). With ``PAUSE_RANK``, that rank stops in the
first save of step ``PAUSE_STEP`` right after the first shard file of its part is durable, and
publishes ``OUT/paused-rank<R>.json``: from then on the save can neither finish nor commit, and a
kill lands mid-save for certain. An exception on a rank is published as ``OUT/error-rank<R>.json``
(type, message, cause chain) before Lightning's teardown, which may hang on a dead peer.

``sharded_crash_fit.py OUT CKPTS resume``: a fresh run in the same folder resumes from
``CKPTS/last.ckpt`` and trains 2 more steps. Rank 0 writes ``OUT/report.json``: the live state
right after the restore against ``lightning_ckpt.load_checkpoint(last.ckpt)``, and the hidden
entries of ``CKPTS`` seen as each save begins (so: before the first save, after it, ...).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_ckpt as lc  # noqa: E402
from lightning_ckpt.store.shards import ShardWriter  # noqa: E402

WIDTH = 1024  # 3 square layers: 3.1M parameters; with AdamW's two moments ~19 MB per rank per save
PART_TIMEOUT = 20.0


def publish(path: str, body: dict) -> None:
    """``path`` appears complete or not at all (the test polls for it)."""
    with open(path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(path + ".tmp", path)


class WideNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = TensorDataset(torch.randn(4096, WIDTH, generator=torch.Generator().manual_seed(0)))
        return DataLoader(data, batch_size=4)


class PauseMidSave(Callback):
    """Stops this rank inside a save: after the first shard file of its part in step ``step``.

    Wraps ``ShardWriter.write_shard`` (the sync path's shard writer); the file written before
    the pause is complete and fsynced, the part is not published, so nothing can commit it.
    """

    def __init__(self, out: str, rank: int, step: int) -> None:
        self.out, self.rank, self.step = out, rank, step
        self.armed = False
        original = ShardWriter.write_shard
        pause = self

        def write_shard(writer: ShardWriter, path: str, *args, **kwargs):
            record = original(writer, path, *args, **kwargs)
            if pause.armed:
                publish(os.path.join(pause.out, f"paused-rank{pause.rank}.json"), {"file": path, "pid": os.getpid()})
                time.sleep(3600)  # until killed
            return record

        ShardWriter.write_shard = write_shard

    def on_train_batch_end(self, trainer, *args) -> None:
        # Checkpoint callbacks run after this one: the saves of this step come next.
        self.armed = trainer.global_rank == self.rank and trainer.global_step >= self.step


class PublishErrors(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_exception(self, trainer, pl_module, exception):
        chain, error = [], exception
        while error is not None:
            chain.append(f"{type(error).__name__}: {error}")
            error = error.__cause__ or error.__context__
        body = {"type": type(exception).__name__, "message": str(exception), "chain": chain}
        publish(os.path.join(self.out, f"error-rank{trainer.global_rank}.json"), body)


def full_state(trainer: Trainer, module: LightningModule) -> dict:
    """The whole model and optimizer state (a collective: every rank calls it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(module, options=options),
        "optimizer": get_optimizer_state_dict(module, trainer.optimizers[0], options=options),
    }


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


class CheckResume(Callback):
    """Rank 0: the restored live state against the checkpoint it came from; the folder's hidden
    entries as each save begins (``on_save_checkpoint`` runs in every save, before any write)."""

    def __init__(self, out: str, ckpts: str, last: str) -> None:
        self.out, self.ckpts, self.last = out, ckpts, last
        self.report: dict = {"hidden_at_save": []}

    def on_train_start(self, trainer, pl_module):
        restored = full_state(trainer, pl_module)
        if trainer.is_global_zero:
            saved = lc.load_checkpoint(self.last)
            self.report.update(
                restored_step=trainer.global_step,
                saved_step=saved["global_step"],
                model_equal=same(restored["model"], saved["state_dict"]),
                optimizer_equal=same(restored["optimizer"], saved["optimizer_states"][0]),
            )

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.is_global_zero:
            self.report["hidden_at_save"].append(sorted(n for n in os.listdir(self.ckpts) if n.startswith(".")))

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            publish(os.path.join(self.out, "report.json"), {**self.report, "global_step": trainer.global_step})


def main(out: str, ckpts: str, mode: str, *pause: str) -> None:
    seed_everything(0)
    callbacks: list[Callback] = [PublishErrors(out)]
    last = os.path.join(ckpts, "last.ckpt")
    if mode == "train":
        max_steps, ckpt_path = -1, None
        if pause:
            callbacks.append(PauseMidSave(out, int(pause[0]), int(pause[1])))
    else:
        max_steps, ckpt_path = lc.load_checkpoint(last, verify=False)["global_step"] + 2, last
        callbacks.append(CheckResume(out, ckpts, last))
    checkpoint = lc.ShardedModelCheckpoint(
        dirpath=ckpts,
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=-1,
        save_last=True,
        release_memory=False,
        metrics_file=None,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lc.ShardedModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[lc.ShardedCheckpointIO(max_shard_size="4MB", part_timeout=PART_TIMEOUT)],
        callbacks=[*callbacks, checkpoint],
        max_steps=max_steps,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(WideNet(), ckpt_path=ckpt_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
