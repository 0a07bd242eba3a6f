"""Smoke test of the multi-rank benchmark at a tiny size on 2 ranks: it runs every contender, cleans
up, and reports sane JSON. No timing thresholds: only structure and positivity."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import assert_positive_medians

from benchmarks import distributed as bench_distributed

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/status") or not torch.distributed.is_available(),
    reason="the benchmark reads Linux /proc and needs torch.distributed (gloo)",
)


def test_bench_distributed_main_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpts"
    json_path = tmp_path / "results" / "distributed.json"
    ram_dir = tmp_path / "ram"  # any folder will do for the structure; the benchmark means a tmpfs one
    argv = [
        "--size", "3MB", "--repeats", "1", "--saves", "2", "--dir", str(ckpt_dir), "--ram-dir", str(ram_dir),
        "--json", str(json_path),
    ]  # fmt: skip

    assert bench_distributed.main(argv) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys()
    assert report["argv"] == argv
    settings = report["settings"]
    assert settings["mode"] == "distributed" and settings["world_size"] == 2 and settings["reshard_world_sizes"] == [1]
    results = report["results"]
    assert results["errors"] == []
    assert 0.9 * 3e6 < results["fsdp_state_bytes"] < 1.1 * 3e6 and 0.9 * 3e6 < results["ddp_state_bytes"] < 1.1 * 3e6

    assert set(results["fsdp"]) == set(bench_distributed.FSDP_CONTENDERS)
    for name, entry in results["fsdp"].items():
        summary = entry["summary"]
        assert_positive_medians(
            summary,
            "stall_first_seconds",
            "stall_steady_seconds",
            "durable_first_seconds",
            "durable_steady_seconds",
            "load_seconds",
        )
        assert summary["load_matches"] is True, name
        assert summary["bytes_total"]["median"] >= results["fsdp_state_bytes"], name
        (run,) = entry["runs"]
        assert len(run["per_save"]) == 2 and all(len(save["per_rank"]) == 2 for save in run["per_save"])
        assert all(b > 0 for b in run["bytes_per_rank"]), name  # every rank wrote its shards
        assert summary["durable_first_seconds"]["median"] >= summary["stall_first_seconds"]["median"] - 1e-3
    assert results["fsdp"]["sharded_async"]["summary"]["writer_peak_rss_mb"]["median"] > 0

    for name in ("dcp_stock", "sharded_sync"):
        load = results["reshard"]["1"][name]["summary"]
        assert_positive_medians(load, "seconds")
        assert load["matches"] is True, name

    assert set(results["ddp"]) == set(bench_distributed.DDP_CONTENDERS)
    for suffix in ("", "_buffered"):
        rank0, spread = results["ddp"][f"rank0_only{suffix}"]["summary"], results["ddp"][f"spread{suffix}"]["summary"]
        assert_positive_medians(rank0, "durable_first_seconds", "durable_steady_seconds", "cpu_seconds_steady")
        assert_positive_medians(spread, "durable_first_seconds", "durable_steady_seconds", "cpu_seconds_steady")
        assert rank0["bytes_per_rank"][0] >= results["ddp_state_bytes"] and rank0["bytes_per_rank"][1] == 0
        assert all(b > 0 for b in spread["bytes_per_rank"])
        assert spread["bytes_max_rank"]["median"] < rank0["bytes_max_rank"]["median"]

    disk = results["disk"]["summary"]
    assert_positive_medians(disk, "buffered_1w_GBps", "buffered_2w_GBps", "buffered_2w_vs_1w_seconds")
    ram = results["ram_fs"]
    assert ram["dir"] == str(ram_dir) and set(ram["ddp"]) == set(bench_distributed.RAM_DDP_CONTENDERS)
    assert_positive_medians(ram["ddp"]["spread"]["summary"], "durable_steady_seconds", "cpu_seconds_steady")
    assert_positive_medians(ram["disk"]["summary"], "buffered_1w_GBps", "buffered_2w_GBps")
    assert ram["ratios"]["ddp_spread_over_rank0_only"]["durable_steady_seconds"] > 0

    ratios = results["ratios"]
    assert ratios["fsdp_ours_over_stock"]["sharded_async"]["stall_steady_seconds"] > 0
    assert ratios["ddp_spread_over_rank0_only"]["durable_steady_seconds"] > 0
    expected_targets = {*bench_distributed.TARGETS} - {"reshard_load_vs_stock"}
    assert set(results["targets"]) == expected_targets | {"reshard_load_vs_stock_on_1", "ddp_spread_vs_rank0_only_ram_fs"}
    assert all(t["value"] > 0 and isinstance(t["met"], bool) for t in results["targets"].values())

    # The tables went to stdout, the JSON only to the file; every checkpoint written was removed.
    out = capsys.readouterr().out
    assert "ours, async" in out and "rank 0 writes all" in out and "{" not in out
    for folder in (ckpt_dir, ram_dir):
        assert not folder.exists() or not any(folder.rglob("*"))


def test_python_m_benchmarks_mode_distributed_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks

    seen = []
    monkeypatch.setattr(bench_distributed, "main", lambda argv: seen.append(argv) or 0)
    assert benchmarks.main(["--mode", "distributed", "--size", "1MB"]) == 0
    assert benchmarks.main(["--size", "1MB", "--mode=distributed"]) == 0
    assert seen == [["--mode", "distributed", "--size", "1MB"], ["--size", "1MB", "--mode=distributed"]]
    args = bench_distributed.build_parser().parse_args(["--mode", "distributed"])
    assert args.json_path is None and args.world_size == 2 and args.reshard_world_sizes == "1"
