"""2-rank DDP on CPU: ShardedModelCheckpoint runs one collective per checkpoint file written (the
barrier in Trainer.save_checkpoint) and none on other steps, where ModelCheckpoint adds barrier +
all_reduce pairs for top-k and the version counter; both keep the same files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


def _run(tmp_path, mode: str) -> dict:
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "collectives_fit.py"), str(report), mode],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(report.read_text())


def test_collectives_per_step(tmp_path):
    result = _run(tmp_path, "steps")
    stock, ours = result["stock"], result["ours"]
    assert [s["saved"] for s in ours] == [s["saved"] for s in stock] and any(s["saved"] for s in ours)
    for step in ours:
        # Only Trainer.save_checkpoint's barrier, once per checkpoint file (top-k file, last.ckpt).
        assert step["collectives"] == ["barrier"] * len(step["files"]), step
    stock_per_save = [len(s["collectives"]) for s in stock if s["saved"]]
    assert min(stock_per_save) >= 5, stock  # what the callback avoids (7 with top-k, version counter, last)
    assert all(not s["collectives"] for s in stock if not s["saved"])
    assert result["ours_kept"] == result["stock_kept"] and "last.ckpt" in result["ours_kept"]


def test_time_trigger_without_a_per_batch_broadcast(tmp_path):
    result = _run(tmp_path, "time")
    stock, ours = result["stock"], result["ours"]
    assert all(any(c.startswith("broadcast") for c in s["collectives"]) for s in stock)  # every batch
    saves = sum(s["saved"] for s in ours)
    checks = sum(any(c.startswith("broadcast") for c in s["collectives"]) for s in ours)
    assert saves >= 2, ours
    assert checks <= 3 * saves + 2 and checks < len(ours) / 2, (checks, saves, len(ours))
    for step in ours:
        assert [c for c in step["collectives"] if not c.startswith("broadcast")] == ["barrier"] * len(step["files"])
    assert len(result["ours_kept"]) >= 2 and "last.ckpt" in result["ours_kept"]
