"""format.read_once: the read path (short reads, EINTR, O_DIRECT refused, truncation), the
spread of files over ranks, and a load in a one-rank gloo group (the two-rank case, with ranks as
separate nodes, is tests/distributed/test_read_once_ddp.py)."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed as dist
from helpers import flip_byte

import lightning_ckpt as lc
from lightning_ckpt.errors import CorruptCheckpointError
from lightning_ckpt.format import read_once
from lightning_ckpt.format.reader import OpenedDir, read_manifest, shard_names


def _checkpoint(tmp_path) -> tuple[str, dict]:
    torch.manual_seed(0)
    state = {
        "state_dict": {f"layer{i}.weight": torch.randn(300, 200 + i) for i in range(5)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(1000)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "epoch": 2,
    }
    path = str(tmp_path / "c.ckpt")
    lc.save_checkpoint(state, path, max_shard_size="300KB")
    return path, state


def _shard(path: str) -> tuple[str, int]:
    manifest = read_manifest(path)
    name = sorted(shard_names(manifest))[0]
    return name, manifest.files[name].size


def test_spread_balances_bytes_and_is_the_same_everywhere():
    sizes = {"a": 100, "b": 90, "c": 60, "d": 40, "e": 10}
    owners = read_once.spread(sizes, 2)
    assert owners == read_once.spread(dict(reversed(list(sizes.items()))), 2)  # order of the dict does not matter
    load = [sum(s for n, s in sizes.items() if owners[n] == r) for r in range(2)]
    assert sorted(load) == [150, 150]
    assert read_once.spread(sizes, 1) == dict.fromkeys(sizes, 0)
    assert set(read_once.spread({"a": 1}, 4).values()) == {0}


def test_read_file_is_the_file_and_its_digest(tmp_path):
    path, _ = _checkpoint(tmp_path)
    name, size = _shard(path)
    manifest = read_manifest(path)
    with OpenedDir(path) as directory:
        buffer, found = read_once.read_file(directory, name, size, manifest.checksum)
    with open(os.path.join(path, name), "rb") as f:
        assert buffer[:size] == f.read()
    assert found == manifest.files[name].digest


def _patched_preadv(monkeypatch, behave):
    real = os.preadv
    calls = {"n": 0}

    def preadv(fd, buffers, offset):
        calls["n"] += 1
        return behave(real, fd, buffers, offset, calls["n"])

    monkeypatch.setattr(read_once.os, "preadv", preadv)
    return calls


def test_short_reads_continue_where_they_stopped(tmp_path, monkeypatch):
    path, _ = _checkpoint(tmp_path)
    name, size = _shard(path)

    def short(real, fd, buffers, offset, n):  # at most 4097 bytes per call: odd, unaligned lengths
        return real(fd, [memoryview(buffers[0])[:4097]], offset) if os.fstat(fd).st_size - offset > 4097 else real(fd, buffers, offset)

    monkeypatch.setattr(OpenedDir, "open_direct", lambda d, n: (d.open(n), False))  # odd offsets: buffered
    calls = _patched_preadv(monkeypatch, short)
    with OpenedDir(path) as directory:
        buffer, found = read_once.read_file(directory, name, size, read_manifest(path).checksum)
    assert calls["n"] > size // 4097
    with open(os.path.join(path, name), "rb") as f:
        assert buffer[:size] == f.read()
    assert found == read_manifest(path).files[name].digest


def test_an_interrupted_read_is_retried(tmp_path, monkeypatch):
    path, _ = _checkpoint(tmp_path)
    name, size = _shard(path)

    def interrupted(real, fd, buffers, offset, n):
        if n == 1:
            raise InterruptedError(errno.EINTR, "Interrupted system call")
        return real(fd, buffers, offset)

    _patched_preadv(monkeypatch, interrupted)
    with OpenedDir(path) as directory:
        _, found = read_once.read_file(directory, name, size, read_manifest(path).checksum)
    assert found == read_manifest(path).files[name].digest


def test_a_filesystem_refusing_o_direct_reads_is_read_buffered(tmp_path, monkeypatch):
    path, _ = _checkpoint(tmp_path)
    name, size = _shard(path)
    opened = []
    real_open = OpenedDir.open

    def open_(self, n, flags=os.O_RDONLY):
        if n == name:
            opened.append(flags)
        return real_open(self, n, flags)

    def refuse(real, fd, buffers, offset, n):  # the first read, on the "O_DIRECT" descriptor
        if n == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(OpenedDir, "open", open_)
    # Opened as O_DIRECT is (tmpfs refuses O_DIRECT at open, some filesystems only at read).
    monkeypatch.setattr(OpenedDir, "open_direct", lambda d, n: (d.open(n), True))
    calls = _patched_preadv(monkeypatch, refuse)
    with OpenedDir(path) as directory:
        buffer, found = read_once.read_file(directory, name, size, read_manifest(path).checksum)
    assert found == read_manifest(path).files[name].digest
    assert len(opened) == 2 and calls["n"] >= 2  # reopened buffered, read from where it stopped


def test_a_file_shorter_than_its_size_is_named_as_truncated(tmp_path):
    path, _ = _checkpoint(tmp_path)
    name, size = _shard(path)
    with OpenedDir(path) as directory, pytest.raises(CorruptCheckpointError, match="truncated") as info:
        read_once.read_file(directory, name, size + 5000, None)  # the manifest says more than the file has
    assert info.value.file == name


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_one_rank_group_loads_every_tensor_as_saved(tmp_path, one_rank):
    path, state = _checkpoint(tmp_path)
    checkpoint, read = read_once.load_read_once(path, None, None, verify=True)
    for key, value in state["state_dict"].items():
        assert torch.equal(checkpoint["state_dict"][key], value)
    moments = checkpoint["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.equal(moments, state["optimizer_states"][0]["state"][0]["exp_avg"])
    assert checkpoint["epoch"] == 2
    manifest = read_manifest(path)
    assert read.total_bytes == manifest.total_bytes == read.bytes_read  # one rank reads it all
    assert read.files_read == len(shard_names(manifest))
    checkpoint["state_dict"]["layer0.weight"].add_(1)  # the loaded tensors are writable memory of their own
    assert torch.equal(lc.load_checkpoint(path)["state_dict"]["layer0.weight"], state["state_dict"]["layer0.weight"])


def test_a_flipped_byte_is_named_and_nothing_is_returned(tmp_path, one_rank):
    path, _ = _checkpoint(tmp_path)
    name, size = _shard(path)
    flip_byte(os.path.join(path, name), size - 3)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        read_once.load_read_once(path, None, None, verify=True)
    assert info.value.file == name
    checkpoint, _ = read_once.load_read_once(path, None, None, verify=False)  # the opt-out loads the bytes
    assert checkpoint["epoch"] == 2


def test_a_truncated_shard_is_named(tmp_path, one_rank):
    path, _ = _checkpoint(tmp_path)
    name, size = _shard(path)
    os.truncate(os.path.join(path, name), size - 7)
    with pytest.raises(CorruptCheckpointError, match=r"is \d+ bytes, the manifest says") as info:
        read_once.load_read_once(path, None, None, verify=True)
    assert info.value.file == name


def test_the_plugin_reads_once_only_in_the_trainers_restore(tmp_path, one_rank, monkeypatch):
    path, state = _checkpoint(tmp_path)
    calls = []
    real = read_once.load_read_once
    monkeypatch.setattr(
        "lightning_ckpt.lightning.plugin.load_read_once", lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    )
    io = lc.ShardedCheckpointIO(read_once=True)
    io.load_checkpoint(path)  # not the Trainer's restore: no collective
    assert calls == [] and not io.last_load.read_once
    io.expect_collective_load(world_size=1, num_nodes=1)
    io.load_checkpoint(path)  # one rank: nothing to share
    assert calls == []
    io.expect_collective_load(world_size=2, num_nodes=1)  # as a 2-rank restore would (this group has 1)
    checkpoint = io.load_checkpoint(path)
    assert calls == [path] and io.last_load.read_once and io.last_load.bytes_read == io.last_load.total_bytes
    assert torch.equal(checkpoint["state_dict"]["layer1.weight"], state["state_dict"]["layer1.weight"])
    io.load_checkpoint(path)  # armed for one load only
    assert calls == [path]
    auto = lc.ShardedCheckpointIO()  # default: only across nodes (one node's page cache shares the reads)
    auto.expect_collective_load(world_size=2, num_nodes=1)
    auto.load_checkpoint(path)
    assert calls == [path]
    auto.expect_collective_load(world_size=2, num_nodes=2)
    auto.load_checkpoint(path)
    assert calls == [path, path]
    never = lc.ShardedCheckpointIO(read_once=False)
    never.expect_collective_load(world_size=2, num_nodes=2)
    never.load_checkpoint(path)
    assert calls == [path, path]
    with pytest.raises(ValueError, match="read_once"):
        lc.ShardedCheckpointIO(read_once="yes")  # type: ignore[arg-type]


def test_every_rank_raises_the_lowest_failing_ranks_error_alike():
    said = [None, ("CorruptCheckpointError", "checksum mismatch in 'a'", "a"), ("OSError", "[Errno 5] EIO", None)]
    own = OSError(5, "EIO")
    for failure in (None, own):  # rank 0 (fine) and rank 2 (its own, other error) raise the same
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
            read_once._raise_agreed("/ckpt", said, failure)
        assert info.value.file == "a" and info.value.__cause__ is failure
    with pytest.raises(lc.CheckpointError, match=r"rank 1 could not read its share of '/ckpt': MemoryError") as info:
        read_once._raise_agreed("/ckpt", [None, ("MemoryError", "", None)], None)
    assert type(info.value) is lc.CheckpointError  # not one a resume falls back on: every rank stops
    read_once._raise_agreed("/ckpt", [None, None], None)  # nobody failed


def test_ranks_that_opened_different_checkpoints_open_it_again(tmp_path, monkeypatch):
    path, _ = _checkpoint(tmp_path)
    mine = []

    def gathered(value, group):  # this rank, and another that saw another manifest (or none)
        mine.append(value)
        return [value, other]

    monkeypatch.setattr(read_once, "_gathered", gathered)
    other = ("another manifest", None)
    assert read_once._open_agreed(path, True, None) is read_once._AGAIN
    other = mine[-1]
    directory, manifest, _, _ = read_once._open_agreed(path, True, None)
    assert manifest.total_bytes == read_manifest(path).total_bytes
    directory.__exit__()
    closed = []
    real_exit = OpenedDir.__exit__
    monkeypatch.setattr(OpenedDir, "__exit__", lambda self, *exc: closed.append(self.path) or real_exit(self, *exc))
    other = (None, None)
    with pytest.raises(lc.CheckpointError, match=r"is a checkpoint for ranks \[0\] only"):
        read_once._open_agreed(path, True, None)
    other = (None, ("CorruptCheckpointError", "checksum mismatch in 'x'", "x"))  # the other rank failed
    with pytest.raises(CorruptCheckpointError):
        read_once._open_agreed(path, True, None)
    assert closed == [path, path]  # what this rank opened is closed when it raises too
    other = (None, None)
    assert read_once._open_agreed(str(tmp_path / "nothing"), True, None) is None  # no rank sees one
    os.makedirs(tmp_path / "legacy")
    assert read_once._open_agreed(str(tmp_path / "legacy"), True, None) is None


def test_a_checkpoint_that_is_not_ours_loads_the_ordinary_way_on_every_rank(tmp_path, one_rank):
    state = {"state_dict": {"w": torch.arange(6.0)}, "epoch": 1}
    legacy = str(tmp_path / "legacy.ckpt")
    torch.save(state, legacy)
    io = lc.ShardedCheckpointIO(read_once=True)
    io.expect_collective_load(world_size=2, num_nodes=2)
    loaded = io.load_checkpoint(legacy)
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"]) and not io.last_load.read_once
