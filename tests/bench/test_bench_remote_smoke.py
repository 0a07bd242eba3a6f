"""Smoke test of ``bench --mode remote`` at a tiny size against its own local S3 server (moto): every
contender runs, loads back exactly what it saved, and the JSON is complete. No timing thresholds."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
from helpers import assert_positive_medians

import benchmarks as bench  # python -m benchmarks --mode MODE
from benchmarks import remote as bench_remote
from benchmarks.common import workloads
from benchmarks.common.s3 import s3_environment

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the benchmark reads Linux /proc"),
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in ("s3fs", "moto")),
        reason="bench --mode remote needs s3fs and moto[server] (pip install 'lightning-ckpt[test]')",
    ),
]


def test_bench_remote_main_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work_dir = tmp_path / "work"
    json_path = tmp_path / "results" / "remote.json"
    argv = ["--size", "3MB", "--repeats", "1", "--dir", str(work_dir), "--json", str(json_path)]
    # What the run sets (the server's endpoint and credentials, the allocator setting) is put back.
    keys = [*s3_environment("http://127.0.0.1:1"), "MALLOC_MMAP_THRESHOLD_"]
    environ = {key: os.environ.get(key) for key in keys}

    assert bench.main(["--mode", "remote", *argv]) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys()
    assert report["argv"] == argv
    settings = report["settings"]
    assert settings["mode"] == "remote" and settings["repeats"] == 1
    assert settings["contenders"] == list(bench_remote.CONTENDERS)
    assert settings["upload_part_size"] == 64 * 2**20 and settings["upload_concurrency"] >= 1

    result = report["results"]
    assert result["errors"] == []
    assert 0.9 * 3e6 < result["state_bytes"] < 1.1 * 3e6
    assert result["upload_memory_budget_mb"] == pytest.approx(settings["upload_concurrency"] * 64 * 2**20 / 1e6)
    contenders = result["contenders"]
    assert set(contenders) == set(bench_remote.CONTENDERS)
    for name, summary in contenders.items():
        assert summary is not None, name
        assert_positive_medians(summary, "stall_s", "durable_s", "durable_GBps", "load_s")
        assert summary["durable_s"]["median"] >= summary["stall_s"]["median"], name
        assert summary["bit_exact"] is True and summary["mismatches"] == [], name
        assert summary["peak_rss_mb"]["median"] >= 0 and summary["load_peak_rss_mb"]["median"] >= 0, name
    for name in ("sharded_local_tier", "s3fs_put"):  # the uploads timed alone
        assert_positive_medians(contenders[name], "upload_s", "upload_GBps")
    assert contenders["sharded_async"]["writer_peak_rss_anon_mb"]["median"] >= 0
    for name in bench_remote.OURS_REMOTE:
        assert contenders[name]["upload_peak_anon_mb"]["median"] >= 0

    ratios = result["ratios"]
    for key in ("local_tier_stall_vs_local_disk_stall", "upload_GBps_vs_s3fs_put", "upload_memory_vs_budget_sharded_sync"):
        value = ratios[key]["value"]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, key
        assert ratios[key]["met"] in (True, False)

    # The table went to stdout, the JSON only to the file; the server's settings did not leak out,
    # and every local folder the run made is gone.
    out = capsys.readouterr().out
    assert "TorchCheckpointIO" in out and "local_tier_stall_vs_local_disk_stall" in out and "{" not in out
    assert {key: os.environ.get(key) for key in keys} == environ
    assert not work_dir.exists() or not any(work_dir.rglob("*"))


def test_mismatches_are_named() -> None:
    import torch

    saved = {"w": torch.tensor([1.0, -0.0]), "betas": (0.9, 0.999), "step": 3}
    assert workloads.mismatches(saved, {"w": torch.tensor([1.0, -0.0]), "betas": (0.9, 0.999), "step": 3}) == []
    # -0.0 == 0.0 as floats, but not as bytes; a tuple that comes back as a list is a difference too
    found = workloads.mismatches(saved, {"w": torch.tensor([1.0, 0.0]), "betas": [0.9, 0.999], "step": 3})
    assert found == [
        "checkpoint['w']: the bytes differ",
        "checkpoint['betas']: tuple of 2 came back as list",
    ]
    assert workloads.mismatches(saved, {"w": saved["w"].double(), "betas": (0.9, 0.999)}) == [
        "checkpoint: keys missing [\"'step'\"], unexpected []"
    ]
    assert workloads.mismatches(saved, {**saved, "w": saved["w"].double()}) == [
        "checkpoint['w']: torch.float32 (2,) came back as torch.float64 (2,)"
    ]
