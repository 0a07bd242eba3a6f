"""CUDA: ``python -m benchmarks --mode train`` trains a tiny decoder on the GPU through every contender, and the
last checkpoint of each reloads bit-exact (no timing thresholds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_positive_medians

import benchmarks
from benchmarks import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bench_train_cuda_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "train-cuda.json"
    argv = [
        "--mode", "train", "--device", "cuda", "--params", "20M", "--vocab", "4096", "--batch", "4", "--seq", "256",
        "--repeats", "1", "--saves", "3", "--every", "3", "--warmup", "5", "--window", "2",
        "--dir", str(tmp_path / "ckpts"), "--json", str(json_path),
    ]  # fmt: skip

    assert benchmarks.main(argv) == 0

    report = json.loads(json_path.read_text())
    assert report["settings"]["device"] == "cuda" and report["machine"]["cuda"]["device"]
    results = report["results"]
    assert results["errors"] == [] and set(results["contenders"]) == set(train.CONTENDERS)
    for name, entry in results["contenders"].items():
        summary = entry["summary"]
        assert_positive_medians(summary, "baseline_step_median_seconds", "durable_first_seconds", "load_seconds")
        (run,) = entry["runs"]
        metrics = run["metrics"]
        assert metrics["bit_exact"] is True, (name, run["verification"])
        assert metrics["gpu_peak_delta_mb"] is not None and metrics["gpu_reserved_delta_mb"] is not None
        assert metrics["gpu_baseline_peak_mb"] > 0
        assert run["helpers_alive_after_teardown"] == [], name
