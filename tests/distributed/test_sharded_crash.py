"""Crash consistency of multi-rank saves: SIGKILL ranks of a 2-rank FSDP2 run mid-save.

The guarantee: one atomic commit for the whole checkpoint. Every rank writes its shards into a
shared temporary folder; rank 0 writes the manifest last, once every rank's part is durable, and
renames the folder into place. Until then nothing loads it, and a rank killed mid-save leaves no
committed checkpoint (the previous one stays). After each kill (``check_folder``):

* every directory visible under a final name has its manifest, passes full verification and loads,
  its tensors whole (assembled from both ranks' pieces);
* every checkpoint committed before the kill is still there, byte for byte (same manifest, every
  file's digest checked against it), and a save that could not commit committed nothing;
* rank 0 outliving a killed rank 1 fails the save after ``part_timeout`` with a
  ``CheckpointWriteError`` naming the missing rank, and removes the save's temporary folder;
* a fresh launch in the same folder removes the killed run's temporary folders at rank 0's first
  save and resumes from ``last`` to exactly the saved state.

The test starts both ranks itself, as torchrun would (``LOCAL_RANK`` set: Lightning launches
nothing): Lightning's own launcher SIGKILLs rank 0 within 5 s of a child's death, which would hide
what rank 0 does when a peer dies, and it starts rank 1 only once rank 0 has imported everything.
Where the kill lands is pinned in the one-rank tests (sharded_crash_fit.py pauses the rank right
after the first shard file of its part is durable) and random in the whole-group test.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lightning_ckpt as lc
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.store.commit import PART_MARKER

pytestmark = pytest.mark.distributed

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_crash_fit.py")
PART_TIMEOUT = 20.0  # sharded_crash_fit.py's
START_TIMEOUT = 300.0  # start-up alone takes tens of seconds on a loaded 2-core machine
LAYERS = {f"net.{i}.{kind}": shape for i in range(3) for kind, shape in (("weight", [1024, 1024]), ("bias", [1024]))}


class Launch:
    """Both ranks of one run, in one process group of their own (killed as a whole or one by one)."""

    def __init__(self, folder: Path, *args: str) -> None:
        self.out = folder / f"out-{time.monotonic_ns()}"
        self.out.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", PYTHONUNBUFFERED="1")
        self.ranks: list[subprocess.Popen] = []
        for rank in (0, 1):
            with open(self.out / f"rank{rank}.log", "wb") as log:
                self.ranks.append(
                    subprocess.Popen(
                        [sys.executable, SCRIPT, str(self.out), str(folder / "ckpts"), *args],
                        cwd=folder,
                        env={**env, "LOCAL_RANK": str(rank)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        # A process group of their own, led by rank 0 (a new session would be
                        # one per process: a process cannot join a group in another session).
                        process_group=self.ranks[0].pid if rank else 0,
                    )
                )

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}:\n" + (self.out / f"rank{r}.log").read_text()[-3000:] for r in (0, 1))

    def wait_for(self, name: str, timeout: float, ranks: tuple[int, ...] = (0, 1)) -> dict:
        """The JSON a rank publishes as ``OUT/name``; fail if one of ``ranks`` exits first."""
        deadline = time.monotonic() + timeout
        while not (self.out / name).exists():
            for rank in ranks:
                assert self.ranks[rank].poll() is None, f"rank {rank} exited before {name}:\n{self.logs()}"
            assert time.monotonic() < deadline, f"no {name} within {timeout:.0f} s:\n{self.logs()}"
            time.sleep(0.02)
        return json.loads((self.out / name).read_text())

    def kill(self, rank: int) -> None:
        self.ranks[rank].send_signal(signal.SIGKILL)
        self.ranks[rank].wait(timeout=60)

    def kill_all(self) -> None:
        try:
            os.killpg(self.ranks[0].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for proc in self.ranks:  # the folder is judged once no rank can change it
            proc.wait(timeout=60)

    def finish(self, timeout: float) -> None:
        try:
            for proc in self.ranks:
                proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"the run did not finish within {timeout:.0f} s:\n{self.logs()}") from None
        assert [p.returncode for p in self.ranks] == [0, 0], self.logs()


Snapshot = dict[str, tuple[bytes, list[str]]]


def committed(ckpts: Path) -> Snapshot:
    """Name -> (manifest bytes, file names) of every checkpoint visible under its final name."""
    return {
        n: ((ckpts / n / "manifest.json").read_bytes(), sorted(os.listdir(ckpts / n)))
        for n in sorted(os.listdir(ckpts))
        if not n.startswith(".")
    }


def part_folders(ckpts: Path) -> list[str]:
    return sorted(n for n in os.listdir(ckpts) if n.startswith(".") and PART_MARKER in n)


def check_folder(ckpts: Path, before: Snapshot, nothing_new: bool) -> dict[str, fmt.Manifest]:
    """The invariants of the module docstring; ``before``: ``committed()`` just before the kill.

    Byte for byte: the same file names and manifest, and every file's size and digest checked
    against that manifest (``verify_checkpoint``)."""
    visible = sorted(n for n in os.listdir(ckpts) if not n.startswith("."))
    manifests = {}
    for name in visible:
        assert (ckpts / name / "manifest.json").is_file(), f"{name} is visible without a manifest: {visible}"
        manifests[name] = manifest = lc.verify_checkpoint(ckpts / name)  # every file's digest
        assert {record.rank for record in manifest.files.values()} == {0, 1}, f"{name}: not a 2-rank save"
        loaded = lc.load_checkpoint(ckpts / name)
        assert loaded["global_step"] == manifest.global_step
        assert {k: list(v.shape) for k, v in loaded["state_dict"].items()} == LAYERS, name
        assert name == "last.ckpt" or name == f"step={manifest.global_step}.ckpt", name
    for name, (manifest_bytes, files) in before.items():
        assert name in visible, f"{name}, committed before the kill, was lost: {visible}"
        if name == "last.ckpt" and not nothing_new:  # the killed save may have replaced it (whole)
            assert manifests[name].global_step >= _step(manifest_bytes)
            continue
        assert (ckpts / name / "manifest.json").read_bytes() == manifest_bytes, f"{name} changed"
        assert sorted(os.listdir(ckpts / name)) == files, f"{name} changed"
    if nothing_new:
        assert visible == sorted(before), f"a save that could not finish committed something: {visible}"
    return manifests


def _step(manifest_bytes: bytes) -> int:
    return json.loads(manifest_bytes)["global_step"]


def _kill_one_rank_mid_save(folder: Path, rank: int) -> dict:
    """Pause ``rank`` inside step 2's first save (after the first shard file of its part), kill it."""
    ckpts = folder / "ckpts"
    run = Launch(folder, "train", str(rank), "2")
    try:
        paused = run.wait_for(f"paused-rank{rank}.json", START_TIMEOUT)
        before = committed(ckpts)  # nothing commits from here on: a part can never be published
        assert sorted(before) == ["last.ckpt", "step=1.ckpt"], before
        assert all(_step(m) == 1 for m, _ in before.values())
        part = Path(paused["file"]).parent
        assert part.parent == ckpts and PART_MARKER in part.name and part.name.startswith("."), part
        assert not (part / f"rank-{rank:05d}.json").exists(), "the paused rank published its part"
        run.kill(rank)
        error = None
        if rank == 1:  # rank 0 outlives it: the save fails once `part_timeout` is up
            error = run.wait_for("error-rank0.json", PART_TIMEOUT + 120, ranks=(0,))
        else:  # rank 1 finishes its part (rank 0 never will) and is then stuck in a collective
            deadline = time.monotonic() + 120
            while not (part / "rank-00001.json").exists():
                assert time.monotonic() < deadline, f"rank 1 did not publish its part:\n{run.logs()}"
                time.sleep(0.02)
    finally:
        run.kill_all()
    return {"ckpts": ckpts, "before": before, "part": part, "error": error, "leftovers": part_folders(ckpts)}


def test_rank1_killed_mid_save(tmp_path):
    result = _kill_one_rank_mid_save(tmp_path, rank=1)
    error = result["error"]
    assert error["type"] == "CheckpointWriteError", error
    target = str(result["ckpts"] / "step=2.ckpt")
    assert f"ranks [1] did not finish their parts of {target!r}" in error["message"], error
    assert "Nothing was committed" in error["message"], error
    check_folder(result["ckpts"], result["before"], nothing_new=True)
    assert not result["part"].exists(), "the failed save left its temporary folder"
    assert result["leftovers"] == [], result["leftovers"]


@pytest.fixture(scope="module")
def rank0_killed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rank0_killed")
    yield _kill_one_rank_mid_save(folder, rank=0)
    shutil.rmtree(folder, ignore_errors=True)


def test_rank0_killed_mid_save(rank0_killed):
    result = rank0_killed
    check_folder(result["ckpts"], result["before"], nothing_new=True)
    # Rank 1's part is complete and published; without rank 0's manifest it is not a checkpoint.
    part = result["part"]
    assert (part / "rank-00001.json").exists() and not (part / "manifest.json").exists()
    assert part.name in result["leftovers"]


def test_whole_group_killed_mid_save(tmp_path):
    ckpts = tmp_path / "ckpts"
    rng = random.Random(3)
    run = Launch(tmp_path, "train")
    try:
        deadline = time.monotonic() + START_TIMEOUT
        # A save in progress after a committed step: its shared temporary folder exists.
        while not (ckpts.exists() and "last.ckpt" in os.listdir(ckpts) and part_folders(ckpts)):
            for proc in run.ranks:
                assert proc.poll() is None, f"a rank exited:\n{run.logs()}"
            assert time.monotonic() < deadline, f"no save within {START_TIMEOUT:.0f} s:\n{run.logs()}"
            time.sleep(0.01)
        before = committed(ckpts)
        # A random moment in the step's two saves (~0.5 s each): mid-write, mid-wait, mid-commit...
        time.sleep(rng.uniform(0.0, 1.2))
    finally:
        run.kill_all()
    manifests = check_folder(ckpts, before, nothing_new=False)
    print(
        f"\nkilled after step {_step(before['last.ckpt'][0])} was committed; left"
        f" {sorted(manifests)} and {len(part_folders(ckpts))} temporary folder(s)"
    )


def test_fresh_launch_cleans_up_and_resumes_from_last(rank0_killed, tmp_path):
    ckpts = rank0_killed["ckpts"]
    leftovers = part_folders(ckpts)
    assert leftovers, "the killed run left no temporary folders to clean"
    # Resume in the killed run's own folder: `last.ckpt` is replaced only by a run with the same
    # `dirpath` (another makes `last-v1.ckpt`). The folder is test_rank0_killed_mid_save's as well:
    # it is put back as the kill left it.
    aside = tmp_path / "as-killed"
    shutil.copytree(ckpts, aside, symlinks=True)
    try:
        run = Launch(ckpts.parent, "resume")
        run.finish(timeout=START_TIMEOUT)
        report = json.loads((run.out / "report.json").read_text())
        # Resumed from `last` (step 1) to exactly the saved state, then trained 2 steps.
        assert report["saved_step"] == report["restored_step"] == 1, report
        assert report["model_equal"] and report["optimizer_equal"], report
        assert report["global_step"] == 3, report
        # The killed run's temporary folders were there at rank 0's first save and gone after it.
        first, second = report["hidden_at_save"][:2]
        assert set(leftovers) <= set(first), report["hidden_at_save"]
        assert not set(leftovers) & set(second), report["hidden_at_save"]
        assert [n for n in os.listdir(ckpts) if n.startswith(".")] == []
        manifests = check_folder(ckpts, {"step=1.ckpt": rank0_killed["before"]["step=1.ckpt"]}, nothing_new=False)
        assert sorted(manifests) == ["last.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]
        assert manifests["last.ckpt"].global_step == 3
    finally:
        shutil.rmtree(ckpts)
        shutil.move(aside, ckpts)
