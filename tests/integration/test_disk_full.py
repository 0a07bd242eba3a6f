"""A filesystem that fills up, and a read-only one: real tmpfs mounts made by the test.

Where mounting is not allowed these tests skip; the same failure paths are then covered by fault
injection at the write layer (tests/unit/test_errors.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest
import torch

import lightning_ckpt as lc


@pytest.fixture
def small_fs(tmp_path):
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}); write-layer injection covers it")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _state(megabytes: float) -> dict:
    return {"state_dict": {"w": torch.randn(int(megabytes * 2**20 / 4))}, "global_step": int(megabytes * 10)}


def _no_leftovers(folder) -> None:
    assert [n for n in os.listdir(folder) if n.startswith(".")] == []


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_disk_full_fails_cleanly_and_training_goes_on(small_fs, async_save):
    io = lc.ShardedCheckpointIO(async_save=async_save)
    try:
        io.save_checkpoint(_state(0.5), small_fs / "last.ckpt")
        io.save_checkpoint(_state(0.5), small_fs / "good.ckpt")
        io.wait()
        with pytest.raises(lc.CheckpointWriteError, match="No space left|Errno 28") as info:
            io.save_checkpoint(_state(2.5), small_fs / "last.ckpt")  # does not fit: replacing last.ckpt fails
            io.wait()
        message = str(info.value)
        assert "last.ckpt" in message and "Free space" in message
        # Said once: an async failure is not wrapped in a second "was not committed" sentence.
        assert message.count("committed") == 1 and ".." not in message
        _no_leftovers(small_fs)
        assert lc.load_checkpoint(small_fs / "last.ckpt", verify=True)["global_step"] == 5  # the old one
        lc.verify_checkpoint(small_fs / "good.ckpt")
        # Async: while the latest save has failed, removals are refused (nothing is ever removed
        # in favour of a checkpoint that does not exist). Sync: the removal goes through.
        refused = pytest.warns(UserWarning, match="Kept") if async_save else contextlib.nullcontext()
        with refused:
            io.remove_checkpoint(small_fs / "good.ckpt")
        io.wait()
        assert (small_fs / "good.ckpt").exists() == async_save
        io.save_checkpoint(_state(1), small_fs / "last.ckpt")
        io.wait()
        assert lc.load_checkpoint(small_fs / "last.ckpt", verify=True)["global_step"] == 10
    finally:
        io.teardown()


def test_read_only_target_gives_a_clear_error(small_fs):
    lc.save_checkpoint(_state(0.1), small_fs / "last.ckpt")
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        with pytest.raises(lc.CheckpointWriteError, match="Read-only file system") as info:
            lc.save_checkpoint(_state(0.1), small_fs / "last.ckpt")
        message = str(info.value)
        assert str(small_fs / "last.ckpt") in message and f"writing in {str(small_fs)!r}" in message
        assert ".lock" not in message and "lckpt-tmp" not in message  # internal names are not the user's to fix
        assert "Make that folder writable" in message
        assert lc.load_checkpoint(small_fs / "last.ckpt", verify=True)["global_step"] == 1
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=False)
