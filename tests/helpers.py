"""Assertion helpers shared by test modules."""

from __future__ import annotations

import math


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
