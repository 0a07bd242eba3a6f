"""Smoke tests of ``--mode save`` at a tiny size, the package's (``python -m lightning_ckpt bench``)
and the research version (``python -m benchmarks --mode save``): each runs, cleans up, and reports
sane JSON."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from helpers import assert_positive_medians

import benchmarks
from lightning_ckpt import bench
from lightning_ckpt.bench import report as bench_report

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the benchmark reads Linux /proc")


def test_package_bench_save_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpts"
    json_path = tmp_path / "results" / "bench.json"
    argv = ["--sizes", "3MB,4MB", "--repeats", "2", "--dir", str(ckpt_dir), "--json", str(json_path)]

    assert bench.main(argv) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys()
    assert report["argv"] == argv and report["settings"]["repeats"] == 2
    assert report["machine"]["torch"] and report["machine"]["lightning"]
    assert [result["size"] for result in report["results"]] == ["3MB", "4MB"]
    for result in report["results"]:
        assert result["errors"] == []
        # Lightning's TorchCheckpointIO and ours only: the loads and the plain-write floor are benchmarks/'
        assert result.keys() >= {"torch_io", "sharded_io", "ratios_ours_over_torch_io"} and "plain_write" not in result
        assert set(result["torch_io"]) == {"save"} and set(result["sharded_io"]) == {"save_first", "save_steady"}
        for op in (result["torch_io"]["save"], result["sharded_io"]["save_first"], result["sharded_io"]["save_steady"]):
            assert_positive_medians(op, "seconds", "GBps", runs=2)
            assert op["bytes_written"]["median"] >= result["state_bytes"] and "vs_plain" not in op
        ratios = result["ratios_ours_over_torch_io"]
        assert set(ratios) == {"save_seconds", "save_seconds_first", "save_peak_rss", "save_peak_rss_first"}
        assert ratios["save_seconds"] > 0 and ratios["save_seconds_first"] > 0

    out = capsys.readouterr().out  # the table on stdout, the JSON only in the file; nothing left on disk
    assert "sharded_io save" in out and "4MB" in out and "plain_write" not in out and "{" not in out
    assert not ckpt_dir.exists() or not any(ckpt_dir.rglob("*"))


def test_package_bench_save_names_its_research_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--mode", "save", "--help"])
    assert exit_info.value.code == 0
    assert "python -m benchmarks --mode save" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--sizes", ",", "--repeats", "1"])
    assert exit_info.value.code == 2 and "--sizes" in capsys.readouterr().err


def test_benchmarks_save_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpts"
    json_path = tmp_path / "results" / "bench.json"
    argv = ["--sizes", "3MB", "--repeats", "1", "--dir", str(ckpt_dir), "--json", str(json_path)]

    assert benchmarks.main(["--mode", "save", *argv]) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys()
    assert report["argv"] == argv
    assert report["settings"]["repeats"] == 1
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["total_ram_gb"] > 0
    assert report["machine"]["torch"] and report["machine"]["lightning"]

    (result,) = report["results"]
    assert result["size"] == "3MB" and result["errors"] == []
    assert 0.9 * 3e6 < result["state_bytes"] < 1.1 * 3e6 and 20 <= result["state_tensors"] // 3 <= 80

    plain = result["plain_write"]
    assert_positive_medians(plain["buffered"], "seconds", "GBps")
    assert plain["best_plain_GBps"] > 0
    for op in (result["torch_io"]["save"], result["sharded_io"]["save_first"], result["sharded_io"]["save_steady"]):
        assert_positive_medians(op, "seconds", "GBps", "vs_plain")
        assert op["peak_rss_mb"]["median"] >= 0 and op["bytes_written"]["median"] >= result["state_bytes"]
    for op in (result["torch_io"]["load"], result["sharded_io"]["load"]):
        assert_positive_medians(op, "seconds", "GBps", "load_checkpoint_seconds")
        assert op["peak_rss_mb"]["median"] >= 0 and op["peak_rss_anon_mb"]["median"] >= 0
    ratios = result["ratios_ours_over_torch_io"]
    assert {"save_seconds", "save_peak_rss", "load_seconds", "load_peak_rss", "load_peak_rss_anon"} <= ratios.keys()
    assert ratios["save_seconds"] > 0 and ratios["load_seconds"] > 0

    # The table went to stdout, the JSON only to the file; every checkpoint written was removed.
    out = capsys.readouterr().out
    assert "3MB" in out and "plain_write buffered" in out and "sharded_io load" in out and "{" not in out
    assert not ckpt_dir.exists() or not any(ckpt_dir.rglob("*"))


def test_json_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rich.table import Table

    parser = argparse.ArgumentParser()
    bench_report.add_json_argument(parser)
    parser.add_argument("--repeats")
    assert parser.parse_args([]).json_path is None
    assert parser.parse_args(["--json"]).json_path == "-"
    assert parser.parse_args(["--json", "-", "--repeats", "1"]).json_path == "-"
    assert parser.parse_args(["--json", "r.json"]).json_path == "r.json"
    table, results = Table("size"), {"results": [{"size": "3MB"}]}
    table.add_row("3MB")

    bench_report.emit_report(table, results, None)  # no --json: the table alone
    captured = capsys.readouterr()
    assert "3MB" in captured.out and "{" not in captured.out + captured.err

    bench_report.emit_report(table, results, "-")  # --json: stdout is the JSON document, the table on stderr
    captured = capsys.readouterr()
    assert json.loads(captured.out) == results and "3MB" in captured.err

    bench_report.emit_report(table, results, str(tmp_path / "out" / "r.json"))  # --json PATH: the file
    captured = capsys.readouterr()
    assert "3MB" in captured.out and "{" not in captured.out
    assert json.loads((tmp_path / "out" / "r.json").read_text()) == results
