"""Smoke test of ``bench --mode offload`` at a tiny size: it runs and reports sane JSON."""

from __future__ import annotations

import json
from pathlib import Path

import benchmarks as bench  # python -m benchmarks --mode MODE


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


def run_largest(tmp_path: Path, *options: str) -> list[dict]:
    """``--largest`` for a decoder of width 32 on 2 x ``--seq-len`` tokens; its result rows."""
    json_path = tmp_path / "largest.json"
    argv = ["--mode", "offload", "--largest", "--width", "32", "--heads", "2", "--vocab", "64", "--sequences", "2",
            "--chunk-size", "4KiB", "--steps", "1", *options, "--json", str(json_path)]
    assert bench.main(argv) == 0
    return json.loads(json_path.read_text())["results"]


def test_bench_offload_largest_tiny(tmp_path: Path) -> None:
    rows = {r["contender"]: r for r in run_largest(tmp_path, "--seq-len", "64", "--budget", "200KB", "--max-layers", "64")}
    assert set(rows) == {"ChunkedOffloadStrategy", "resident (every chunk resident)"}
    streamed, resident = rows["ChunkedOffloadStrategy"], rows["resident (every chunk resident)"]
    for row in rows.values():
        # the answer is the boundary: the largest depth trained within the budget, the next did not
        assert row["next_layers"] == row["largest_layers"] + 1
        tried = {p["layers"]: p for p in row["probes"]}
        assert "reason" not in tried[row["largest_layers"]] and "reason" in tried[row["next_layers"]]
        assert all(("reason" in p) == (p["layers"] > row["largest_layers"]) for p in row["probes"])
        assert 0 < row["peak_device_bytes"] <= row["device_memory_budget"] == 200_000 and row["step_seconds"] > 0
    # streamed, the depth is bounded by the saved activations: the plan's error names the unit
    assert streamed["next_reason"].startswith("OffloadBudgetError") and "unit 'decoder.blocks." in streamed["next_reason"]
    assert resident["next_reason"].startswith("peak device memory") and resident["next_peak_device_bytes"] > 200_000
    assert streamed["largest_layers"] > resident["largest_layers"] and streamed["params_vs_resident"] > 1


def test_bench_offload_largest_host_cap_tiny(tmp_path: Path) -> None:
    for row in run_largest(tmp_path, "--seq-len", "8", "--budget", "10MB", "--max-host-gb", "0.002"):
        # at 24 B/param, 2 MB holds 6 blocks of 12 x 32² + 4 x 32 parameters besides the embedding,
        # the final norm and the head (2 x 64 x 32 + 2 x 32), not 7: the budget (10 MB) is not what stops it
        assert (row["largest_layers"], row["next_layers"]) == (6, 7)
        assert row["next_reason"].startswith("host-memory cap") and "--max-host-gb 0.002" in row["next_reason"]


def run_ranks(tmp_path: Path, mode: str, layers: int) -> dict[str, dict]:
    """``--mode offload --fsdp2`` or ``--ddp`` on 2 CPU ranks, tiny: the rows by contender."""
    json_path = tmp_path / "ranks.json"
    argv = ["--mode", "offload", mode, "--ranks", "2", "--width", "64", "--layers", str(layers), "--batch", "8",
            "--chunk-size", "16KiB", "--steps", "2", "--repeats", "1", "--json", str(json_path)]
    assert bench.main(argv) == 0
    return {r["contender"]: r for r in json.loads(json_path.read_text())["results"]}


def test_bench_offload_fsdp2_tiny(tmp_path: Path) -> None:
    rows = run_ranks(tmp_path, "--fsdp2", layers=2)
    assert set(rows) == {"FSDP2 + AdamW fused", "FSDP2 + ChunkedAdamW"}
    assert rows["FSDP2 + AdamW fused"]["vs_adamw"] == 1.0
    for row in rows.values():
        assert row["median_step_seconds"] > 0 and len(row["host_optimizer_bytes_per_rank"]) == 2
        # each rank holds half of the 2 x (64 x 64 + 64) parameters
        assert sum(row["local_params_per_rank"]) == 2 * (64 * 64 + 64)
    # moments only, on each rank's shards (the shards are host fp32: stepped in place)
    for n, b in zip(rows["FSDP2 + ChunkedAdamW"]["local_params_per_rank"], rows["FSDP2 + ChunkedAdamW"]["host_optimizer_bytes_per_rank"]):
        assert 8 * n <= b


def test_bench_offload_ddp_tiny(tmp_path: Path) -> None:
    rows = run_ranks(tmp_path, "--ddp", layers=4)
    # on the CPU the device exchange has no row (it needs CUDA and NCCL)
    assert set(rows) == {"DDP + AdamW fused", "DDP + ChunkedAdamW, every rank steps all", "DDP + ChunkedAdamW, host exchange (gloo)"}
    assert rows["DDP + ChunkedAdamW, every rank steps all"]["exchange_backend"] is None
    chunked = rows["DDP + ChunkedAdamW, host exchange (gloo)"]
    assert chunked["exchange_backend"] == "gloo" and rows["DDP + AdamW fused"]["exchange_backend"] is None
    # every rank holds every parameter; ChunkedAdamW's state is split: each rank's arena holds its
    # own chunks' 12 B/param (4 chunks of 64 x 64 + 64 fp32 = 16.25 KiB: 2 per rank), AdamW's 8 B/param everywhere
    assert chunked["local_params_per_rank"] == [4 * (64 * 64 + 64)] * 2
    assert all(12 * 2 * (64 * 64 + 64) <= b < 12 * 3 * (64 * 64 + 64) for b in chunked["host_optimizer_bytes_per_rank"])
    assert rows["DDP + AdamW fused"]["host_optimizer_bytes_per_rank"] == [8 * 4 * (64 * 64 + 64)] * 2


def test_bench_offload_refuses_ddp_on_one_rank_and_both_modes(capsys) -> None:
    assert bench.main(["--mode", "offload", "--ddp", "--ranks", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err
    assert bench.main(["--mode", "offload", "--ddp", "--fsdp2"]) == 2
    assert "pass one of them" in capsys.readouterr().err
