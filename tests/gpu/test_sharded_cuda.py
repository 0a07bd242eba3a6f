"""Sharded strategies on GPUs: FSDP1 (``FSDPStrategy`` is GPU-only in Lightning) and FSDP2 save
in our format through the plugin and resume bit-identically through the strategy subclasses; on
two GPUs every rank writes its shards from its own device."""

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
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("mode", ["fsdp", "fsdp2"])
@pytest.mark.parametrize("save", ["sync", "async"])
def test_sharded_strategy_saves_in_our_format_and_resumes(tmp_path, mode, save, devices):
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} CUDA devices")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env["LCKPT_TEST_DEVICES"] = str(devices)
    # the package from this tree in the script's folder too (a relative PYTHONPATH=. would not be)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, SCRIPT, str(report), mode, save], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(report.read_text())
    steps = 8 // devices  # per epoch: 64 samples in batches of 8, split over the ranks
    assert result["checkpoints"] == [f"epoch=0-step={steps}.ckpt", f"epoch=1-step={2 * steps}.ckpt"]
    assert result["resumed_equals_uninterrupted"]
    checkpoint = tmp_path / "ckpts" / f"epoch=1-step={2 * steps}.ckpt"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and not (checkpoint / ".metadata").exists()
    ranks = {f.get("rank", 0) for name, f in manifest["files"].items() if name.endswith(".safetensors")}
    assert ranks == set(range(devices))
    loaded = lc.load_checkpoint(checkpoint)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert all(torch.equal(loaded["state_dict"][k].cpu(), v.cpu()) for k, v in final.items())
