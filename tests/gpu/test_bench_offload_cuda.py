"""Smoke test of ``python -m benchmarks --mode offload --device cuda`` at a tiny size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import benchmarks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bench_offload_cuda_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "offload.json"
    argv = ["--mode", "offload", "--device", "cuda", "--width", "256", "--layers", "2", "--batch", "64",
            "--chunk-size", "64KiB", "--steps", "2", "--repeats", "1", "--json", str(json_path)]
    assert benchmarks.main(argv) == 0
    rows = {r["contender"]: r for r in json.loads(json_path.read_text())["results"]}
    assert {"AdamW on the GPU (fused)", "ChunkedAdamW", "FSDP2 CPUOffloadPolicy"} <= set(rows)
    for row in rows.values():
        assert row["median_step_seconds"] > 0 and row["peak_device_bytes"] > 0
    # no optimizer state on the device: less device memory than AdamW on the GPU
    assert rows["ChunkedAdamW"]["peak_device_bytes"] < rows["AdamW on the GPU (fused)"]["peak_device_bytes"]


def test_bench_offload_save_cuda_tiny(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    json_path = tmp_path / "save.json"
    argv = ["--mode", "offload", "--save", "--device", "cuda", "--width", "256", "--layers", "2", "--batch", "64",
            "--chunk-size", "64KiB", "--steps", "2", "--repeats", "1", "--json", str(json_path)]
    assert benchmarks.main(argv) == 0
    rows = {r["contender"]: r for r in json.loads(json_path.read_text())["results"]}
    moments = 2 * 2 * (256 * 256 + 256) * 4
    # AdamW's moments come off the device; ChunkedAdamW's are host memory the arena copies itself
    assert rows["AdamW fused"]["optimizer_d2h_bytes"] >= moments  # and its step counts (fused: on the device)
    assert rows["ChunkedAdamW"]["optimizer_d2h_bytes"] == 0 and rows["ChunkedAdamW"]["arena_copied_bytes"] == moments


def test_bench_offload_strategy_cuda_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "strategy.json"
    # 8 blocks of 12.6M bf16 parameters (25 MB each, one chunk each) under a 160 MB budget that
    # also holds cuBLAS workspaces and the activations: some blocks stream.
    argv = ["--mode", "offload", "--strategy", "--device", "cuda", "--width", "1024", "--layers", "8", "--heads", "8",
            "--vocab", "512", "--sequences", "2", "--seq-len", "128", "--budget", "160MB", "--chunk-size", "32MiB",
            "--steps", "2", "--repeats", "1", "--json", str(json_path)]
    assert benchmarks.main(argv) == 0
    rows = {r["contender"]: r for r in json.loads(json_path.read_text())["results"]}
    assert set(rows) == {"resident (no strategy)", "FSDP2 CPUOffloadPolicy", "ChunkedOffloadStrategy"}
    streamed = rows["ChunkedOffloadStrategy"]
    assert "error" not in streamed, streamed
    assert streamed["parameter_bytes"] > streamed["device_memory_budget"]
    assert 0 < streamed["peak_device_bytes"] <= streamed["device_memory_budget"]
    assert streamed["streamed_chunks"] > 0 and streamed["vs_resident"] > 0
