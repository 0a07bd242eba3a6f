"""Remote checkpoints on fsspec's in-process ``memory://`` filesystem: layout, commit, replace,
verify, local tier, orphan clean-up, clear errors. (A real S3 server: tests/integration/test_s3.py.)"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from lightning_ckpt import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    MissingDependencyError,
    ShardedCheckpointIO,
    load_checkpoint,
    remote,
    remove_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.remote import commit, tier

pytestmark = pytest.mark.usefixtures("memory_fs")  # tests/conftest.py


def _state(step: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {"w": torch.randn(256, 256, generator=generator), "b": torch.arange(7, dtype=torch.int64)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(256, 256, generator=generator)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "global_step": step,
        "epoch": 0,
    }


def _equal(a: dict, b: dict) -> bool:
    return (
        torch.equal(a["state_dict"]["w"], b["state_dict"]["w"])
        and torch.equal(a["state_dict"]["b"], b["state_dict"]["b"])
        and torch.equal(a["optimizer_states"][0]["state"][0]["exp_avg"], b["optimizer_states"][0]["state"][0]["exp_avg"])
        and a["global_step"] == b["global_step"]
    )


def _objects(fs, root: str) -> list[str]:
    return sorted(p.split(root.strip("/") + "/", 1)[1] for p in fs.find(root))


def test_save_load_roundtrip_and_layout(memory_fs):
    url = "memory://bucket/run/a.ckpt"
    state = _state(3)
    result = save_checkpoint(state, url)
    assert result.path == url and result.nbytes > 0
    objects = _objects(memory_fs, "/bucket/run/a.ckpt")
    generations = {o.split("/")[0] for o in objects if o != remote.CURRENT_FILE}
    assert remote.CURRENT_FILE in objects and len(generations) == 1
    (generation,) = generations
    assert f"{generation}/{fmt.MANIFEST_FILE}" in objects
    pointer = json.loads(memory_fs.cat_file("/bucket/run/a.ckpt/CURRENT"))
    assert pointer["generation"] == generation and pointer["format"] == remote.POINTER_FORMAT
    assert _equal(load_checkpoint(url), state)
    assert verify_checkpoint(url).global_step == 3


def test_replacing_keeps_one_generation_and_loads_the_new_state(memory_fs):
    url = "memory://bucket/run/last.ckpt"
    save_checkpoint(_state(1, seed=1), url)
    save_checkpoint(_state(2, seed=2), url)
    generations = {o.split("/")[0] for o in _objects(memory_fs, "/bucket/run/last.ckpt")} - {remote.CURRENT_FILE}
    assert len(generations) == 1
    assert _equal(load_checkpoint(url), _state(2, seed=2))


def test_a_generation_without_current_is_not_a_checkpoint(memory_fs):
    url = "memory://bucket/run/a.ckpt"
    save_checkpoint(_state(1), url)
    memory_fs.rm_file("/bucket/run/a.ckpt/CURRENT")  # as if the commit never happened
    with pytest.raises(CheckpointNotFoundError, match="no committed lightning_ckpt checkpoint"):
        load_checkpoint(url)


def test_verify_and_load_name_a_corrupted_object(memory_fs):
    url = "memory://bucket/run/a.ckpt"
    save_checkpoint(_state(1), url)
    shard = next(p for p in memory_fs.find("/bucket/run/a.ckpt") if p.endswith(".safetensors") and "/optimizer" in p)
    data = bytearray(memory_fs.cat_file(shard))
    data[-5] ^= 0xFF
    memory_fs.pipe_file(shard, bytes(data))
    name = shard.rsplit("/", 1)[1]
    with pytest.raises(CorruptCheckpointError, match=f"checksum mismatch in object '{name}' \\(stored as '.*/gen-") as raised:
        verify_checkpoint(url)
    assert raised.value.file == name
    with pytest.raises(CorruptCheckpointError, match=name):
        load_checkpoint(url)


def test_a_missing_object_is_reported(memory_fs):
    url = "memory://bucket/run/a.ckpt"
    save_checkpoint(_state(1), url)
    shard = next(p for p in memory_fs.find("/bucket/run/a.ckpt") if p.endswith(".safetensors"))
    memory_fs.rm_file(shard)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        verify_checkpoint(url)


def test_remove_and_refusal_of_foreign_folders(memory_fs):
    url = "memory://bucket/run/a.ckpt"
    save_checkpoint(_state(1), url)
    remove_checkpoint(url)
    assert not memory_fs.exists("/bucket/run/a.ckpt/CURRENT") and memory_fs.find("/bucket/run/a.ckpt") == []
    memory_fs.pipe_file("/bucket/run/data/file.txt", b"user data")
    with pytest.raises(Exception, match="not a lightning_ckpt remote checkpoint"):
        remove_checkpoint("memory://bucket/run/data")
    assert memory_fs.cat_file("/bucket/run/data/file.txt") == b"user data"


def test_orphaned_generations_from_an_earlier_process_are_cleaned(memory_fs, monkeypatch):
    save_checkpoint(_state(1), "memory://bucket/run/a.ckpt")
    old = f"gen-{int(time.time() * 1000) - 60_000:013d}-0badc0de"
    memory_fs.pipe_file(f"/bucket/run/b.ckpt/{old}/model-00001-of-00001.safetensors", b"partial")  # never committed
    memory_fs.pipe_file(f"/bucket/run/a.ckpt/{old}/metadata.json", b"{}")  # a stale one beside a committed one
    monkeypatch.setattr(commit, "_PROCESS_STARTED_MS", int(time.time() * 1000))  # as if a new process
    monkeypatch.setattr(commit, "_cleaned", set())
    save_checkpoint(_state(2), "memory://bucket/run/c.ckpt")
    assert memory_fs.find("/bucket/run/b.ckpt") == []
    assert not any(old in p for p in memory_fs.find("/bucket/run/a.ckpt"))
    assert _equal(load_checkpoint("memory://bucket/run/a.ckpt"), _state(1))


def test_missing_filesystem_names_the_extra():
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed")
    with pytest.raises(MissingDependencyError, match=r"lightning-ckpt\[gcs\]"):
        save_checkpoint(_state(1), "gs://bucket/run/a.ckpt")


def test_io_sync_save_load_remove(memory_fs):
    io = ShardedCheckpointIO()
    url = "memory://bucket/run/x.ckpt"
    io.save_checkpoint(_state(5), url)
    assert io.last_save.path == url
    other = "memory://bucket/run/y.ckpt"
    io.save_checkpoint(_state(6), other)
    io.remove_checkpoint(other)
    assert memory_fs.find("/bucket/run/y.ckpt") == []
    assert _equal(io.load_checkpoint(url), _state(5))
    # A remote checkpoint this process loaded (resumed from) is never removed by the plugin: a
    # callback asking for it is refused with the way to remove it anyway.
    with pytest.warns(UserWarning, match=r"lightning_ckpt.remove_checkpoint\('memory://bucket/run//x.ckpt/'\)"):
        io.remove_checkpoint("memory://bucket/run//x.ckpt/")
    assert _equal(load_checkpoint(url), _state(5))
    remove_checkpoint(url)
    assert memory_fs.find("/bucket/run/x.ckpt") == []
    io.teardown()


def test_storage_options_argument_of_save_is_refused_with_a_fix():
    with pytest.raises(TypeError, match=r"ShardedCheckpointIO\(storage_options=\.\.\.\)"):
        ShardedCheckpointIO().save_checkpoint(_state(1), "memory://bucket/x.ckpt", storage_options={"anon": True})


def test_local_tier_commits_locally_then_uploads_in_the_background(memory_fs, tmp_path):
    io = ShardedCheckpointIO(local_dir=tmp_path / "tier", local_keep=2)
    urls = [f"memory://bucket/run/step={i}.ckpt" for i in range(3)]
    for i, url in enumerate(urls):
        io.save_checkpoint(_state(i, seed=i), url)
        local = io.remote.local_path(url)
        assert os.path.isfile(os.path.join(local, fmt.MANIFEST_FILE))  # committed locally when save returns
    io.wait()
    for i, url in enumerate(urls):
        assert verify_checkpoint(url).global_step == i
    tier = os.path.join(tmp_path, "tier", "memory", "bucket", "run")
    kept = sorted(n for n in os.listdir(tier) if not n.startswith("."))
    assert kept == ["step=1.ckpt", "step=2.ckpt"]  # local_keep=2 of the published ones
    assert sorted(r.path for r in io.poll()) == sorted(urls)
    io.remove_checkpoint(urls[2])
    io.wait()
    assert not memory_fs.exists("/bucket/run/step=2.ckpt/CURRENT")
    assert not os.path.exists(os.path.join(tier, "step=2.ckpt"))
    io.teardown()


def test_local_tier_load_prefers_a_newer_local_copy(memory_fs, tmp_path):
    io = ShardedCheckpointIO(local_dir=tmp_path / "tier")
    url = "memory://bucket/run/last.ckpt"
    io.save_checkpoint(_state(1, seed=1), url)
    io.wait()
    # The local copy is the published generation: loaded from disk, nothing downloaded.
    memory_fs.rm(f"/bucket/run/last.ckpt/{remote.read_pointer(memory_fs, '/bucket/run/last.ckpt', url)['generation']}", recursive=True)
    assert _equal(io.load_checkpoint(url), _state(1, seed=1))
    io.save_checkpoint(_state(1, seed=1), url)
    io.wait()
    # A local save whose upload did not happen (written by the local path alone) is newer: it wins.
    save_checkpoint(_state(9, seed=9), io.remote.local_path(url))
    os.unlink(remote.published_marker(io.remote.local_path(url)))
    assert _equal(io.load_checkpoint(url), _state(9, seed=9))
    io.teardown()


def test_local_tier_downloads_a_newer_remote(memory_fs, tmp_path):
    url = "memory://bucket/run/last.ckpt"
    writer_io = ShardedCheckpointIO(local_dir=tmp_path / "a")
    writer_io.save_checkpoint(_state(1, seed=1), url)
    writer_io.wait()
    save_checkpoint(_state(4, seed=4), url)  # written elsewhere, later
    assert _equal(writer_io.load_checkpoint(url), _state(4, seed=4))
    writer_io.teardown()


def test_failed_background_upload_is_raised_and_keeps_the_old_checkpoint(memory_fs, tmp_path):
    io = ShardedCheckpointIO(local_dir=tmp_path / "tier")
    good = "memory://bucket/run/good.ckpt"
    io.save_checkpoint(_state(1), good)
    io.wait()
    memory_fs.pipe_file("/bucket/run/bad.ckpt", b"a file where the checkpoint folder should go")
    io.save_checkpoint(_state(2), "memory://bucket/run/bad.ckpt/x.ckpt")
    io.remove_checkpoint(good)  # queued behind the failing upload: must be skipped
    with pytest.warns(UserWarning, match="Kept"), pytest.raises(CheckpointWriteError, match="Nothing was committed"):
        io.wait()
    assert _equal(load_checkpoint(good), _state(1))
    io.teardown()


def test_bad_arguments_are_clear(tmp_path):
    with pytest.raises(ValueError, match="local_keep"):
        ShardedCheckpointIO(local_keep=0)
    with pytest.raises(ValueError, match="upload_part_size"):
        ShardedCheckpointIO(upload_part_size="1MiB")
    with pytest.raises(ValueError, match="local_dir"):
        ShardedCheckpointIO(local_dir="s3://bucket/tier")
    with pytest.raises(ValueError, match="upload_concurrency"):
        ShardedCheckpointIO(upload_concurrency=0)


def test_compressed_components_roundtrip_and_are_recorded(memory_fs, tmp_path):
    pytest.importorskip("zstandard")
    url = "memory://bucket/run/z.ckpt"
    state = _state(4)
    state["optimizer_states"][0]["state"][0]["exp_avg"] = torch.zeros(256, 256)  # compresses well
    io = ShardedCheckpointIO(compression={"optimizer": "zstd"})
    io.save_checkpoint(state, url)
    committed = remote.read_committed(url, io.remote)
    optimizer_files = committed.manifest.components["optimizer"]
    assert set(committed.objects) == set(optimizer_files)
    for name in optimizer_files:
        assert memory_fs.exists(f"{committed.folder}/{name}.zst") and not memory_fs.exists(f"{committed.folder}/{name}")
        assert committed.objects[name]["size"] < committed.manifest.files[name].size / 10
    for name in committed.manifest.components["model"]:  # not opted in: plain safetensors
        assert name not in committed.objects and memory_fs.exists(f"{committed.folder}/{name}")
    assert committed.stored_bytes() < committed.manifest.total_bytes
    assert _equal(io.load_checkpoint(url), state)
    assert verify_checkpoint(url).global_step == 4
    io.teardown()


def test_a_damaged_compressed_object_is_named(memory_fs):
    pytest.importorskip("zstandard")
    url = "memory://bucket/run/z.ckpt"
    io = ShardedCheckpointIO(compression="zstd")
    io.save_checkpoint(_state(1), url)
    committed = remote.read_committed(url, io.remote)
    name = committed.manifest.components["model"][0]
    path = f"{committed.folder}/{name}.zst"
    data = bytearray(memory_fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    memory_fs.pipe_file(path, bytes(data))
    with pytest.raises(CorruptCheckpointError, match=name):
        verify_checkpoint(url)
    io.teardown()


def test_bad_compression_arguments():
    with pytest.raises(ValueError, match="'gzip' for '\\*' is not one of"):
        ShardedCheckpointIO(compression="gzip")
    with pytest.raises(ValueError, match="compression_level"):
        ShardedCheckpointIO(compression="zstd", compression_level=0)


def test_async_save_to_memory_is_refused_with_the_reason():
    io = ShardedCheckpointIO(async_save=True)
    with pytest.raises(ValueError, match="memory:// filesystem lives in one process"):
        io.save_checkpoint(_state(1), "memory://bucket/run/x.ckpt")
    io.teardown()


def test_missing_credentials_fail_the_save_clearly(monkeypatch, tmp_path):
    pytest.importorskip("s3fs")
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    url = "s3://bucket/run/x.ckpt"
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}}
    with pytest.raises(CheckpointWriteError, match=r"Uploading checkpoint 's3://bucket/run/x.ckpt' failed: NoCredentialsError") as raised:
        save_checkpoint(_state(1), url, storage_options=options)
    assert "Nothing was committed" in str(raised.value)


def test_a_load_without_local_tier_downloads_into_shared_memory_when_it_fits(monkeypatch, tmp_path):
    url = "memory://bucket/run/a.ckpt"
    save_checkpoint(_state(1), url)
    fake_shm = tmp_path / "shm"
    fake_shm.mkdir()
    monkeypatch.setattr(tier, "_SHARED_MEMORY", str(fake_shm))
    local, done = remote.local_copy_for_load(url, remote.RemoteOptions())
    assert local.startswith(str(fake_shm))
    assert _equal(load_checkpoint(local), _state(1))
    done()
    assert os.listdir(fake_shm) == []  # the download is gone once loaded
    monkeypatch.setattr(tier, "_SHARED_MEMORY", str(tmp_path / "missing"))
    local, done = remote.local_copy_for_load(url, remote.RemoteOptions())
    assert not local.startswith(str(tmp_path))  # no shared memory: the temporary folder
    done()


def test_incremental_remote_saves_copy_on_the_server_and_survive_a_removed_source(memory_fs):
    """Unchanged files are neither written nor uploaded again: copied from the previous
    checkpoint's generation. One removed behind the plugin's back is saved whole instead."""
    torch.manual_seed(0)
    frozen = {"frozen": torch.randn(4096)}
    io = ShardedCheckpointIO(max_shard_size=1)  # one file per tensor
    urls = [f"memory://bucket/run/{n}.ckpt" for n in "abcd"]

    def save(url: str, step: int) -> dict:
        state = {"state_dict": {**frozen, "head": torch.full((4,), float(step))}, "global_step": step}
        io.save_checkpoint(state, url)
        return state

    states = {urls[0]: save(urls[0], 0), urls[1]: save(urls[1], 1)}
    assert io.last_save.reused_bytes > frozen["frozen"].nbytes  # copied, not uploaded
    remove_checkpoint(urls[0])
    assert torch.equal(load_checkpoint(urls[1])["state_dict"]["frozen"], frozen["frozen"])
    remove_checkpoint(urls[1])  # behind the plugin's back: the next save cannot copy from it
    states[urls[2]] = save(urls[2], 2)
    assert io.last_save.reused_bytes == 0
    states[urls[3]] = save(urls[3], 3)
    assert io.last_save.reused_bytes > 0
    for url in urls[2:]:
        loaded = load_checkpoint(url)
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in states[url]["state_dict"].items())
    io.teardown()


def test_ranges_are_hashed_in_order_as_they_land_in_any_order(tmp_path):
    from lightning_ckpt.format import manifest as fmt
    from lightning_ckpt.remote.commit import _InOrderDigest

    data = os.urandom(10_000)
    local = tmp_path / "f"
    local.write_bytes(data)  # as the range jobs leave it: each range written before it lands
    expected = fmt.digest(data, "xxh3_64")
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3], [1, 1, 0, 0, 3, 2, 4]):  # duplicates: retries
        digest = _InOrderDigest(str(local), "xxh3_64")
        for i in order:
            digest.landed(i * 2000, data[i * 2000 : (i + 1) * 2000])
            assert not digest.ahead or min(digest.ahead) > digest.hashed
        assert digest.hashed == len(data)  # everything hashed as it landed, nothing left for the end
        assert digest.result() == (len(data), expected)
    gap = _InOrderDigest(str(local), "xxh3_64")  # a range never landed (cut short): read from the file
    gap.landed(0, data[:2000])
    gap.landed(4000, data[4000:6000])
    assert gap.result() == (len(data), expected)
