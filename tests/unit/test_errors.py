"""Every user-facing error: typed, names the file/key/argument, says how to fix it, loses nothing."""

from __future__ import annotations

import argparse
import json
import os
import struct

import pytest
import torch
from helpers import flip_byte

import lightning_ckpt as lc
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.store.commit import TMP_MARKER
from lightning_ckpt.store.shards import ShardWriter


def _save(tmp_path, name: str = "ck.ckpt", **extra) -> str:
    path = tmp_path / name
    lc.save_checkpoint(
        {"state_dict": {"w": torch.randn(64), "b": torch.randn(8)}, "optimizer_states": [{"state": {0: {"m": torch.ones(64)}}}], **extra},
        path,
    )
    return str(path)


def _rewrite_manifest(path: str, edit) -> None:
    """Change the manifest and re-seal it with a valid checksum (a well-formed hostile manifest)."""
    body = json.loads(open(os.path.join(path, "manifest.json"), "rb").read())
    body.pop("manifest_crc32")
    edit(body)
    body["manifest_crc32"] = fmt.format_checksum(fmt.checksum(fmt._canonical(body)))
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(body, f)


def test_missing_path(tmp_path):
    # Lightning's TorchCheckpointIO wording first, then our hint.
    with pytest.raises(lc.CheckpointNotFoundError, match=r"^Checkpoint file not found: .*nope\.ckpt\. ") as info:
        lc.load_checkpoint(tmp_path / "nope.ckpt")
    assert isinstance(info.value, FileNotFoundError)


def test_directory_without_manifest_but_with_shards_is_an_incomplete_checkpoint(tmp_path):
    path = _save(tmp_path)
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(lc.CheckpointNotFoundError, match="incomplete copy or an interrupted save"):
        lc.load_checkpoint(path)


def test_a_folder_that_is_not_a_checkpoint_is_called_a_wrong_path_not_an_interrupted_save(tmp_path):
    logs = tmp_path / "lightning_logs"
    (logs / "version_0").mkdir(parents=True)
    (logs / "version_0" / "metrics.csv").write_text("step,loss\n")
    with pytest.raises(lc.CheckpointNotFoundError, match="not a lightning_ckpt checkpoint") as info:
        lc.load_checkpoint(logs)
    assert "interrupted" not in str(info.value) and "'version_0'" in str(info.value)
    # The checkpoint folder itself: name the checkpoints in it.
    (tmp_path / "checkpoints").mkdir()
    _save(tmp_path / "checkpoints", "epoch=0-step=4.ckpt")
    with pytest.raises(lc.CheckpointNotFoundError, match=r"folder of checkpoints: pass one of them \('epoch=0-step=4.ckpt'\)"):
        lc.load_checkpoint(tmp_path / "checkpoints")


@pytest.mark.parametrize("garbage", [b"", b"{not json", b"[]", b'{"format": "other"}'])
def test_garbled_manifest(tmp_path, garbage):
    path = _save(tmp_path)
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(garbage)
    with pytest.raises(lc.CorruptCheckpointError) as info:
        lc.load_checkpoint(path)
    assert info.value.file == "manifest.json" and path in str(info.value)


def test_flipped_byte_in_manifest_is_caught(tmp_path):
    path = _save(tmp_path)
    raw = open(os.path.join(path, "manifest.json"), "rb").read()
    start = raw.index(b'"size": ')
    offset = raw.index(b"\n", start) - 1  # the last digit of a size: still valid JSON after the flip
    flip_byte(os.path.join(path, "manifest.json"), offset)
    with pytest.raises(lc.CorruptCheckpointError, match="manifest checksum mismatch"):
        lc.load_checkpoint(path)


def test_future_format_version_is_refused_with_upgrade_hint(tmp_path):
    path = _save(tmp_path)
    _rewrite_manifest(path, lambda m: m.update(format_version=fmt.READ_FORMAT_VERSION + 1))
    with pytest.raises(lc.UnsupportedFormatError, match="Upgrade lightning_ckpt"):
        lc.load_checkpoint(path)


@pytest.mark.parametrize("which", ["model-00001-of-00001.safetensors", "optimizer-00001-of-00001.safetensors", "metadata.json"])
def test_truncated_or_missing_file_is_caught_by_the_cheap_check(tmp_path, which):
    path = _save(tmp_path)
    file = os.path.join(path, which)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 3)
    with pytest.raises(lc.CorruptCheckpointError, match="truncated") as info:
        lc.load_checkpoint(path)
    assert info.value.file == which
    os.remove(file)
    with pytest.raises(lc.CorruptCheckpointError, match="missing") as info:
        lc.load_checkpoint(path)
    assert info.value.file == which


@pytest.mark.parametrize("which", ["model-00001-of-00001.safetensors", "optimizer-00001-of-00001.safetensors", "model.safetensors.index.json"])
def test_flipped_byte_is_caught_by_full_verification(tmp_path, which):
    path = _save(tmp_path)
    flip_byte(os.path.join(path, which), os.path.getsize(os.path.join(path, which)) - 5)
    with pytest.raises(lc.CorruptCheckpointError, match="checksum mismatch") as info:
        lc.verify_checkpoint(path)
    assert info.value.file == which
    with pytest.raises(lc.CorruptCheckpointError):
        lc.load_checkpoint(path, verify=True)
    with pytest.raises(lc.CorruptCheckpointError):
        lc.ShardedCheckpointIO(verify_on_load="full").load_checkpoint(path)


def test_metadata_is_always_checksummed(tmp_path):
    path = _save(tmp_path)
    flip_byte(os.path.join(path, "metadata.json"), 5)
    with pytest.raises(lc.CorruptCheckpointError, match="metadata.json"):
        lc.load_checkpoint(path)


def test_pickle_payload_is_refused_by_default_and_named(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    path = _save(tmp_path, hyper_parameters={"lr": 0.1, "payload": Evil()})
    with pytest.raises(lc.UnsafeCheckpointError, match="weights_only=False") as info:
        lc.load_checkpoint(path)
    assert info.value.key == "checkpoint['hyper_parameters']['payload']"
    assert not (tmp_path / "pwned").exists()


def test_weights_only_false_loads_trusted_objects(tmp_path):
    path = _save(tmp_path, hyper_parameters={"ns": argparse.Namespace(a=1)})
    with pytest.raises(lc.UnsafeCheckpointError):
        lc.load_checkpoint(path, weights_only=True)
    assert lc.load_checkpoint(path, weights_only=False)["hyper_parameters"]["ns"] == argparse.Namespace(a=1)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "a/../../b", ".."])
def test_manifest_path_traversal_is_refused(tmp_path, name):
    path = _save(tmp_path)

    def edit(m):
        m["files"][name] = m["files"].pop("model-00001-of-00001.safetensors")

    _rewrite_manifest(path, edit)
    with pytest.raises(lc.CorruptCheckpointError, match="outside the checkpoint directory"):
        lc.load_checkpoint(path)


def test_symlinked_shard_is_refused(tmp_path):
    path = _save(tmp_path)
    shard = os.path.join(path, "model-00001-of-00001.safetensors")
    os.rename(shard, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", shard)
    with pytest.raises(lc.CorruptCheckpointError, match="not a regular file"):
        lc.load_checkpoint(path)


@pytest.mark.parametrize(
    "header",
    [
        {"w": {"dtype": "F32", "shape": [2**40, 2**20], "data_offsets": [0, 256]}},
        {"w": {"dtype": "F32", "shape": [64], "data_offsets": [0, 2**62]}},
        {"w": {"dtype": "NOPE", "shape": [64], "data_offsets": [0, 256]}},
        {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 256]}},
    ],
    ids=["absurd-shape", "absurd-offset", "bad-dtype", "negative-shape"],
)
def test_hostile_safetensors_header_is_refused_without_allocation(tmp_path, header):
    path = _save(tmp_path)
    shard = os.path.join(path, "model-00001-of-00001.safetensors")
    size = os.path.getsize(shard)
    body = json.dumps(header).encode()
    data = struct.pack("<Q", len(body)) + body
    data += b"\0" * (size - len(data))  # keep the size so only the header is wrong

    def edit(m):
        m["files"]["model-00001-of-00001.safetensors"]["digest"] = fmt.digest(data)

    with open(shard, "wb") as f:
        f.write(data)
    _rewrite_manifest(path, edit)
    with pytest.raises(lc.CorruptCheckpointError, match="invalid header entry") as info:
        lc.load_checkpoint(path)
    assert info.value.file == "model-00001-of-00001.safetensors"


def test_absurd_header_length_is_refused(tmp_path):
    path = _save(tmp_path)
    shard = os.path.join(path, "model-00001-of-00001.safetensors")
    with open(shard, "r+b") as f:
        f.write(struct.pack("<Q", 2**60))
    with pytest.raises(lc.CorruptCheckpointError, match="checksum mismatch"):
        lc.load_checkpoint(path)  # the digest (checked first by default) catches it
    with pytest.raises(lc.CorruptCheckpointError, match="header length"):
        lc.load_checkpoint(path, verify=False)  # without it, the header is still validated


# ------------------------------------------------------------------------------------- saving


def test_failed_save_keeps_the_old_checkpoint_and_leaves_no_temporaries(tmp_path, monkeypatch):
    path = _save(tmp_path)
    before = lc.load_checkpoint(path)["state_dict"]["w"].clone()
    calls = []

    def fail_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return original(self, *args, **kwargs)

    original = ShardWriter.write_shard
    monkeypatch.setattr(ShardWriter, "write_shard", fail_second)
    with pytest.raises(lc.CheckpointWriteError, match="No space left on device") as info:
        lc.save_checkpoint({"state_dict": {"w": torch.zeros(64)}, "optimizer_states": [{"state": {0: {"m": torch.zeros(2)}}}]}, path)
    assert info.value.path == path and "unchanged" in str(info.value)
    assert os.listdir(tmp_path) == ["ck.ckpt"]
    assert torch.equal(lc.load_checkpoint(path, verify=True)["state_dict"]["w"], before)


def test_replacing_a_checkpoint_is_atomic_and_complete(tmp_path):
    path = tmp_path / "last.ckpt"
    for value in range(3):
        lc.save_checkpoint({"state_dict": {"w": torch.full((10,), float(value))}}, path)
        assert lc.load_checkpoint(path, verify=True)["state_dict"]["w"][0] == value
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_replacing_a_legacy_file_with_a_directory(tmp_path):
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, path)
    lc.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, path)
    assert path.is_dir() and os.listdir(tmp_path) == ["last.ckpt"]


def test_stale_temporaries_are_cleaned_but_live_ones_are_not(tmp_path):
    stale = tmp_path / f".old.ckpt{TMP_MARKER}123-dead"
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    from lightning_ckpt.store.commit import TempDir

    live = TempDir(str(tmp_path / "other.ckpt"))  # holds its lock like a save in progress
    _save(tmp_path)
    assert not stale.exists()
    assert os.path.isdir(live.path)
    live.release(remove=True)
    assert sorted(os.listdir(tmp_path)) == ["ck.ckpt"]


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    foreign = tmp_path / "data.ckpt"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(lc.CheckpointWriteError, match="not a lightning_ckpt checkpoint"):
        lc.save_checkpoint({"state_dict": {}}, foreign)
    with pytest.raises(lc.CheckpointError, match="Refusing to remove"):
        lc.remove_checkpoint(foreign)
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_remove_checkpoint(tmp_path):
    path = _save(tmp_path)
    lc.ShardedCheckpointIO().remove_checkpoint(path)
    torch.save({}, tmp_path / "legacy.ckpt")
    lc.remove_checkpoint(tmp_path / "legacy.ckpt")
    lc.remove_checkpoint(tmp_path / "never-existed.ckpt")
    assert os.listdir(tmp_path) == []


def test_unwritable_folder_gives_a_write_error(tmp_path):
    if os.geteuid() == 0:
        target = "/proc/lightning_ckpt_cannot_write_here/x.ckpt"
    else:
        os.chmod(tmp_path, 0o500)
        target = str(tmp_path / "x.ckpt")
    with pytest.raises(lc.CheckpointWriteError, match="lightning_ckpt_cannot_write_here|x.ckpt"):
        lc.save_checkpoint({"state_dict": {"w": torch.ones(1)}}, target)


def test_a_read_only_folder_is_named_not_the_saves_lock_file(tmp_path, monkeypatch):
    """Where a read-only mount is not possible (tests/integration/test_disk_full.py makes one):
    the filesystem's refusal, injected where the save creates its first file (the lock)."""
    target = _save(tmp_path)
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise OSError(30, "Read-only file system", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(lc.CheckpointWriteError) as info:
        lc.save_checkpoint({"w": torch.ones(1)}, target)
    message = str(info.value)
    assert f"Read-only file system (writing in {str(tmp_path)!r})" in message and target in message
    assert ".lock" not in message and TMP_MARKER not in message
    assert "Make that folder writable" in message


def test_bad_arguments_are_named():
    io = lc.ShardedCheckpointIO()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, "x.ckpt", storage_options={"a": 1})
    with pytest.raises(ValueError, match="verify_on_load"):
        lc.ShardedCheckpointIO(verify_on_load="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="direct_io"):
        lc.ShardedCheckpointIO(direct_io="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer_size"):
        lc.ShardedCheckpointIO(buffer_size="big")
    with pytest.raises(TypeError, match="must be a dict"):
        lc.save_checkpoint([1, 2], "x.ckpt")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "option",
    [{"when_busy": "skip"}, {"staging_pool_size": "1GB"}, {"max_write_rate": "1GB"}, {"overlap_copies": False}],
)
def test_async_only_options_without_async_save_are_refused_at_construction(option):
    # Silently ignored, when_busy="skip" would skip nothing and a rate cap cap nothing.
    ((name, value),) = option.items()
    with pytest.raises(ValueError) as info:
        lc.ShardedCheckpointIO(**option)
    message = str(info.value)
    assert f"{name}={value!r}" in message and "async_save=True" in message
    lc.ShardedCheckpointIO(async_save=True, **option).teardown()  # with async_save, accepted
    lc.ShardedCheckpointIO(when_busy="wait", staging_pool_size=None)  # the defaults, spelled out


def test_a_write_error_mid_shard_raises_instead_of_hanging(tmp_path, monkeypatch):
    import threading

    from lightning_ckpt.store import shards

    calls = []
    original = shards._write_all

    def failing(fd, data):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        original(fd, data)

    monkeypatch.setattr(shards, "_write_all", failing)
    outcome = []

    def save():
        try:
            lc.ShardedCheckpointIO(buffer_size="64KiB").save_checkpoint(
                {"state_dict": {"w": torch.randn(1_000_000)}}, tmp_path / "x.ckpt"
            )
        except lc.CheckpointWriteError as err:
            outcome.append(err)

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the save hung after a write error"
    assert outcome and "No space left" in str(outcome[0])
    assert os.listdir(tmp_path) == []


def test_fallback_commit_puts_the_old_checkpoint_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    from lightning_ckpt.store import commit as writer

    path = _save(tmp_path, "last.ckpt")
    before = lc.load_checkpoint(path)["state_dict"]["w"].clone()
    monkeypatch.setattr(writer, "_renameat2", lambda *args: False)  # e.g. NFS: no RENAME_EXCHANGE
    real_rename, renames = os.rename, []

    def rename(src, dst):
        renames.append((src, dst))
        if len(renames) == 2:  # target moved aside; now fail to move the new one in
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(lc.CheckpointWriteError):
        lc.save_checkpoint({"state_dict": {"w": torch.zeros(64)}}, path)
    monkeypatch.setattr(os, "rename", real_rename)
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.equal(lc.load_checkpoint(path, verify=True)["state_dict"]["w"], before)


def test_a_checkpoint_moved_aside_by_a_crash_is_restored_not_deleted(tmp_path):
    path = _save(tmp_path, "last.ckpt")
    aside = tmp_path / f".last.ckpt{TMP_MARKER}4242-dead.old"
    os.rename(path, aside)  # what a crash between the fallback's two renames leaves
    _save(tmp_path, "other.ckpt")  # any later save into the folder cleans up
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "other.ckpt"]
    lc.verify_checkpoint(tmp_path / "last.ckpt")


def test_views_of_different_dtypes_sharing_bytes_roundtrip(tmp_path):
    base = torch.arange(16, dtype=torch.float32)
    state = {"state_dict": {"a": base[1:], "b": base.view(torch.uint8)[1:]}}
    path = tmp_path / "v.ckpt"
    lc.save_checkpoint(state, path)
    out = lc.load_checkpoint(path, verify=True)["state_dict"]
    assert torch.equal(out["a"], state["state_dict"]["a"]) and torch.equal(out["b"], state["state_dict"]["b"])


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(components=["model"]),
        lambda m: m.update(metadata_file=["metadata.json"]),
        lambda m: m["tensors"][0].update(dtype=7),
        lambda m: m["tensors"][0].update(shape=[10**6] * 100),
        lambda m: m["tensors"][0].update(stride=[-1]),
        lambda m: m["tensors"][0].update(file=["x"]),
    ],
    ids=["components-list", "metadata-list", "dtype-int", "shape-huge", "stride-negative", "file-list"],
)
def test_malformed_manifest_fields_give_a_typed_error(tmp_path, edit):
    path = _save(tmp_path)
    _rewrite_manifest(path, edit)
    with pytest.raises(lc.CorruptCheckpointError):
        lc.load_checkpoint(path)


@pytest.mark.parametrize(
    "value",
    [{"$device": "bogus"}, {"$map": [], "attrs": {"x": 1}}, {"$tensor": 99}, {"$unknown": 1}],
    ids=["device", "attrs-on-dict", "tensor-id", "tag"],
)
def test_malformed_metadata_gives_a_typed_error(tmp_path, value):
    path = _save(tmp_path)
    data = json.dumps({"epoch": value}).encode()
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(data)

    def edit(m):
        m["files"]["metadata.json"] = {"size": len(data), "digest": fmt.digest(data)}

    _rewrite_manifest(path, edit)
    with pytest.raises(lc.CorruptCheckpointError):
        lc.load_checkpoint(path)
