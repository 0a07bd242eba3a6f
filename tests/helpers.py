"""Assertion helpers shared by test modules."""

from __future__ import annotations

import math
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
