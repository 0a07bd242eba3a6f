"""Smoke test of ``python -m benchmarks --mode load`` at a tiny size: every contender runs in its
own process and reports seconds, bytes read and its ratio to the read floor."""

from __future__ import annotations

import json
from pathlib import Path

import benchmarks as bench


def test_bench_load_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "load.json"
    argv = ["--mode", "load", "--sizes", "8MB", "--repeats", "1", "--dir", str(tmp_path / "runs"), "--json", str(json_path)]
    assert bench.main(argv) == 0
    (result,) = json.loads(json_path.read_text())["results"]
    rows = result["contenders"]
    assert result["errors"] == [] and result["floor_gbps"] > 0
    assert set(rows) == {"floor buffered", "floor direct", "ShardedCheckpointIO", "TorchCheckpointIO",
                         "DCP load in place", "safetensors load_file (model)"}  # fmt: skip
    for name in ("ShardedCheckpointIO", "TorchCheckpointIO", "DCP load in place"):
        assert rows[name]["seconds"] > 0 and rows[name]["bytes_read"] > 7e6 and rows[name]["vs_read_floor"] > 0
    assert not list((tmp_path / "runs").glob("*"))  # the checkpoints are removed
