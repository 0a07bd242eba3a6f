"""CUDA: a resume's load into the device. ``map_location="cuda"`` through the plugin, and the
read-once load over an NCCL group (one rank: its broadcast goes through the device bounce
buffer as on many), every tensor equal to what was saved; the load benchmark's CUDA rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import benchmarks as bench
import lightning_ckpt as lc
from lightning_ckpt.format import read_once

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _saved(tmp_path: Path) -> tuple[str, dict]:
    torch.manual_seed(0)
    state = {"state_dict": {f"w{i}": torch.randn(512, 300 + i) for i in range(4)}, "epoch": 1}
    path = str(tmp_path / "c.ckpt")
    lc.save_checkpoint(state, path, max_shard_size="1MB")
    return path, state


def test_the_plugin_loads_into_the_device(tmp_path: Path) -> None:
    path, state = _saved(tmp_path)
    loaded = lc.ShardedCheckpointIO().load_checkpoint(path, map_location="cuda")
    for key, value in state["state_dict"].items():
        assert loaded["state_dict"][key].is_cuda and torch.equal(loaded["state_dict"][key].cpu(), value)


def test_read_once_broadcasts_through_the_device_under_nccl(tmp_path: Path, monkeypatch) -> None:
    path, state = _saved(tmp_path)
    monkeypatch.setattr(read_once, "_BLOCK", 2**20)  # several blocks per file through the bounce buffer
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        assert read_once._collective_device(None).type == "cuda"
        loaded, read = read_once.load_read_once(path, "cuda", None, verify=True)
    finally:
        dist.destroy_process_group()
    assert read.bytes_read == read.total_bytes
    for key, value in state["state_dict"].items():
        assert loaded["state_dict"][key].is_cuda and torch.equal(loaded["state_dict"][key].cpu(), value)


def test_bench_load_cuda_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "load-cuda.json"
    argv = ["--mode", "load", "--device", "cuda", "--sizes", "8MB", "--repeats", "1", "--dir", str(tmp_path / "runs"),
            "--contenders", "read floor,ShardedCheckpointIO,TorchCheckpointIO,DCP load in place", "--json", str(json_path)]  # fmt: skip
    assert bench.main(argv) == 0
    (result,) = json.loads(json_path.read_text())["results"]
    assert result["errors"] == []
    for name in ("ShardedCheckpointIO", "TorchCheckpointIO", "DCP load in place"):
        assert result["contenders"][name]["seconds"] > 0
