"""DDP on CPU (gloo, 2 ranks): saves happen on rank 0 only, every rank resumes bit-identically."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ddp_save_and_resume_on_two_cpu_ranks(tmp_path, mode):
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "ddp_fit.py"), str(report), mode],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(report.read_text())
    assert result["world_size"] == 2
    assert "last.ckpt" in result["files_after_first"] and len(result["files_after_first"]) == 3
    assert result["verified"] and all(name.endswith(".ckpt") for name in result["verified"])
    assert result["ranks_agree"]
    assert result["resumed_equals_reference"]
    # 4 steps per epoch on one rank's half of the data: the resumed run trained the last 2 epochs.
    assert result["resumed_losses"] == result["reference_losses"][len(result["reference_losses"]) - len(result["resumed_losses"]):]
    assert result["global_step"] == 8
    leftovers = [n for n in os.listdir(tmp_path / "ckpts") if n.startswith(".")]
    assert leftovers == []
