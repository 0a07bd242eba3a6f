"""CUDA: the async training-loop benchmarks (``python -m benchmarks --mode async`` and the package's
``python -m lightning_ckpt bench --mode async``) run every contender with the state on the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import assert_positive_medians

from benchmarks import async_loop as bench_async
from lightning_ckpt.bench import async_loop as package_async

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bench_async_cuda_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "async-cuda.json"
    argv = [
        "--device", "cuda", "--size", "24MB", "--repeats", "1", "--saves", "3", "--every", "2", "--warmup", "3",
        "--matmuls", "2", "--matmul-size", "512", "--dir", str(tmp_path / "ckpts"), "--json", str(json_path),
    ]  # fmt: skip

    assert bench_async.main(argv) == 0

    report = json.loads(json_path.read_text())
    assert report["settings"]["device"] == "cuda" and report["machine"]["cuda"]["device"]
    results = report["results"]
    assert results["errors"] == []
    for name, entry in results["contenders"].items():
        summary = entry["summary"]
        assert_positive_medians(summary, "baseline_step_median_seconds", "call_first_seconds", "durable_first_seconds")
        assert summary["saves"]["median"] == 3, name
        assert summary["bytes_on_disk"]["median"] >= results["state_bytes"], name
        (run,) = entry["runs"]
        assert run["metrics"]["cuda_peak_extra_mb"] is not None
        for record in run["per_save"]:
            assert record["durable_seconds"] >= record["call_seconds"] - 1e-3, (name, record)  # two clocks readings
        # the loop steps after every save but (for a save durable when its call returns) the last
        assert all(record["next_step_seconds"] is not None for record in run["per_save"][:-1]), name
        assert run["helpers_alive_after_teardown"] == []
    assert_positive_medians(results["plain_copy"]["summary"], "seconds", "GBps")


def test_package_bench_async_cuda_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "async-cuda.json"
    argv = [
        "--device", "cuda", "--size", "24MB", "--repeats", "1", "--saves", "3", "--every", "2", "--warmup", "3",
        "--compute-ms", "5", "--dir", str(tmp_path / "ckpts"), "--json", str(json_path),
    ]  # fmt: skip

    assert package_async.main(argv) == 0

    report = json.loads(json_path.read_text())
    assert report["settings"]["device"] == "cuda" and report["machine"]["cuda"]["device"]
    results = report["results"]
    assert results["errors"] == [] and set(results["contenders"]) == {"torch_io", "async_io", "sharded_async", "sharded_sync"}
    for name, entry in results["contenders"].items():
        summary = entry["summary"]
        assert_positive_medians(summary, "baseline_step_median_seconds", "durable_first_seconds", "durable_steady_median_seconds")
        assert summary["saves"]["median"] == 3, name
        for record in entry["runs"][0]["per_save"]:
            assert record["durable_seconds"] >= record["call_seconds"] - 1e-3, (name, record)
