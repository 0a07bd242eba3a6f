"""Concurrent processes on one folder: nothing torn, nothing lost."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

import lightning_ckpt as lc

WRITER = """
import sys, torch, lightning_ckpt as lc
folder, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
io = lc.ShardedCheckpointIO()
for step in range(1, count + 1):
    state = {"global_step": step, "state_dict": {"w": torch.full((250_000,), float(step))}}
    io.save_checkpoint(state, f"{folder}/{name}-{step}.ckpt")          # a new name...
    io.save_checkpoint(state, f"{folder}/last-{name}.ckpt")           # ...and a replaced one
    if step > 1:
        io.remove_checkpoint(f"{folder}/{name}-{step - 1}.ckpt")       # top-k style removal
"""


def _start(folder, name, count):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(folder), name, str(count)])


def test_reader_never_sees_a_torn_last_checkpoint(tmp_path):
    writer = _start(tmp_path, "a", 150)
    loads, last_step = 0, 0
    try:
        while writer.poll() is None:
            if not (tmp_path / "last-a.ckpt").exists():
                time.sleep(0.005)
                continue
            state = lc.load_checkpoint(tmp_path / "last-a.ckpt", verify=True)  # raises if torn
            step = state["global_step"]
            assert torch.equal(state["state_dict"]["w"], torch.full((250_000,), float(step)))
            assert step >= last_step
            last_step, loads = step, loads + 1
    finally:
        writer.wait(timeout=300)
    assert writer.returncode == 0 and loads > 10


def test_two_processes_saving_into_one_folder(tmp_path):
    writers = [_start(tmp_path, name, 60) for name in ("a", "b")]
    for w in writers:
        assert w.wait(timeout=300) == 0
    assert sorted(os.listdir(tmp_path)) == ["a-60.ckpt", "b-60.ckpt", "last-a.ckpt", "last-b.ckpt"]
    for name in os.listdir(tmp_path):
        state = lc.load_checkpoint(tmp_path / name, verify=True)
        assert state["global_step"] == 60
