"""``make demo`` (examples/demo.py), with a tiny model: it runs, labels its figures, and what it
claims holds (the run SIGKILLed mid-save resumes bit-identical, verify passes and catches a flipped
byte; the demo exits non-zero otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys

import lightning_ckpt as lc

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "demo.py")


def test_demo_runs_and_its_claims_hold(tmp_path):
    proc = subprocess.run([sys.executable, DEMO, "--tiny"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert os.listdir(tmp_path) == ["demo-output"]  # what .gitignore ignores in the repository
    # Every row of the side-by-side table has a legend entry.
    for number in range(1, 9):
        assert f"│ [{number}] " in out and f"\n  [{number}] " in out, number
    assert "Lightning TorchCheckpointIO" in out and "ours, async" in out
    assert "identical step by step in both runs" in out
    assert "bit-identical (torch.equal)" in out
    assert "all checksums match" in out and "exit code 1 (1: damaged)" in out
    killed = tmp_path / "demo-output" / "killed"
    # The resumed run's saves replaced last.ckpt and removed whatever the kill left behind.
    assert sorted(os.listdir(killed)) == ["damaged.ckpt", "last.ckpt"]
    assert lc.verify_checkpoint(killed / "last.ckpt").global_step == 20  # TINY: 4 epochs of 5 steps
