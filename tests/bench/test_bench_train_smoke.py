"""Smoke test of ``bench --mode train`` at a tiny size on CPU: every contender trains, saves, reloads
bit-exact, cleans up, and the JSON has its fields. No timing thresholds: structure and signs only."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from helpers import assert_positive_medians

import benchmarks
from benchmarks import train
from benchmarks.common import arguments
from lightning_ckpt import bench

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the benchmark reads Linux /proc")

TINY = [
    "--params", "300K", "--vocab", "256", "--batch", "2", "--seq", "16", "--repeats", "1", "--saves", "2",
    "--every", "2", "--warmup", "3", "--window", "1", "--threads", "1",
]  # fmt: skip


def test_bench_train_cpu_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpts"
    json_path = tmp_path / "results" / "train.json"
    argv = ["--mode", "train", "--device", "cpu", *TINY, "--dir", str(ckpt_dir), "--json", str(json_path)]

    assert benchmarks.main(argv) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys()
    settings = report["settings"]
    assert settings["mode"] == "train" and settings["device"] == "cpu" and settings["saves"] == 2
    assert settings["contenders"] == list(train.CONTENDERS) and settings["verify"] is True
    assert settings["model"]["parameters"] > 0 and settings["model"]["layers"] >= 1
    results = report["results"]
    assert results["errors"] == []
    assert set(results["contenders"]) == set(train.CONTENDERS)
    for name, entry in results["contenders"].items():
        summary = entry["summary"]
        assert_positive_medians(
            summary,
            "baseline_step_median_seconds",
            "call_first_seconds",
            "durable_first_seconds",
            "durable_steady_median_seconds",
            "load_seconds",
        )
        assert summary["state_bytes"]["median"] > 0 and summary["bytes_on_disk"]["median"] > 0, name
        assert summary["saves"]["median"] == 2, name
        (run,) = entry["runs"]
        metrics = run["metrics"]
        # the last checkpoint reloads bit for bit equal to the copy taken at the save
        assert metrics["bit_exact"] is True and metrics["verified_tensors"] > 0, (name, run["verification"])
        assert run["verification"]["mismatches"] == []
        for key in ("lost_first_seconds", "lost_steady_median_seconds", "post_save_worst_steady_ratio"):
            assert math.isfinite(metrics[key]), (name, key)
        assert metrics["gpu_peak_delta_mb"] is None and metrics["peak_rss_mb"] is not None
        assert [s["index"] for s in run["per_save"]] == [1, 2]
        for record in run["per_save"]:
            # durable is stamped inside the contender's save, the call's end outside it: a sync
            # save's two clocks readings may differ by microseconds either way
            assert record["durable_seconds"] >= record["call_seconds"] - 1e-3, (name, record)
            assert record["window_steps"] >= 2  # the save's step, and at least --window 1 more
            assert len(record["post_steps"]) == record["window_steps"] - 1
        assert any(tag == "S1" for _, _, tag in run["step_trace"])
        assert run["helpers_alive_after_teardown"] == []
    for reference in ("vs_torch_io", "vs_async_io"):
        lost = results["ratios"][reference]["lost_steady_median_seconds"]
        assert set(lost) == set(train.CONTENDERS)
    assert results["ratios"]["vs_torch_io"]["durable_steady_median_seconds"]["torch_io"] == pytest.approx(1.0)

    out = capsys.readouterr().out  # the table on stdout, the JSON only in the file; nothing left on disk
    assert "sharded_async" in out and "{" not in out
    assert not ckpt_dir.exists() or not any(ckpt_dir.rglob("*"))


def test_bench_train_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert arguments.parse_count("1.3B", "--params") == 1_300_000_000
    assert arguments.parse_count("350M", "--params") == 350_000_000 and train.parse_count("8000", "--params") == 8000
    with pytest.raises(ValueError, match="--params"):
        arguments.parse_count("lots", "--params")
    with pytest.raises(SystemExit):
        benchmarks.main(["--mode", "train", "--device", "cpu", "--contenders", "nope"])
    assert "--contenders" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert all(mode in help_text for mode in (*bench.MODES, *bench.REPOSITORY_MODES))
