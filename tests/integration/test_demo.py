"""``make demo`` (examples/demo.py), with a tiny model: it runs, labels its figures, and what it
claims holds (the run SIGKILLed mid-save resumes bit-identical, verify passes and catches a flipped
byte; the demo exits non-zero otherwise)."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import re
import subprocess
import sys

import lightning_ckpt as lc

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "demo.py")


def _demo_module():
    spec = importlib.util.spec_from_file_location("lightning_ckpt_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_demo_runs_and_its_claims_hold(tmp_path):
    proc = subprocess.run([sys.executable, DEMO, "--tiny"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert os.listdir(tmp_path) == ["demo-output"]  # what .gitignore ignores in the repository
    # Every row of the side-by-side table has a legend entry.
    for number in range(1, 9):
        assert f"│ [{number}] " in out and f"\n  [{number}] " in out, number
    header = next(line for line in out.splitlines() if "figure" in line)
    assert all(name in header for name in ("TorchCheckpointIO", "AsyncCheckpointIO", "ours, async")), header
    table = [line for line in out.splitlines() if line.startswith("│")]
    assert len(table) == 9 and not [line for line in table if re.search(r"-\d", line)]  # no negative figure
    fsynced = next(line for line in table if "fsynced" in line)
    assert fsynced.count("never") == 2, fsynced  # Lightning's two IOs never fsync; ours says when
    assert "identical step by step in all three runs" in out
    assert "bit-identical (torch.equal)" in out
    assert "all checksums match" in out and "exit code 1 (1: damaged)" in out
    killed = tmp_path / "demo-output" / "killed"
    # The resumed run's saves replaced last.ckpt and removed whatever the kill left behind.
    assert sorted(os.listdir(killed)) == ["damaged.ckpt", "last.ckpt"]
    assert lc.verify_checkpoint(killed / "last.ckpt").global_step == 20  # TINY: 4 epochs of 5 steps


def test_time_lost_per_save_is_never_negative():
    demo = _demo_module()

    def starts(save_step: float) -> list[float]:
        # 30 steps of 1 s, a save at the end of every 5th, whose step lasts `save_step` s
        durations = [save_step if i % 5 == 0 else 1.0 for i in range(1, 31)]
        return [0.0, *itertools.accumulate(durations)]

    step, lost, noise = demo.step_figures(starts(1.3), every=5)
    assert step == 1.0 and abs(lost - 0.3) < 1e-9 and noise == 0.0  # steady steps: no noise
    # Saves "faster" than no save (other work slowed the ordinary steps): a difference below 0 is noise.
    step, lost, noise = demo.step_figures(starts(0.6), every=5)
    assert abs(lost + 0.4) < 1e-9
    figures = demo.Figures(
        size_mb=1.0, stall_s=0.1, lost_s=max(0.0, lost), noise_s=noise, step_s=step, complete_s=0.1,
        fsynced_s=None, peak_mb=0.0, pool_mb=0.0, writer_mb=0.0, fit_s=1.0,
    )  # fmt: skip
    assert demo._lost(figures) == "within noise"
    assert demo._lost(dataclasses.replace(figures, lost_s=0.3, noise_s=0.1)) == "0.300 s"
    assert demo._lost(dataclasses.replace(figures, lost_s=0.05, noise_s=0.1)) == "within noise"


def test_each_figure_shows_its_range_and_a_slower_ordinary_step_beyond_noise_is_a_cost():
    demo = _demo_module()
    base = demo.Figures(
        size_mb=1.0, stall_s=0.1, lost_s=0.0, noise_s=0.0, step_s=0.050, complete_s=0.1, fsynced_s=None,
        peak_mb=0.0, pool_mb=0.0, writer_mb=0.0, fit_s=1.0, step_noise_s=0.002,
        ranges={"stall_s": (0.09, 0.4), "step_s": (0.045, 0.07)},
    )  # fmt: skip
    assert demo._ranged(base, "stall_s", demo._s) == "0.100 s (0.090–0.400)"
    assert demo._ranged(base, "complete_s", demo._s) == "0.100 s"  # no range recorded
    slower = dataclasses.replace(base, step_s=0.060, ranges={"step_s": (0.05, 0.08)})
    assert demo._step(slower, base) == "0.060 s (0.050–0.080), +20%"
    assert demo._step(dataclasses.replace(slower, step_noise_s=0.01), base) == "0.060 s (0.050–0.080), same"
    assert demo._step(base, base) == "0.050 s (0.045–0.070)"
    assert demo.median_noise([1.0]) == 0.0 and demo.median_noise([1.0, 1.0, 1.0]) == 0.0
