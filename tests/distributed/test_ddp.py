"""DDP on CPU (gloo, 2 ranks): saves happen on rank 0 only, every rank resumes bit-identically."""

from __future__ import annotations

import os

import pytest
from helpers import run_script

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ddp_save_and_resume_on_two_cpu_ranks(tmp_path, mode):
    result = run_script("distributed/ddp_fit.py", mode, tmp_path=tmp_path)
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
