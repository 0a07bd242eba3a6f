"""The writer process's CPU-saving paths: the idle-priority digest with hand-over, the quick exit;
its environment."""

import importlib.util
import mmap
import os
import subprocess
import sys
import threading

import pytest

import lightning_ckpt
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.save.worker import _wait_exit, writer_environment
from lightning_ckpt.store import shards


def _image(size: int) -> mmap.mmap:
    buffer = mmap.mmap(-1, max(4096, -(-size // 4096) * 4096))
    buffer[:size] = bytes((i * 7 + i // 251) % 256 for i in range(size)) if size < 1 << 16 else os.urandom(size)
    return buffer


@pytest.mark.parametrize("size", [0, 1, 4096, shards._BackgroundDigest._PIECE, 3 * shards._BackgroundDigest._PIECE + 17])
def test_background_digest_equals_the_digest_of_the_bytes(size):
    buffer = _image(size)
    expected = fmt.digest(memoryview(buffer)[:size])
    assert shards._BackgroundDigest(memoryview(buffer)[:size]).finish() == expected


def test_background_digest_finish_hashes_what_the_thread_has_not_reached(monkeypatch):
    # The idle thread is held before its first piece: finish() must hash the whole image itself,
    # and the thread must then stop without hashing anything twice.
    size = 5 * shards._BackgroundDigest._PIECE + 3
    buffer = _image(size)
    gate = threading.Event()
    monkeypatch.setattr(shards, "_lower_thread_priority", gate.wait)  # holds the idle thread
    digest = shards._BackgroundDigest(memoryview(buffer)[:size])
    finisher = threading.Thread(target=lambda: result.append(digest.finish()))
    result: list[str] = []
    finisher.start()
    finisher.join(0.2)
    gate.set()  # the thread starts only now: finish() already took its work over
    finisher.join()
    assert result == [fmt.digest(memoryview(buffer)[:size])]


def test_background_digest_cancel_stops_the_thread():
    size = 8 * shards._BackgroundDigest._PIECE
    buffer = _image(size)
    digest = shards._BackgroundDigest(memoryview(buffer)[:size])
    digest.cancel()
    assert not digest._thread.is_alive()


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("max_rate", [None, 1e12])
def test_write_image_records_the_digest_of_the_file(tmp_path, direct, max_rate):
    size = 2 * shards._BackgroundDigest._PIECE + 12345
    buffer = _image(size)
    shard_writer = shards.ShardWriter(chunk_bytes=1 << 20, direct_io=direct, max_rate=max_rate)
    direct = shard_writer.use_direct(str(tmp_path))
    record = shard_writer.write_image(str(tmp_path / "f"), buffer, 0, size, direct)
    data = (tmp_path / "f").read_bytes()
    assert record.size == len(data) == size
    assert record.digest == fmt.digest(data)


def test_write_image_failure_stops_the_digest_thread(tmp_path):
    buffer = _image(3 * shards._BackgroundDigest._PIECE)
    (tmp_path / "taken").write_bytes(b"")
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(FileExistsError):
        shards.ShardWriter(direct_io=False).write_image(str(tmp_path / "taken"), buffer, 0, len(buffer), False)
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "lightning_ckpt-hash"]


def test_wait_exit_returns_the_exit_code_and_times_out():
    quick = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert _wait_exit(quick, 30) == 3
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            _wait_exit(slow, 0.1)
    finally:
        slow.kill()
        slow.wait()


def test_background_digest_hurry_hashes_the_rest_while_the_idle_thread_is_starved(monkeypatch):
    size = 3 * shards._BackgroundDigest._PIECE + 5
    buffer = _image(size)
    gate = threading.Event()
    monkeypatch.setattr(shards, "_lower_thread_priority", gate.wait)  # holds the idle thread
    digest = shards._BackgroundDigest(memoryview(buffer)[:size])
    digest.hurry()
    assert digest._helper is not None
    digest._helper.join()
    assert digest._done == size  # hashed by the helper alone, the idle thread still held
    gate.set()
    assert digest.finish() == fmt.digest(memoryview(buffer)[:size])


def test_unwritable_probes_without_leaving_anything(tmp_path):
    from lightning_ckpt.store.commit import unwritable

    assert unwritable(tmp_path / "a" / "b") is None and os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("x")
    assert "a file is in the way" in unwritable(tmp_path / "file" / "ckpts")


def test_unwritable_names_a_read_only_filesystem(tmp_path):
    from lightning_ckpt.store.commit import unwritable

    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        message = unwritable(mount / "ckpts")
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert "Read-only file system" in message and "Make that folder writable" in message


def test_the_writer_finds_this_package_from_any_folder(tmp_path, monkeypatch):
    """A process that found the package through a relative ``PYTHONPATH=.`` (a source tree, the
    GPU image) starts its writer in another folder: the writer's path names the package's folder."""
    monkeypatch.setenv("PYTHONPATH", ".")
    env = writer_environment()
    assert env["OMP_NUM_THREADS"] == "1" and env["PYTHONPATH"].split(os.pathsep)[-1] == "."
    # -S: no site folders (an editable install's finder would hide the path): PYTHONPATH alone
    probe = "import importlib.util; print(importlib.util.find_spec('lightning_ckpt').origin)"
    found = subprocess.run([sys.executable, "-S", "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == importlib.util.find_spec("lightning_ckpt").origin == lightning_ckpt.__file__
