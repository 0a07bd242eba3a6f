"""Run by test_sharded.py as a script: Lightning's launcher re-executes it for the other ranks.

``sharded_fit.py REPORT fit N``: on N CPU ranks (gloo), FSDP2 under ``ShardedModelParallelStrategy``,
fits 2 epochs saving every epoch through ``ShardedModelCheckpoint``, with the full (gathered)
model and optimizer state at each save written to ``full-epoch<E>.pt``; then resumes from the
epoch-0 checkpoint to 2 epochs. Reports whether the resumed run's losses and final state are bit-identical.

``sharded_fit.py REPORT reshard N CKPT FULL``: on N ranks, resumes from ``CKPT`` and compares the
full state right after the restore with ``FULL`` (the state gathered when CKPT was saved).

``sharded_fit.py REPORT s3 N URL``: as ``fit``, saving to the S3 URL through a local tier
every rank shares, then resumes from the URL's epoch-0 checkpoint with a fresh local tier (rank 0
downloads it, every rank reads its shards); reports whether the resumed run ended
bit-identical and what the fresh tier holds.

``sharded_fit.py REPORT ddp 2 SPREAD``: DDP on 2 ranks, top-2 + last every 2 steps through
``ShardedModelCheckpoint``, ``spread_writes=SPREAD``; reports the files kept and the bytes each rank
wrote, then resumes from ``last`` and reports whether the run matches an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from helpers import close_process_group  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_ckpt as lc  # noqa: E402

ASYNC = os.environ.get("LCKPT_TEST_ASYNC") == "1"
CHUNKED = os.environ.get("LCKPT_TEST_CHUNKED") == "1"


class ShardedNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)
        )

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if CHUNKED:  # each rank steps its own shards on the host
            return lc.ChunkedAdamW(self.parameters(), lr=0.01, chunk_size="1KiB")
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 3, generator=g))
        return DataLoader(data, batch_size=8)


class FSDP1Net(ShardedNet):
    """The same network under FSDP (1), wrapped by the module itself as Lightning allows (each
    Linear, then the whole): Lightning 2.6 wraps with ``device_id=None``, which torch refuses on CPU."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if isinstance(self.net, FSDP):
            return
        cpu = torch.device("cpu")
        for i, layer in enumerate(self.net):
            if isinstance(layer, torch.nn.Linear):
                self.net[i] = FSDP(layer, device_id=cpu, use_orig_params=True)
        self.net = FSDP(self.net, device_id=cpu, use_orig_params=True)


def full_state(trainer: Trainer, module: LightningModule) -> dict:
    """The whole model and optimizer state (a collective: every rank calls it)."""
    # FSDP (1) on CPU: offloading (rank 0 only) clones views of freed unsharded parameters and
    # crashes in torch; without it every rank gathers the full state, already on the CPU.
    options = StateDictOptions(full_state_dict=True, cpu_offload=not isinstance(trainer.strategy, FSDPStrategy))
    optimizer = trainer.optimizers[0]
    return {
        "model": get_model_state_dict(module, options=options),
        "optimizer": get_optimizer_state_dict(module, optimizer, options=options),
    }


class Capture(Callback):
    """Writes the full state at every epoch end (before the checkpoint callback saves it)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_epoch_end(self, trainer, pl_module):
        state = full_state(trainer, pl_module)
        if trainer.is_global_zero:
            torch.save(state, os.path.join(self.folder, f"full-epoch{trainer.current_epoch}.pt"))


class CaptureRestored(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        state = full_state(trainer, pl_module)
        if trainer.is_global_zero:
            torch.save(state, self.path)
        trainer.should_stop = True


def trainer(devices: int, callbacks: list, max_epochs: int, local_dir: str | None = None, fsdp1: bool = False) -> Trainer:
    strategy = (
        lc.ShardedFSDPStrategy()
        if fsdp1
        else lc.ShardedModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    )
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=[lc.ShardedCheckpointIO(async_save=ASYNC, local_dir=local_dir)],
        callbacks=callbacks,
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def states_equal(a: dict, b: dict) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


class Losses(Callback):
    """Every training step's loss on this rank, by global step."""

    def __init__(self) -> None:
        self.by_step: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.by_step[trainer.global_step] = outputs["loss"].item()


def fit_and_resume(report: str, ckpts: str, net: type, make_trainer: Callable[[list, int], Trainer]) -> None:
    """Fit 2 epochs saving every epoch (and ``last``) into ``ckpts``, the full state at each save in
    ``full-epoch<E>.pt``; resume from the epoch-0 checkpoint to 2 epochs; report whether the resumed
    run's losses and final state are bit-identical to the uninterrupted run's."""
    folder = os.path.dirname(report)
    seed_everything(0)
    first_losses = Losses()
    checkpoint = lc.ShardedModelCheckpoint(dirpath=ckpts, save_top_k=-1, every_n_epochs=1, save_last=True)
    first = make_trainer([Capture(folder), checkpoint, first_losses], 2)
    first.fit(net())
    final = full_state(first, first.lightning_module)
    epoch0 = os.path.join(ckpts, sorted(n for n in os.listdir(ckpts) if n.startswith("epoch=0"))[0])
    seed_everything(0)
    resumed_losses = Losses()
    resumed = make_trainer([lc.ShardedModelCheckpoint(dirpath=ckpts + "-resumed", save_top_k=-1), resumed_losses], 2)
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


def fit(report: str, devices: int, fsdp1: bool = False) -> None:
    ckpts = os.path.join(os.path.dirname(report), f"ckpts-{devices}")
    net = FSDP1Net if fsdp1 else ShardedNet
    fit_and_resume(report, ckpts, net, lambda callbacks, epochs: trainer(devices, callbacks, epochs, fsdp1=fsdp1))


def s3(report: str, devices: int, url: str) -> None:
    folder = os.path.dirname(report)
    seed_everything(0)
    checkpoint = lc.ShardedModelCheckpoint(dirpath=url, save_top_k=-1, every_n_epochs=1, save_last=True)
    first = trainer(devices, [checkpoint], 2, local_dir=os.path.join(folder, "save-tier"))
    first.fit(ShardedNet())
    first.strategy.checkpoint_io.teardown()  # every upload finished
    final = full_state(first, first.lightning_module)
    fresh_tier = os.path.join(folder, "resume-tier")
    seed_everything(0)
    resumed = trainer(devices, [], 2, local_dir=fresh_tier)
    resumed.fit(ShardedNet(), ckpt_path=f"{url}/epoch=0-step=4.ckpt")
    after = full_state(resumed, resumed.lightning_module)
    if first.is_global_zero:
        import fsspec

        downloaded = [os.path.relpath(root, fresh_tier) for root, _, files in os.walk(fresh_tier) if "manifest.json" in files]
        fs, root = fsspec.core.url_to_fs(url)
        fs.invalidate_cache()
        with open(report, "w") as f:
            json.dump(
                {
                    "world_size": resumed.world_size,
                    "resumed_equals_uninterrupted": states_equal(final, after),
                    "global_step": resumed.global_step,
                    "downloaded": downloaded,
                    "remote_after_resume": sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)),
                },
                f,
            )


def reshard(report: str, devices: int, ckpt: str, full: str) -> None:
    restored = os.path.join(os.path.dirname(report), f"restored-{devices}.pt")
    seed_everything(0)
    run = trainer(devices, [CaptureRestored(restored)], 3)
    run.fit(ShardedNet(), ckpt_path=ckpt)
    if run.is_global_zero:
        saved, loaded = torch.load(full, weights_only=True), torch.load(restored, weights_only=True)
        groups = zip(saved["optimizer"]["param_groups"], loaded["optimizer"]["param_groups"])
        with open(report, "w") as f:
            json.dump({
                "world_size": run.world_size,
                "restored_equals_saved": states_equal(saved, loaded),
                "tensors_equal": states_equal(saved["model"], loaded["model"])
                and states_equal(saved["optimizer"]["state"], loaded["optimizer"]["state"]),
                # param-group keys whose values differ (another optimizer class names its own flags)
                "group_differences": sorted({k for a, b in groups for k in a.keys() | b.keys() if a.get(k) != b.get(k)}),
            }, f)  # fmt: skip


class WideNet(LightningModule):
    """Plain (replicated) parameters of several sizes, for DDP."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), *(torch.nn.Linear(64, 64) for _ in range(5)), torch.nn.Linear(64, 3))

    training_step = ShardedNet.training_step
    configure_optimizers = ShardedNet.configure_optimizers
    train_dataloader = ShardedNet.train_dataloader


def ddp(report: str, spread: bool) -> None:
    folder = os.path.join(os.path.dirname(report), f"ddp-{spread}")

    def run(max_epochs: int, ckpt_path: str | None = None) -> Trainer:
        seed_everything(0)
        checkpoint = lc.ShardedModelCheckpoint(
            dirpath=folder, monitor="train_loss", save_top_k=2, save_last=True, every_n_train_steps=2
        )
        run = Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            plugins=[lc.ShardedCheckpointIO(async_save=ASYNC, spread_writes=spread)],
            callbacks=[checkpoint],
            max_epochs=max_epochs,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        run.fit(WideNet(), ckpt_path=ckpt_path)
        return run

    first = run(2)
    # Rank 0 alone reads the folder: its saves (rank 0 writes alone with spread_writes=False) may
    # still be finishing when the other rank leaves fit, leaving lock files and removals in flight.
    kept = sorted(n for n in os.listdir(folder) if not n.startswith(".")) if first.is_global_zero else []
    bytes_by_rank: dict[int, int] = {}
    for name in kept:
        manifest = json.load(open(os.path.join(folder, name, "manifest.json")))
        for file, record in manifest["files"].items():
            if file.endswith(".safetensors"):  # the state; rank 0 also writes the small metadata files
                rank = record.get("rank", 0)
                bytes_by_rank[rank] = bytes_by_rank.get(rank, 0) + record["size"]
    resumed = run(3, ckpt_path="last")
    uninterrupted = run(3)
    same = states_equal(resumed.lightning_module.state_dict(), uninterrupted.lightning_module.state_dict())
    if first.is_global_zero:
        with open(report, "w") as f:
            json.dump(
                {
                    "kept": kept,
                    "best_k": sorted(os.path.basename(p) for p in first.checkpoint_callback.best_k_models),
                    "bytes_by_rank": bytes_by_rank,
                    "resumed_equals_uninterrupted": same,
                },
                f,
            )


if __name__ == "__main__":
    report, mode, devices = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode in ("fit", "fsdp1"):
        fit(report, devices, fsdp1=mode == "fsdp1")
    elif mode == "ddp":
        ddp(report, sys.argv[4] == "True")
    elif mode == "s3":
        s3(report, devices, sys.argv[4])
    else:
        reshard(report, devices, sys.argv[4], sys.argv[5])
    close_process_group()
