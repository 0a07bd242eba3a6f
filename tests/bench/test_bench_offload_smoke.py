"""Smoke test of ``bench --mode offload`` at a tiny size: it runs and reports sane JSON."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_ckpt import bench


def test_bench_offload_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "offload.json"
    argv = ["--mode", "offload", "--params", "20000", "--tensor-size", "3000", "--chunk-size", "16KiB",
            "--steps", "2", "--repeats", "1", "--json", str(json_path)]
    assert bench.main(argv) == 0
    report = json.loads(json_path.read_text())
    assert report["settings"]["params"] == "20000"
    rows = {r["contender"]: r for r in report["results"]}
    assert set(rows) == {"ChunkedAdamW", "AdamW fused", "AdamW foreach", "bandwidth floor"}
    for row in rows.values():
        assert row["params_per_second"] > 0 and row["vs_floor"] > 0
    assert rows["AdamW foreach"]["vs_foreach"] == 1.0
    assert rows["bandwidth floor"]["stream_bytes_per_second"] > 0


def test_bench_offload_strategy_tiny(tmp_path: Path) -> None:
    json_path = tmp_path / "strategy.json"
    argv = ["--mode", "offload", "--strategy", "--width", "64", "--layers", "6", "--batch", "4",
            "--steps", "2", "--repeats", "1", "--json", str(json_path)]
    assert bench.main(argv) == 0
    rows = {r["contender"]: r for r in json.loads(json_path.read_text())["results"]}
    assert set(rows) == {"resident (no strategy)", "ChunkedOffloadStrategy"}
    streamed = rows["ChunkedOffloadStrategy"]
    assert streamed["median_step_seconds"] > 0 and streamed["vs_resident"] > 0
    assert 0 < streamed["peak_device_bytes"] <= streamed["device_memory_budget"]
    assert streamed["streamed_chunks"] > 0 and streamed["h2d_bytes"] > 0


def test_bench_offload_save_tiny(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the checkpoints go to a temporary folder of the working directory
    json_path = tmp_path / "save.json"
    argv = ["--mode", "offload", "--save", "--width", "64", "--layers", "3", "--batch", "4", "--chunk-size", "16KiB",
            "--steps", "2", "--repeats", "1", "--json", str(json_path)]
    assert bench.main(argv) == 0
    rows = {r["contender"]: r for r in json.loads(json_path.read_text())["results"]}
    assert set(rows) == {"AdamW fused", "ChunkedAdamW"}
    moments = 2 * 3 * (64 * 64 + 64) * 4
    # ChunkedAdamW: the moments are left to its arena (copied once, off the call); AdamW's are copied in the call.
    assert rows["ChunkedAdamW"]["arena_copied_bytes"] == moments and rows["AdamW fused"]["arena_copied_bytes"] == 0
    assert rows["AdamW fused"]["staged_in_call_bytes"] - rows["ChunkedAdamW"]["staged_in_call_bytes"] == moments
    for row in rows.values():
        assert row["median_stall_seconds"] > 0 and row["median_durable_seconds"] > 0 and row["optimizer_d2h_bytes"] == 0
