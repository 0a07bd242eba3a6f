"""Smoke test of the memory-release benchmark at a tiny size: every scenario and policy runs, cleans
up, and reports sane JSON. No timing thresholds: only structure, positivity and what each policy did."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

import benchmarks as bench  # python -m benchmarks --mode MODE
from benchmarks import release as bench_release

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the benchmark reads Linux /proc")


def test_bench_release_main_tiny(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpts"
    json_path = tmp_path / "results" / "release.json"
    argv = [
        "--mode", "release", "--size", "8MB", "--tensor-kb", "10", "--saves", "2", "--repeats", "1",
        "--dir", str(ckpt_dir), "--json", str(json_path),
    ]  # fmt: skip

    assert bench.main(argv) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys()
    settings = report["settings"]
    assert settings["mode"] == "release" and settings["saves"] == 2 and settings["repeats"] == 1
    assert settings["policies"] == ["never", "always", "auto"] and settings["auto_threshold_mb"] == 256
    results = report["results"]
    assert results["errors"] == []
    assert set(results["scenarios"]) == set(bench_release.SCENARIOS)
    for scenario, policies in results["scenarios"].items():
        assert set(policies) == set(bench_release.POLICIES)
        for policy, entry in policies.items():
            summary = entry["summary"]
            for key in ("call_s", "stall_s", "stall_over_call", "rss_after_mb"):
                assert summary[key]["median"] > 0, (scenario, policy, key)
            assert summary["stall_s"]["median"] >= summary["call_s"]["median"]
            (run,) = entry["runs"]
            assert [s["index"] for s in run["per_save"]] == [1, 2]
            for record in run["per_save"]:
                assert math.isclose(record["stall_s"], record["call_s"] + record["release_s"])
                assert record["heap_left_mb"] >= 0 and record["reason"]
                if policy == "never":
                    assert not record["trimmed"] and record["released_mb"] is None
                elif policy == "always":  # on the training thread: known at once, no background trim
                    assert record["trimmed"] and record["released_mb"] is not None and record["background_trim_s"] is None
                elif record["trimmed"]:  # auto: in the background, waited for before RSS was read
                    assert record["background_trim_s"] is not None and record["released_mb"] is not None
        # An async save into the reused pool leaves next to nothing: the default does not trim.
        if scenario == "async":
            assert policies["auto"]["summary"]["trimmed_saves"]["median"] == 0
    assert set(results["ratios"]) == set(bench_release.SCENARIOS)
    assert all(value > 0 for ratios in results["ratios"].values() for value in ratios.values())
    assert not ckpt_dir.exists() or os.listdir(ckpt_dir) == []  # the run folder was removed
