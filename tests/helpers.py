"""Helpers shared by test modules: assertions, processes, scripts, corrupted files."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time


def assert_positive_medians(summary: dict, *keys: str, runs: int = 1) -> None:
    """Each ``summary[key]`` is ``{"median": float > 0, "values": [...]}`` with ``runs`` values."""
    for key in keys:
        median = summary[key]["median"]
        assert isinstance(median, float) and math.isfinite(median) and median > 0, (key, summary[key])
        assert len(summary[key]["values"]) == runs


def process_alive(pid: int) -> bool:
    """Is ``pid`` running (a zombie counts as gone)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_until_gone(pid: int, timeout: float) -> bool:
    """Poll until ``pid`` is gone; False if it is still running after ``timeout`` seconds.

    A process that was told to exit (or killed) takes a scheduler-dependent time to go: on a loaded
    machine far longer than any fixed sleep. Poll with a generous deadline instead of sleeping.
    """
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_script(script: str, *args: str, tmp_path) -> dict:
    """Run ``tests/<script> <tmp_path>/report.json *args`` in ``tmp_path`` as a fresh launch (no
    ``LOCAL_RANK``: Lightning's launcher starts the other ranks); fail with the tail of its output if
    it exits non-zero, else return the JSON report it wrote."""
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), script), str(report), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(report.read_text())


def flip_byte(file: str | os.PathLike, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset`` of ``file``."""
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def close_process_group() -> None:
    """End a multi-rank test script: every rank meets, then tears its process group down.

    Left to interpreter shutdown, gloo's threads were destroyed while joinable ("terminate called
    without an active exception", exit code -6), once each in two scripts' full-suite runs.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
