"""Incremental saves: the exact change rule, the planner's stable shards, reuse on disk."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import pytest
import torch
from helpers import disk_usage, each_alone

import lightning_ckpt as lc
from lightning_ckpt import ShardedCheckpointIO
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format import plan as plan_module
from lightning_ckpt.format.plan import make_plan, stable_shard_size
from lightning_ckpt.format.reader import read_manifest
from lightning_ckpt.save.changes import Snapshot, Tracker, frozen_keys, stable_predicate
from lightning_ckpt.store.reuse import (
    Reused,
    ReuseUnavailable,
    file_id,
    place_all,
    place_reused,
    stored_files,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    model[1].eval()
    return model


def _checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, step: int = 0) -> dict:
    checkpoint = {"state_dict": model.state_dict(), "global_step": step}
    if optimizer is not None:
        checkpoint["optimizer_states"] = [optimizer.state_dict()]
    return checkpoint


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _files(folder) -> dict[str, os.stat_result]:
    return {name: os.stat(os.path.join(folder, name)) for name in os.listdir(folder)}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------- planning


def test_frozen_keys_are_frozen_parameters_and_buffers_of_frozen_eval_modules():
    model = _model()
    assert frozen_keys(model) == {
        "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked",
    }
    model[1].train()  # BatchNorm in train mode updates its statistics every forward
    assert "1.running_mean" not in frozen_keys(model) and "1.weight" in frozen_keys(model)


def test_stable_tensors_get_shards_of_their_own_and_the_rest_keeps_its_layout():
    model = _model()
    checkpoint = _checkpoint(model)
    plain = make_plan(checkpoint, 2**30)
    grouped = make_plan(checkpoint, 2**30, stable_predicate(frozen_keys(model)))
    assert [s.filename for s in plain.shards] == ["model-00001-of-00001.safetensors"]
    assert [s.filename for s in grouped.shards] == [
        "model-00001-of-00001.safetensors",
        "model-stable-00001-of-00001.safetensors",
    ]
    assert {b.name for b in grouped.shards[0].blobs} == {"2.weight", "2.bias"}
    # Nothing stable: byte for byte the layout without the hint (golden checkpoints unchanged).
    none = make_plan(checkpoint, 2**30, lambda component, path: False)
    assert none.without_data().shards == plain.without_data().shards and none.tensors == plain.tensors


# --------------------------------------------------------------------------------- the rule


def _tracked(tmp_path, tensors: dict[str, torch.Tensor]) -> tuple[Tracker, str]:
    """A tracker that has seen a committed save of ``tensors`` (one shard per tensor)."""
    target = str(tmp_path / "a.ckpt")
    checkpoint = {"state_dict": tensors}
    plan = make_plan(checkpoint, 1)
    lc.save_checkpoint(checkpoint, target, max_shard_size=1)
    tracker = Tracker()
    tracker.committed(Snapshot.of(plan), target, stored_files(target, read_manifest(target).files, plan))
    return tracker, str(tmp_path / "b.ckpt")


def _reused(tracker: Tracker, target: str, tensors: dict[str, torch.Tensor]) -> set[str]:
    plan = make_plan({"state_dict": tensors}, 1)
    by_file = {s.filename: s.blobs[0].name for s in plan.shards}
    return {by_file[f] for f in tracker.reuse(Snapshot.of(plan), target)}


def test_unchanged_tensors_are_reused_and_every_kind_of_change_is_written(tmp_path):
    frozen = torch.nn.Parameter(torch.randn(16), requires_grad=False)
    swapped = torch.nn.Parameter(torch.randn(16))
    viewed = torch.randn(4, 4)
    kept = torch.randn(16)
    tensors = lambda: {  # noqa: E731 - a fresh state dict each time, as Lightning takes one per save
        "frozen": frozen.detach(), "swapped": swapped.detach(), "viewed": viewed.detach(), "kept": kept.detach()
    }
    tracker, target = _tracked(tmp_path, tensors())
    assert _reused(tracker, target, tensors()) == {"frozen", "swapped", "viewed", "kept"}

    with torch.no_grad():
        frozen.mul_(1.0)  # frozen is no proof: an in-place write, even of the same values
    swapped.data = torch.randn(16)  # a new storage
    viewed[0].add_(0)  # through a view: the version counter is shared
    assert _reused(tracker, target, tensors()) == {"kept"}


def test_a_freed_storage_whose_address_is_reused_is_not_mistaken_for_the_old_one(tmp_path):
    def fresh() -> torch.Tensor:
        return torch.arange(1024, dtype=torch.float32)

    t = fresh()
    tracker, target = _tracked(tmp_path, {"t": t})
    old_address = t.untyped_storage().data_ptr()
    del t
    gc.collect()
    for _ in range(50):  # the allocator hands the same address out again, typically at once
        t = fresh()
        if t.untyped_storage().data_ptr() == old_address:
            break
    assert t._version == 0
    assert _reused(tracker, target, {"t": t}) == set()


def test_views_spanning_several_tensors_and_changed_layouts_are_written(tmp_path):
    base = torch.randn(8, 8)
    tracker, target = _tracked(tmp_path, {"a": base[:5], "b": base[3:]})  # overlapping: one span blob
    assert _reused(tracker, target, {"a": base[:5], "b": base[3:]}) == set()

    x, y = torch.randn(4), torch.randn(4)
    tracker, target = _tracked(tmp_path, {"x": x, "y": y})
    plan = make_plan({"state_dict": {"x": x, "y": y}}, 2**20)  # both in one file now: not that file
    assert tracker.reuse(Snapshot.of(plan), target) == {}


def test_a_removed_or_replaced_earlier_file_is_not_reused(tmp_path):
    w = torch.randn(32)
    tracker, target = _tracked(tmp_path, {"w": w})
    assert _reused(tracker, target, {"w": w}) == {"w"}
    source = tmp_path / "a.ckpt" / "model-00001-of-00001.safetensors"
    data = source.read_bytes()
    source.unlink()
    assert _reused(tracker, target, {"w": w}) == set()
    source.write_bytes(data)  # the same bytes in a new file: not the one recorded
    assert _reused(tracker, target, {"w": w}) == set()


def test_forget_and_clear_and_other_folders(tmp_path):
    w = torch.randn(32)
    tracker, target = _tracked(tmp_path, {"w": w})
    assert _reused(tracker, str(tmp_path / "elsewhere" / "b.ckpt"), {"w": w}) == set()
    tracker.forget(str(tmp_path / "a.ckpt"))
    assert _reused(tracker, target, {"w": w}) == set()
    tracker, target = _tracked(tmp_path, {"w": w})
    tracker.clear()
    assert _reused(tracker, target, {"w": w}) == set()


# ------------------------------------------------------------------------------ reuse on disk


def test_place_reused_links_and_carries_the_digest_and_refuses_a_changed_file(tmp_path):
    lc.save_checkpoint({"state_dict": {"w": torch.randn(64)}}, tmp_path / "a.ckpt")
    source = str(tmp_path / "a.ckpt" / "model-00001-of-00001.safetensors")
    manifest = read_manifest(tmp_path / "a.ckpt")
    record = manifest.files["model-00001-of-00001.safetensors"]
    reused = Reused((source,), record.size, record.digest, file_id(source))
    placed = place_reused(reused, str(tmp_path / "new.safetensors"), {})
    assert placed == fmt.FileRecord(record.size, record.digest)
    assert os.stat(tmp_path / "new.safetensors").st_ino == os.stat(source).st_ino
    stale = Reused((source,), record.size, "0" * 16, file_id(source))
    with pytest.raises(ReuseUnavailable, match="another file"):
        place_reused(stale, str(tmp_path / "other.safetensors"), {})
    assert not (tmp_path / "other.safetensors").exists()
    # Not there any more under its checkpoint's name, but where the second source says (a
    # multi-rank save's part folder before rank 0 commits: no manifest there yet).
    moved = tmp_path / "part" / "model-00001-of-00001.safetensors"
    moved.parent.mkdir()
    os.rename(source, moved)
    found = Reused((source, str(moved)), record.size, record.digest, file_id(str(moved)))
    assert place_reused(found, str(tmp_path / "third.safetensors"), {}) == placed
    os.remove(moved)
    with pytest.raises(ReuseUnavailable, match="gone or changed"):
        place_reused(found, str(tmp_path / "fourth.safetensors"), {})


def test_a_staged_file_whose_earlier_copy_is_gone_is_left_to_be_written_and_copies_are_copies(tmp_path):
    """``place_all`` of an async save: a file reused without being staged must be there (else the
    save fails); one staged too (``SaveRequest.same_as``) is left out, to be written from its image.
    ``copy=True``: a file of its own, same bytes and digest."""
    lc.save_checkpoint({"state_dict": {"w": torch.randn(64)}}, tmp_path / "a.ckpt")
    name = "model-00001-of-00001.safetensors"
    source = str(tmp_path / "a.ckpt" / name)
    record = read_manifest(tmp_path / "a.ckpt").files[name]
    copied = Reused((source,), record.size, record.digest, file_id(source), copy=True)
    (tmp_path / "new").mkdir()
    files, reused = place_all({name: copied}, str(tmp_path / "new"), staged=True)
    assert reused == {name} and files[name] == fmt.FileRecord(record.size, record.digest)
    assert os.stat(tmp_path / "new" / name).st_ino != os.stat(source).st_ino
    assert (tmp_path / "new" / name).read_bytes() == open(source, "rb").read()
    os.remove(source)
    gone_staged = Reused((source,), record.size, record.digest, copied.id, staged=True)
    assert place_all({name: gone_staged}, str(tmp_path / "later"), staged=True) == ({}, set())
    with pytest.raises(ReuseUnavailable, match="it was not staged"):
        place_all({name: Reused((source,), record.size, record.digest, copied.id)}, str(tmp_path / "later"), staged=True)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a second filesystem (/dev/shm)")
def test_place_reused_copies_across_filesystems(tmp_path):
    other = tempfile.mkdtemp(dir="/dev/shm")
    try:
        if os.stat(other).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("/dev/shm is on the same filesystem here")
        lc.save_checkpoint({"state_dict": {"w": torch.randn(4096)}}, os.path.join(other, "a.ckpt"))
        source = os.path.join(other, "a.ckpt", "model-00001-of-00001.safetensors")
        record = read_manifest(os.path.join(other, "a.ckpt")).files["model-00001-of-00001.safetensors"]
        placed = place_reused(Reused((source,), record.size, record.digest, file_id(source)), str(tmp_path / "c"), {})
        assert placed.digest == record.digest
        assert (tmp_path / "c").read_bytes() == open(source, "rb").read()
    finally:
        shutil.rmtree(other)


# ------------------------------------------------------------------ through ShardedCheckpointIO


def test_frozen_backbone_saves_write_only_the_head_and_optimizer(tmp_path):
    model = _model()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    io = ShardedCheckpointIO()
    io.track_frozen(model)
    expected = {}
    usage = []
    for step in range(4):
        _train(model, optimizer)
        path = tmp_path / f"step={step}.ckpt"
        io.save_checkpoint(_checkpoint(model, optimizer, step), path)
        expected[path] = {k: v.clone() for k, v in model.state_dict().items()}
        usage.append(disk_usage(tmp_path))
        result = io.last_save
        frozen_bytes = sum(v.nbytes for k, v in model.state_dict().items() if k.startswith(("0.", "1.")))
        assert result.reused_bytes == (0 if step == 0 else os.path.getsize(path / "model-stable-00001-of-00001.safetensors"))
        assert result.reused_bytes >= frozen_bytes * (step > 0)
    growth = [b - a for a, b in zip(usage, usage[1:])]
    first = usage[0]
    stable = os.path.getsize(tmp_path / "step=0.ckpt" / "model-stable-00001-of-00001.safetensors")
    # Each later save adds what it wrote: all but the stable shard (metadata sizes vary by a few bytes).
    assert all(abs(g - (first - stable)) < 0.01 * first for g in growth), (growth, first, stable)
    assert stable > 0.5 * first
    assert_each_complete_alone(tmp_path, expected)


def test_stable_shards_hold_a_sixteenth_of_the_frozen_bytes_within_their_bounds():
    assert stable_shard_size(100 * 2**20, 2**40) == 512 * 2**20  # small bases: one file
    assert stable_shard_size(16 * 2**30, 2**40) == 2**30  # a 16 GiB base: 16 files of 1 GiB
    assert stable_shard_size(16 * 2**30, 256 * 2**20) == 256 * 2**20  # never above max_shard_size


def test_a_frozen_weight_changed_in_place_rewrites_about_what_changed(tmp_path, monkeypatch):
    """A frozen backbone spans several stable shards (here at least 8 MiB each, in place of 512 MiB,
    to keep the test small): changing one 4 MB layer in place rewrites that layer's shard, not the
    whole backbone."""
    monkeypatch.setattr(plan_module, "STABLE_MIN_BYTES", 8 * 2**20)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(10)), torch.nn.Linear(1024, 4))
    model[:10].requires_grad_(False)
    optimizer = torch.optim.SGD(model[10].parameters(), lr=0.1)
    io = ShardedCheckpointIO()
    io.track_frozen(model)
    io.save_checkpoint(_checkpoint(model, optimizer), tmp_path / "a.ckpt")
    stable = sorted(n for n in os.listdir(tmp_path / "a.ckpt") if "-stable-" in n)
    assert len(stable) == 5  # 10 x 4 MiB in files of at most 8 MiB
    with torch.no_grad():
        model[3].weight.mul_(2.0)  # frozen, changed in place
    io.save_checkpoint(_checkpoint(model, optimizer), tmp_path / "b.ckpt")
    result = io.last_save
    rewritten = result.nbytes - result.reused_bytes
    assert 4 * 2**20 < rewritten < 9 * 2**20  # one stable shard and the head, not 40 MB
    assert_each_complete_alone(tmp_path, {tmp_path / "b.ckpt": {k: v.clone() for k, v in model.state_dict().items()}})


def assert_each_complete_alone(folder, expected: dict) -> None:
    """Each checkpoint in ``expected`` (path -> state dict) verifies and loads bit for bit once
    every other one is deleted."""
    for _, alone in each_alone(folder, [path.name for path in expected]):
        lc.verify_checkpoint(alone)
        assert _equal(lc.load_checkpoint(alone)["state_dict"], expected[folder / os.path.basename(alone)])


def test_changes_to_frozen_tensors_are_written(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    io = ShardedCheckpointIO()
    io.track_frozen(model)

    def save(name: str) -> dict:
        _train(model, optimizer)
        io.save_checkpoint(_checkpoint(model, optimizer), tmp_path / name)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        assert _equal(lc.load_checkpoint(tmp_path / name)["state_dict"], state)
        return state

    save("a.ckpt")
    save("b.ckpt")
    assert io.last_save.reused_bytes > 0
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # frozen, changed in place
    save("c.ckpt")
    assert io.last_save.reused_bytes == 0
    save("d.ckpt")
    assert io.last_save.reused_bytes > 0
    model[0].weight.data = torch.randn(64, 64)  # replaced
    save("e.ckpt")
    assert io.last_save.reused_bytes == 0
    model[0].requires_grad_(True)  # unfrozen mid-run: a new layout, trained from now on
    optimizer.add_param_group({"params": list(model[0].parameters())})
    save("f.ckpt")
    save("g.ckpt")
    assert "0.weight" not in {
        b.name for s in make_plan(_checkpoint(model), 2**30, io._stable()).shards if "stable" in s.filename for b in s.blobs
    }
    # A new plugin (a new run, a resumed one) into the same folder reuses nothing at first.
    fresh = ShardedCheckpointIO()
    fresh.track_frozen(model)
    fresh.save_checkpoint(_checkpoint(model, optimizer), tmp_path / "h.ckpt")
    assert fresh.last_save.reused_bytes == 0
    for name in "abcdefg":
        shutil.rmtree(tmp_path / f"{name}.ckpt")
    lc.verify_checkpoint(tmp_path / "h.ckpt")


def test_incremental_off_writes_everything_and_the_option_is_checked(tmp_path):
    model = _model()
    io = ShardedCheckpointIO(incremental=False)
    io.track_frozen(model)
    for name in ("a.ckpt", "b.ckpt"):
        io.save_checkpoint(_checkpoint(model), tmp_path / name)
        assert io.last_save.reused_bytes == 0
    assert sorted(os.listdir(tmp_path / "b.ckpt")) == sorted(os.listdir(tmp_path / "a.ckpt"))
    assert not any("stable" in name for name in os.listdir(tmp_path / "b.ckpt"))
    with pytest.raises(ValueError, match="incremental"):
        ShardedCheckpointIO(incremental="yes")  # type: ignore[arg-type]


def test_a_removed_previous_checkpoint_is_written_again(tmp_path):
    model = _model()
    io = ShardedCheckpointIO()
    io.track_frozen(model)
    io.save_checkpoint(_checkpoint(model), tmp_path / "a.ckpt")
    shutil.rmtree(tmp_path / "a.ckpt")  # by the user, behind the plugin's back
    io.save_checkpoint(_checkpoint(model), tmp_path / "b.ckpt")
    assert io.last_save.reused_bytes == 0
    io.remove_checkpoint(tmp_path / "b.ckpt")  # through the plugin
    io.save_checkpoint(_checkpoint(model), tmp_path / "c.ckpt")
    assert io.last_save.reused_bytes == 0
    io.save_checkpoint(_checkpoint(model), tmp_path / "c.ckpt")  # replacing itself: linked, then swapped
    assert io.last_save.reused_bytes > 0
    lc.verify_checkpoint(tmp_path / "c.ckpt")
    assert _equal(lc.load_checkpoint(tmp_path / "c.ckpt")["state_dict"], model.state_dict())


@pytest.mark.parametrize("optimizer_class", ["fused", "chunked"])
def test_fused_optimizer_steps_are_seen(tmp_path, optimizer_class):
    """Fused kernels (torch's ``fused=True``, ChunkedAdamW's) change parameters and state in place
    without bumping their version counters; the post-step hook does, so nothing stale is reused."""
    from lightning_ckpt.offload import ChunkedAdamW

    model = _model()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, fused=True) if optimizer_class == "fused" else ChunkedAdamW(trained)
    io = ShardedCheckpointIO(max_shard_size=1)  # a file per tensor: each moment alone in its file
    io.track_frozen(model)
    states = {}
    for step in range(3):
        _train(model, optimizer)
        if hasattr(optimizer, "wait"):
            optimizer.wait()
        io.save_checkpoint(_checkpoint(model, optimizer, step), tmp_path / f"{step}.ckpt")
        states[step] = ({k: v.clone() for k, v in model.state_dict().items()}, optimizer.state_dict()["state"])
        states[step] = (states[step][0], {i: {k: v.clone() for k, v in s.items()} for i, s in states[step][1].items()})
        if step:  # the frozen backbone, and only it, is reused
            folder = tmp_path / f"{step}.ckpt"
            stable = sum(os.path.getsize(folder / name) for name in os.listdir(folder) if "-stable-" in name)
            assert io.last_save.reused_bytes == stable
    for step, (model_state, optimizer_state) in states.items():
        loaded = lc.load_checkpoint(tmp_path / f"{step}.ckpt")
        assert _equal(loaded["state_dict"], model_state)
        for index, entries in optimizer_state.items():
            assert _equal(loaded["optimizer_states"][0]["state"][index], entries)
