"""Smoke test of ``bench --mode compression`` at a tiny size, against its own local S3 server (moto):
every component and level is measured through the shipping codec and comes back exact, and the
zstd-compressed checkpoint loads back equal to the uncompressed one. No timing thresholds."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
from helpers import assert_positive_medians

import benchmarks as bench  # python -m benchmarks --mode MODE
from benchmarks import compression

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the benchmark reads Linux /proc"),
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in ("zstandard", "s3fs", "moto")),
        reason="bench --mode compression needs zstandard, s3fs and moto[server] (pip install 'lightning-ckpt[zstd,test]')",
    ),
]

TINY = ["--params", "200K", "--vocab", "256", "--batch", "2", "--seq", "16", "--steps", "3", "--repeats", "1", "--levels", "1,3"]


def test_bench_compression_main_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work_dir = tmp_path / "work"
    json_path = tmp_path / "results" / "compression.json"
    argv = [*TINY, "--dir", str(work_dir), "--json", str(json_path)]
    environ = dict(os.environ)

    assert bench.main(["--mode", "compression", *argv]) == 0

    report = json.loads(json_path.read_text())
    assert {"command", "argv", "settings", "machine", "results"} <= report.keys()
    assert report["argv"] == argv
    settings = report["settings"]
    assert settings["mode"] == "compression" and settings["levels"] == [1, 3] and settings["steps"] == 3
    assert settings["model"]["parameters"] > 0
    results = report["results"]
    assert results["errors"] == []
    assert len(results["losses"]) == 3 and all(math.isfinite(loss) for loss in results["losses"])

    assert set(results["components"]) == set(compression.COMPONENTS)
    for name, entry in results["components"].items():
        assert entry["tensors"] > 0 and entry["elements"] > 0, name
        assert set(entry["levels"]) == {"1", "3"}, name
        for level, summary in entry["levels"].items():
            assert_positive_medians(summary, "ratio", "compress_MBps", "decompress_MBps")
            assert summary["raw_bytes"]["median"] > 0 and summary["compressed_bytes"]["median"] > 0, (name, level)
            assert summary["round_trip_exact"] is True, (name, level)
    components = results["components"]
    assert components["model_bf16"]["dtype"] == "bfloat16" and components["exp_avg"]["dtype"] == "float32"
    # the bf16 copy holds half the bytes of the fp32 weights; the moments as many as the weights
    fp32 = components["model_fp32"]["levels"]["1"]["raw_bytes"]["median"]
    assert components["model_bf16"]["levels"]["1"]["raw_bytes"]["median"] == fp32 / 2
    assert components["exp_avg_sq"]["levels"]["1"]["raw_bytes"]["median"] == fp32
    assert components["step"]["tensors"] == components["exp_avg"]["tensors"]

    e2e = results["end_to_end"]
    assert set(e2e) == set(compression.VARIANTS)
    for variant, summary in e2e.items():
        assert_positive_medians(summary, "ratio", "save_s", "load_s")
        assert summary["bit_exact"] is True and summary["mismatches"] == [], variant
        assert summary["stored_bytes"]["median"] == summary["recorded_bytes"]["median"], variant
    # the compressed checkpoint loaded back equals the uncompressed one, and is stored smaller
    assert e2e["zstd"]["equals_plain"] is True
    assert e2e["zstd"]["stored_bytes"]["median"] < e2e["plain"]["stored_bytes"]["median"]
    shard_bytes = {
        variant: {name: f["bytes"] for name, f in summary["files"].items() if name.endswith(".safetensors")}
        for variant, summary in e2e.items()
    }
    assert shard_bytes["plain"] == shard_bytes["zstd"] and "model_bf16-00001-of-00001.safetensors" in shard_bytes["zstd"]

    # The tables went to stdout, the JSON only to the file; the server's settings did not leak out,
    # and every local folder the run made is gone.
    out = capsys.readouterr().out
    assert "optimizer exp_avg_sq" in out and 'compression="zstd"' in out and "{" not in out
    assert dict(os.environ) == environ
    assert not work_dir.exists() or not any(work_dir.rglob("*"))


def test_bench_compression_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert compression.parse_levels("1,3") == (1, 3) and compression.parse_levels("3,3,19") == (3, 19)
    for bad in ("", "fast", "0", "23"):
        with pytest.raises(ValueError, match="--levels"):
            compression.parse_levels(bad)
    with pytest.raises(SystemExit):
        bench.main(["--mode", "compression", "--levels", "0"])
    assert "--levels" in capsys.readouterr().err
    # one stream, compression overlapped with the transfer: pays below the compressor's speed
    assert compression.link_factor(1000e6, 500e6, 2000.0, 1e9) == pytest.approx(0.5)
    assert compression.link_factor(1000e6, 500e6, 250.0, 1e9) == pytest.approx(4.0)
    assert compression.link_factor(1000e6, 500e6, None, 1e9) is None
