"""Incremental saves with a real Trainer: a frozen backbone's shards are written once per run,
every checkpoint stays complete and loads bit for bit, and no change is ever missed."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import disk_usage, each_alone, flip_byte
from lightning.pytorch import Callback, Trainer, seed_everything
from models import FrozenBackbone, trainer_kwargs

import lightning_ckpt as lc

STABLE = "model-stable-00001-of-00001.safetensors"


class Capture(Callback):
    """The model state each save holds, by global step (what its checkpoint must load as)."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.states[checkpoint["global_step"]] = {k: v.clone() for k, v in checkpoint["state_dict"].items()}


def _fit(dirpath, io, steps: int, ckpt_path=None, callbacks=(), **checkpoint_options) -> Capture:
    seed_everything(0, workers=True)
    capture = Capture()
    options = dict(every_n_train_steps=1, save_top_k=-1, metrics_file=None)
    options.update(checkpoint_options)
    checkpoint = lc.ShardedModelCheckpoint(dirpath=dirpath, filename="{step}", **options)
    trainer = Trainer(
        max_steps=steps, callbacks=[checkpoint, capture, *callbacks], plugins=[io], **trainer_kwargs()
    )
    trainer.fit(FrozenBackbone(), ckpt_path=ckpt_path)
    capture.checkpoint = checkpoint
    return capture


def _size(folder) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


def assert_each_loads_alone(folder, states: dict[int, dict[str, torch.Tensor]]) -> None:
    """Every checkpoint in ``folder`` verifies and loads as ``states[its step]`` once every other
    checkpoint is deleted."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))
    assert names
    for keep, alone in each_alone(folder, names):
        lc.verify_checkpoint(alone)
        loaded = lc.load_checkpoint(alone)
        expected = states[loaded["global_step"]]
        assert loaded["state_dict"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(loaded["state_dict"][key], value), (keep, key)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_frozen_backbone_is_written_once_and_every_checkpoint_stands_alone(tmp_path, async_save):
    io = lc.ShardedCheckpointIO(async_save=async_save)
    capture = _fit(tmp_path / "ckpts", io, steps=5)
    folder = tmp_path / "ckpts"
    names = sorted(os.listdir(folder), key=lambda n: int(n.split("=")[1].split(".")[0]))
    assert len(names) == 5
    stable_inodes = {os.stat(folder / n / STABLE).st_ino for n in names}
    assert len(stable_inodes) == 1  # one file, linked into every checkpoint
    # The folder grows per save by what changed: the head, the optimizer, metadata and manifest.
    full, stable = _size(folder / names[0]), os.path.getsize(folder / names[0] / STABLE)
    assert stable > 0.9 * full
    assert abs(disk_usage(folder) - (full + 4 * (full - stable))) < 0.01 * full
    records = capture.checkpoint.save_records
    # Reused: the backbone, and whatever small state did not change either (the callback's scores).
    assert records[0]["reused_bytes"] == 0
    assert all(stable <= r["reused_bytes"] < stable + 0.01 * full for r in records[1:]), records
    assert all(r["written_bytes"] == r["nbytes"] - r["reused_bytes"] for r in records)
    assert_each_loads_alone(folder, capture.states)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_copy_mode_gives_every_checkpoint_bytes_of_its_own(tmp_path, async_save):
    """``incremental="copy"``: the unchanged backbone is neither staged nor hashed again, but copied
    (reflink or in-kernel copy), so one checkpoint's damaged file leaves the others intact."""
    io = lc.ShardedCheckpointIO(async_save=async_save, incremental="copy")
    capture = _fit(tmp_path / "ckpts", io, steps=3)
    folder = tmp_path / "ckpts"
    names = sorted(os.listdir(folder), key=lambda n: int(n.split("=")[1].split(".")[0]))
    stats = [os.stat(folder / n / STABLE) for n in names]
    assert len({s.st_ino for s in stats}) == 3 and all(s.st_nlink == 1 for s in stats)
    stable = stats[0].st_size
    records = capture.checkpoint.save_records
    assert all(stable <= r["reused_bytes"] for r in records[1:]), records  # reused: not staged, hashed or written
    assert_each_loads_alone(folder, capture.states)
    flip_byte(folder / names[1] / STABLE, 100)
    with pytest.raises(lc.CorruptCheckpointError):
        lc.verify_checkpoint(folder / names[1])
    for name in (names[0], names[2]):
        lc.verify_checkpoint(folder / name)


@pytest.mark.parametrize("mode", ["link", "copy"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_last_in_the_same_step_as_a_top_k_file_reuses_all_of_it(tmp_path, async_save, mode):
    """``last.ckpt`` right after a top-k checkpoint of the same step holds the same shard files:
    taken from it (linked, or copied), in sync mode and in async mode, where that checkpoint is
    still being written when ``last.ckpt`` is saved (the writer takes them once it committed)."""
    io = lc.ShardedCheckpointIO(async_save=async_save, incremental=mode)
    capture = _fit(tmp_path / "ckpts", io, steps=4, save_last=True)
    folder = tmp_path / "ckpts"
    shards = sorted(n for n in os.listdir(folder / "last.ckpt") if n.endswith(".safetensors"))
    same = {n: os.path.samefile(folder / "last.ckpt" / n, folder / "step=4.ckpt" / n) for n in shards}
    assert same == dict.fromkeys(shards, mode == "link")
    records = {r["path"].rsplit(os.sep, 1)[-1]: r for r in capture.checkpoint.save_records}
    last = records["last.ckpt"]
    assert last["written_bytes"] == last["nbytes"] - last["reused_bytes"]
    assert last["reused_bytes"] == sum(os.path.getsize(folder / "last.ckpt" / n) for n in shards)
    assert_each_loads_alone(folder, capture.states)


def test_an_unknown_incremental_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="incremental"):
        lc.ShardedCheckpointIO(incremental="reflink")


class Meddle(Callback):
    """Changes the frozen backbone between saves, each way a reuse could be wrong."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step, layers = trainer.global_step, pl_module.backbone
        if step == 2:
            with torch.no_grad():
                layers[0].weight.mul_(0.5)  # frozen, changed in place
        elif step == 3:
            layers[1].weight.data = torch.randn_like(layers[1].weight)  # replaced
        elif step == 4:  # unfrozen mid-run: trained from now on
            layers[2].requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(layers[2].parameters())})


def test_changes_to_frozen_weights_are_always_written(tmp_path):
    capture = _fit(tmp_path / "ckpts", lc.ShardedCheckpointIO(), steps=7, callbacks=[Meddle()])
    folder = tmp_path / "ckpts"
    inode = {step: os.stat(folder / f"step={step}.ckpt" / STABLE).st_ino for step in range(1, 8)}
    # Meddled before the saves of steps 3, 4 and 5: a new file each; otherwise the previous one.
    assert [inode[step] == inode[step - 1] for step in range(2, 8)] == [True, False, False, False, True, True]
    unfrozen = {"backbone.2.weight", "backbone.2.bias"}
    assert unfrozen & set(lc.load_checkpoint(folder / "step=5.ckpt")["state_dict"])
    assert not unfrozen & set(safe_open_keys(folder / "step=5.ckpt" / STABLE))
    assert_each_loads_alone(tmp_path / "ckpts", capture.states)


def safe_open_keys(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_a_resumed_run_writes_its_first_checkpoint_and_reuses_within_itself(tmp_path):
    folder = tmp_path / "ckpts"
    first = _fit(folder, lc.ShardedCheckpointIO(), steps=2, save_last=True)
    before = {os.stat(folder / n / STABLE).st_ino for n in os.listdir(folder)}
    second = _fit(folder, lc.ShardedCheckpointIO(), steps=4, ckpt_path=folder / "last.ckpt", save_last=True)
    records = second.checkpoint.save_records
    assert records[0]["reused_bytes"] == 0  # a new plugin: nothing is known about the old files
    assert all(r["reused_bytes"] > 0 for r in records[1:])
    after = {os.stat(folder / n / STABLE).st_ino for n in ("step=3.ckpt", "step=4.ckpt", "last.ckpt")}
    assert len(after) == 1 and not after & before
    assert_each_loads_alone(folder, {**first.states, **second.states})


def test_async_save_after_the_previous_checkpoint_was_removed_behind_the_plugins_back(tmp_path):
    model = FrozenBackbone(width=64)
    io = lc.ShardedCheckpointIO(async_save=True)
    io.track_frozen(model)
    try:
        for name, reused in (("a.ckpt", False), ("b.ckpt", False), ("c.ckpt", True)):
            io.save_checkpoint({"state_dict": model.state_dict(), "global_step": 0}, tmp_path / name)
            io.wait()
            assert (io.last_save.reused_bytes > 0) == reused, name
            if name == "a.ckpt":
                shutil.rmtree(tmp_path / name)  # not through the plugin: b is written whole, not linked
        for name in ("b.ckpt", "c.ckpt"):
            lc.verify_checkpoint(tmp_path / name)
            assert torch.equal(lc.load_checkpoint(tmp_path / name)["state_dict"]["backbone.0.weight"], model.backbone[0].weight)
    finally:
        io.teardown()
