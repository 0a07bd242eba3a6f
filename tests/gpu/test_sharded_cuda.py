"""Sharded strategies on one GPU: FSDP1 (``FSDPStrategy`` is GPU-only in Lightning) and FSDP2 save
in our format through the plugin and resume bit-identically through the strategy subclasses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import lightning_ckpt as lc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_cuda_fit.py")


@pytest.mark.parametrize("mode", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("save", ["sync", "async"])
def test_sharded_strategy_saves_in_our_format_and_resumes(tmp_path, mode, save):
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, str(report), mode, save], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(report.read_text())
    assert result["checkpoints"] == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt"]
    assert result["resumed_equals_uninterrupted"]
    checkpoint = tmp_path / "ckpts" / "epoch=1-step=16.ckpt"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and not (checkpoint / ".metadata").exists()
    loaded = lc.load_checkpoint(checkpoint)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert all(torch.equal(loaded["state_dict"][k].cpu(), v.cpu()) for k, v in final.items())
