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
