"""Crash consistency: SIGKILL a training process group that saves every step, at random moments.

Every run trains from scratch in the previous run's folder (debris included) with top-2 on
``train_loss`` + ``save_last``, so each step commits a top-k checkpoint, commits ``last`` and
removes the checkpoint that dropped out of the top 2. What each kill must leave (``check_folder``):

* every checkpoint visible under its final name passes full verification;
* nothing committed is lost: every checkpoint an earlier run left is still there, byte for byte
  (the version counter gives each run new names, so a run never replaces an earlier run's files);
* within the run that was killed, removal never runs ahead of the save replacing it. With its
  ``last`` at step L, the run keeps at least ``min(L, 2)`` top-k checkpoints, none newer than
  L + 1 (a kill between the top-k commit and ``last``'s commit leaves one at L + 1). Without a
  ``last`` (killed before its first ``last`` committed), it shows at most the top-k checkpoint of
  step 1, committed just before ``last`` in the same step. A run killed after its first ``last``
  committed (every synchronous run; every other async run) must still show one;
* resuming from the run's ``last`` restores exactly the saved state, and the next save into the
  folder cleans the temporaries the kill left.

A quick variant runs in CI; the long one (``slow``) is run before a release
(``pytest -m slow tests/integration/test_crash.py``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from crash_fit import Ballast, FrozenBallast
from helpers import process_alive, wait_until_gone
from lightning.pytorch import Trainer
from models import trainer_kwargs

import lightning_ckpt as lc

SCRIPT = os.path.join(os.path.dirname(__file__), "crash_fit.py")
TOP_K = 2  # crash_fit.py's save_top_k


def _kill_once(
    folder, mode: str, rng: random.Random, earlier: dict[str, bytes], wait_for: str, model: str = "ballast"
) -> dict:
    pid_file = folder / f"writer-{rng.random()}.pid"
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, str(folder / "ckpts"), mode, str(pid_file), wait_for, model],
        cwd=folder,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, killed as a whole
    )
    try:
        deadline = time.monotonic() + 300  # generous: start-up alone takes tens of seconds on a loaded machine
        while not pid_file.exists():  # this run is saving (see crash_fit.py for what `wait_for` guarantees)
            assert proc.poll() is None, "the training process died before saving"
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # a random moment: mid-write, mid-commit, mid-removal...
        # Everything dies at once, as in a container or machine kill: the training process group
        # and the async writer (which runs in a session of its own).
        writer_pid = pid_file.read_text()
        os.killpg(proc.pid, signal.SIGKILL)
        if writer_pid:
            try:
                os.kill(int(writer_pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # Judge the folder only once the killed writer is really gone (nothing changes it after that).
    if pid_file.read_text():
        assert wait_until_gone(int(pid_file.read_text()), 120), "the writer process outlived its training process"
    run_saved = mode == "sync" or wait_for == "committed"
    return check_folder(folder / "ckpts", earlier, run_saved, FrozenBallast if model == "frozen" else Ballast)


def check_folder(ckpts, earlier: dict[str, bytes], run_saved: bool, model_class: type = Ballast) -> dict:
    """Check the invariants of the module docstring after a kill.

    ``earlier``: name -> manifest bytes of every checkpoint visible after the previous kills;
    updated in place with what this run left. ``run_saved``: the killed run had finished a step
    (its first ``last`` committed) before the kill.
    """
    visible = sorted(n for n in os.listdir(ckpts) if not n.startswith(".")) if ckpts.exists() else []
    manifests = {}
    for name in visible:
        manifests[name] = lc.verify_checkpoint(ckpts / name)  # every hash; raises naming the damaged file
    for name, manifest_bytes in earlier.items():
        assert name in visible, f"{name}, committed by an earlier run, was lost: {visible}"
        assert (ckpts / name / "manifest.json").read_bytes() == manifest_bytes, f"{name} was changed by a later run"

    # What the killed run left: names no earlier run used.
    new = [n for n in visible if n not in earlier]
    lasts = [n for n in new if n.startswith("last")]
    steps = sorted(manifests[n].global_step for n in new if not n.startswith("last"))
    assert len(lasts) <= 1, f"more than one last checkpoint from one run: {lasts}"
    if not lasts:
        assert not run_saved, f"the run's last checkpoint was lost: {visible}"
        # Killed during its first step: at most that step's top-k checkpoint, committed before `last`.
        assert steps in ([], [1]), f"checkpoints without a last one: {new}"
        step = None
    else:
        step = manifests[lasts[0]].global_step
        # Removal never runs ahead of the save replacing it; `last` trails the top-k file by at most a step.
        assert len(steps) >= min(step, TOP_K), f"last is at step {step}, but only top-k steps {steps} are left"
        assert all(s <= step for s in steps[:-1]) and steps[-1] <= step + 1, (step, steps)
        # Resume without training further: the restored weights are the saved ones.
        saved = lc.load_checkpoint(ckpts / lasts[0])
        assert saved["global_step"] == step
        model = model_class()
        io = lc.ShardedCheckpointIO()
        trainer = Trainer(max_steps=step, enable_checkpointing=False, plugins=[io], **trainer_kwargs())
        trainer.fit(model, ckpt_path=ckpts / lasts[0])
        assert trainer.global_step == step
        for key, value in saved["state_dict"].items():
            assert torch.equal(model.state_dict()[key], value), key

    leftovers = [n for n in os.listdir(ckpts) if n.startswith(".")] if ckpts.exists() else []
    if ckpts.exists():
        # The next save into the folder removes what the crash left behind.
        lc.save_checkpoint({"state_dict": {}}, ckpts / "after-crash.ckpt")
        assert [n for n in os.listdir(ckpts) if n.startswith(".")] == []
        lc.remove_checkpoint(ckpts / "after-crash.ckpt")
    earlier.update({n: (ckpts / n / "manifest.json").read_bytes() for n in new})
    return {"step": step, "visible": len(visible), "new": len(new), "leftovers": len(leftovers)}


def _campaign(tmp_path, mode: str, kills: int, seed: int, model: str = "ballast") -> list[dict]:
    rng = random.Random(seed)
    earlier: dict[str, bytes] = {}
    # The same folder every time: each run meets the previous runs' checkpoints and debris. Async
    # kills alternate between the first saves (the writer may still be starting: on a loaded
    # machine that takes seconds) and the steady state after the run's first committed `last`.
    return [
        _kill_once(tmp_path, mode, rng, earlier, wait_for="started" if i % 2 == 0 else "committed", model=model)
        for i in range(kills)
    ]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_at_random_moments_quick(tmp_path, mode):
    results = _campaign(tmp_path, mode, kills=2, seed=1)
    # Sync, both kills land after the run's first committed step; async, the second does.
    assert results[1]["step"] is not None and (results[0]["step"] is not None or mode == "async"), results


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_during_incremental_saves_quick(tmp_path, mode):
    """Frozen weights: every save after a run's first links their shard from the previous
    checkpoint. The same invariants hold, and each run after a kill (a new process: it links
    nothing from the killed run's checkpoints) saves correct, complete checkpoints."""
    results = _campaign(tmp_path, mode, kills=4, seed=3, model="frozen")
    assert results[1]["step"] is not None and results[3]["step"] is not None, results  # runs after kills saved
    ckpts = tmp_path / "ckpts"
    stable = [ckpts / n / "model-stable-00001-of-00001.safetensors" for n in os.listdir(ckpts) if not n.startswith(".")]
    assert any(p.exists() and os.stat(p).st_nlink > 1 for p in stable), "no save reused the frozen shard"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_at_random_moments_long(tmp_path, mode):
    results = _campaign(tmp_path, mode, kills=int(os.environ.get("LCKPT_KILLS", "25")), seed=2)
    mid_save = sum(r["leftovers"] > 0 for r in results)
    resumed = sum(r["step"] is not None for r in results)
    first_step = sum(r["step"] is None and r["new"] > 0 for r in results)
    print(
        f"\n{mode}: {len(results)} kills, {mid_save} landed mid-save (left temporaries), {resumed} resumed exactly"
        f" from the run's last checkpoint, {first_step} between step 1's top-k commit and its last commit,"
        " every visible checkpoint verified, none lost"
    )
