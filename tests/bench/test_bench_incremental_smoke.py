"""Smoke test of the incremental-saves benchmark at a tiny size: every fine-tune and contender runs,
cleans up, and reports sane JSON. No timing thresholds: structure, positivity and bytes only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import benchmarks as bench  # python -m benchmarks --mode MODE
from benchmarks import incremental as bench_incremental


def test_bench_incremental_main_tiny(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpts"
    json_path = tmp_path / "results" / "incremental.json"
    argv = [
        "--mode", "incremental", "--base-size", "4MB", "--width", "256", "--rank", "1", "--saves", "3",
        "--every", "1", "--repeats", "1", "--dir", str(ckpt_dir), "--json", str(json_path),
    ]  # fmt: skip

    assert bench.main(argv) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys()
    assert report["settings"]["mode"] == "incremental" and report["settings"]["saves"] == 3
    results = report["results"]
    assert results["errors"] == []
    assert set(results["scenarios"]) == set(bench_incremental.SCENARIOS)
    for scenario, contenders in results["scenarios"].items():
        assert set(contenders) == set(bench_incremental.CONTENDERS)
        for contender, entry in contenders.items():
            summary = entry["summary"]
            for key in ("stall_s", "durable_s", "written_mb", "first_written_mb", "state_mb"):
                assert summary[key]["median"] > 0, (scenario, contender, key)
            (run,) = entry["runs"]
            assert [s["index"] for s in run["per_save"]] == [1, 2, 3]
            reuses = scenario == "lora" and contender.startswith("incremental")
            assert (summary["reused_mb"]["median"] > 0) == reuses, (scenario, contender)
    lora, full = results["ratios"]["lora"], results["ratios"]["full"]
    # A frozen base: later saves write the adapters and their AdamW moments (3 * 2 * 1/256 of the base).
    assert lora["written_incremental_over_rewrite"] < 0.05
    assert full["written_incremental_over_rewrite"] == 1.0
    assert not ckpt_dir.exists() or os.listdir(ckpt_dir) == []  # the run folder was removed
