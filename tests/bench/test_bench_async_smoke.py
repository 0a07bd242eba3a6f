"""Smoke tests of the async (training-loop) benchmark at a tiny size, the package's (``python -m
lightning_ckpt bench --mode async``) and the research version (``python -m benchmarks --mode
async``): each runs every contender, cleans up, and reports sane JSON. No timing thresholds: only
structure and positivity."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_positive_medians

import benchmarks
from benchmarks import async_loop as bench_async
from lightning_ckpt import bench
from lightning_ckpt.bench import async_loop as package_async
from lightning_ckpt.bench.async_loop import CONTENDERS as PACKAGE_CONTENDERS

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the benchmark reads Linux /proc")


def test_package_bench_async_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpts"
    json_path = tmp_path / "results" / "async.json"
    argv = [
        "--size", "3MB", "--repeats", "1", "--saves", "3", "--every", "2", "--warmup", "3", "--compute-ms", "2",
        "--dir", str(ckpt_dir), "--json", str(json_path),
    ]  # fmt: skip

    assert bench.main(["--mode", "async", *argv]) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys() and report["argv"] == argv
    settings = report["settings"]
    assert settings["mode"] == "async" and settings["saves"] == 3 and settings["device"] == "cpu"
    assert settings["contenders"] == list(PACKAGE_CONTENDERS) and settings["compute"]["matmuls_per_step"] >= 1
    results = report["results"]
    assert results["errors"] == [] and 0.9 * 3e6 < results["state_bytes"] < 1.1 * 3e6
    # Lightning's TorchCheckpointIO / AsyncCheckpointIO and ours; DCP and the disk's floor are benchmarks/'
    assert list(results["contenders"]) == ["torch_io", "async_io", "sharded_async", "sharded_sync"]
    for name, entry in results["contenders"].items():
        summary = entry["summary"]
        assert_positive_medians(summary, "baseline_step_median_seconds", "durable_first_seconds", "durable_steady_median_seconds")
        assert summary["saves"]["median"] == 3 and summary["state_bytes"]["median"] >= results["state_bytes"], name
        assert math.isfinite(summary["stall_steady_median_seconds"]["median"]) and summary["peak_rss_mb"]["median"] >= 0
        (run,) = entry["runs"]
        assert [s["index"] for s in run["per_save"]] == [1, 2, 3]
        for record in run["per_save"]:
            assert record["call_seconds"] > 0 and record["durable_seconds"] >= record["call_seconds"] - 1e-3, (name, record)
        if name in ("torch_io", "sharded_sync"):  # durable when the call returns: no step runs while it writes
            assert summary["steps_while_writing"]["median"] == 0 and summary["step_while_writing_median_ratio"] is None
    ratios = results["ratios"]
    assert ratios["stall_steady_vs_torch_io"]["torch_io"] == pytest.approx(1.0)
    assert ratios["durable_steady_vs_async_io"]["async_io"] == pytest.approx(1.0)
    assert ratios["durable_steady_vs_async_io"]["sharded_async"] > 0

    out = capsys.readouterr().out  # the table on stdout, the JSON only in the file; nothing left on disk
    assert "sharded_async" in out and "dcp" not in out and "{" not in out
    assert not ckpt_dir.exists() or not any(ckpt_dir.rglob("*"))


def test_package_bench_async_refuses_a_research_contender(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--mode", "async", "--contenders", "sharded_async,dcp_async"])
    assert exit_info.value.code == 2 and "dcp_async" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--mode", "async", "--help"])
    assert exit_info.value.code == 0
    assert "python -m benchmarks --mode async" in " ".join(capsys.readouterr().out.split())


def test_benchmarks_async_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpts"
    json_path = tmp_path / "results" / "async.json"
    argv = [
        "--size", "3MB", "--repeats", "1", "--saves", "2", "--every", "2", "--warmup", "3", "--matmuls", "1",
        "--dir", str(ckpt_dir), "--json", str(json_path),
    ]  # fmt: skip

    assert benchmarks.main(["--mode", "async", *argv]) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys()
    assert report["argv"] == argv
    settings = report["settings"]
    assert settings["mode"] == "async" and settings["saves"] == 2 and settings["every"] == 2
    assert settings["contenders"] == list(bench_async.ALL)
    assert settings["compute"]["matmuls_per_step"] == 1
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["torch"] and report["machine"]["lightning"]

    results = report["results"]
    assert results["errors"] == []
    assert 0.9 * 3e6 < results["state_bytes"] < 1.1 * 3e6
    assert set(results["contenders"]) == set(bench_async.CONTENDERS)
    for name, entry in results["contenders"].items():
        summary = entry["summary"]
        assert_positive_medians(
            summary,
            "baseline_step_median_seconds",
            "call_first_seconds",
            "call_steady_median_seconds",
            "durable_first_seconds",
            "durable_steady_median_seconds",
            "peak_hwm_mb",
        )
        assert summary["teardown_seconds"]["median"] >= 0
        assert summary["saves"]["median"] == 2
        assert summary["bytes_on_disk"]["median"] >= results["state_bytes"], name
        (run,) = entry["runs"]
        assert [s["index"] for s in run["per_save"]] == [1, 2]
        for record in run["per_save"]:
            assert record["call_seconds"] > 0 and record["step_seconds"] >= record["call_seconds"]
            assert record["durable_seconds"] >= record["call_seconds"] - 1e-3, (name, record)  # two clocks readings
            assert math.isfinite(record["stall_seconds"]) and record["rss_mb"] > 0
        assert run["helpers_alive_after_teardown"] == []  # writer processes were torn down
        excess = [r["excess_while_writing_seconds"] for r in run["per_save"]]
        assert all(math.isfinite(e) for e in excess)
        if name not in bench_async.ASYNC_CONTENDERS:
            assert excess == [0, 0]  # no step runs while a synchronous save is written
        assert any(tag == "S1" for _, _, tag in run["step_trace"])
        if name in bench_async.ASYNC_CONTENDERS:
            assert summary["durable_first_seconds"]["median"] >= summary["call_first_seconds"]["median"]
        else:
            assert summary["steps_while_writing"]["median"] == 0
            assert summary["step_while_writing_median_ratio"] is None
    assert results["contenders"]["sharded_async"]["runs"][0]["helpers"]  # its writer process was seen

    copy = results["plain_copy"]["summary"]
    assert_positive_medians(copy, "seconds", "GBps")
    ratios = results["ratios"]
    assert ratios["stall_steady_vs_torch_io"]["torch_io"] == pytest.approx(1.0)
    assert ratios["sharded_async_vs_dcp_async"]["durable_steady"] > 0
    assert ratios["sharded_async_vs_dcp_sync"]["durable_steady_plus_teardown"] > 0
    assert ratios["sharded_async_vs_disk_floor"]["durable_steady"] > 0
    floor = results["contenders"]["disk_floor"]
    assert floor["runs"][0]["helpers"]  # the plain writer ran in its own process
    for record in floor["runs"][0]["per_save"]:
        assert record["call_seconds"] < record["durable_seconds"]  # the call only hands the path over

    # The table went to stdout, the JSON only to the file; every checkpoint written was removed.
    out = capsys.readouterr().out
    assert "sharded_async" in out and "{" not in out
    assert not ckpt_dir.exists() or not any(ckpt_dir.rglob("*"))


def test_disk_floor_reports_a_failed_write_and_stops_its_helper(tmp_path: Path) -> None:
    from benchmarks.common.contenders import make_contender

    contender = make_contender("disk_floor", str(tmp_path))
    try:
        contender.save({"w": torch.ones(1024)}, str(tmp_path / "missing-folder" / "x.ckpt"))
        deadline = time.monotonic() + 30
        with pytest.raises(RuntimeError, match=r"disk_floor: the plain write failed: .*missing-folder.*FileNotFoundError"):
            while time.monotonic() < deadline:
                contender.poll()
                time.sleep(0.01)
        assert contender.pending()  # never reported durable

        good = tmp_path / "y.ckpt"
        contender.errors.clear()
        contender.save({"w": torch.ones(1024)}, str(good))
        while not contender.poll():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert good.stat().st_size == 4096  # 4 KiB of tensor bytes, rounded up to 4 KiB
    finally:
        contender.teardown()
    (pid,) = contender.helper_pids()
    assert not os.path.exists(f"/proc/{pid}")


def test_bench_mode_async_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(package_async, "main", lambda argv: seen.append(("package", argv)) or 0)
    monkeypatch.setattr(bench_async, "main", lambda argv: seen.append(("benchmarks", argv)) or 0)
    assert bench.main(["--mode", "async", "--size", "1MB"]) == 0
    assert benchmarks.main(["--mode", "async", "--size", "2MB"]) == 0
    assert seen == [("package", ["--size", "1MB"]), ("benchmarks", ["--size", "2MB"])]
    assert bench.split_mode(["--sizes", "1MB"]) == ("save", ["--sizes", "1MB"])
    assert bench.split_mode(["--json", "--mode", "async"]) == ("async", ["--json"])
    assert bench_async.build_parser().parse_args([]).json_path is None
    assert bench_async.build_parser().parse_args(["--json"]).json_path == "-"
