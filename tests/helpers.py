"""Helpers shared by test modules: assertions, processes, scripts, corrupted files."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator


def assert_positive_medians(summary: dict, *keys: str, runs: int = 1) -> None:
    """Each ``summary[key]`` is ``{"median": float > 0, "values": [...]}`` with ``runs`` values."""
    for key in keys:
        median = summary[key]["median"]
        assert isinstance(median, float) and math.isfinite(median) and median > 0, (key, summary[key])
        assert len(summary[key]["values"]) == runs


def process_alive(pid: int) -> bool:
    """Is ``pid`` running (a zombie counts as gone)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_until_gone(pid: int, timeout: float) -> bool:
    """Poll until ``pid`` is gone; False if it is still running after ``timeout`` seconds.

    A process that was told to exit (or killed) takes a scheduler-dependent time to go: on a loaded
    machine far longer than any fixed sleep. Poll with a generous deadline instead of sleeping.
    """
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_script(script: str, *args: str, tmp_path) -> dict:
    """Run ``tests/<script> <tmp_path>/report.json *args`` in ``tmp_path`` as a fresh launch (no
    ``LOCAL_RANK``: Lightning's launcher starts the other ranks); fail with the tail of its output if
    it exits non-zero, else return the JSON report it wrote."""
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), script), str(report), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(report.read_text())


def flip_byte(file: str | os.PathLike, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset`` of ``file``."""
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def close_process_group() -> None:
    """End a multi-rank test script: every rank meets, tears its process groups down, then frees
    what still holds them, so that no group's threads outlive this call.

    ``destroy_process_group()`` unregisters every group, but a gloo backend (its worker threads,
    its TCP loop, rank 0's store daemon) lives until the last reference to its group goes: FSDP (1)
    modules, their ``FlatParamHandle`` and DDP keep ``process_group`` inside the Trainer's reference
    cycles. Left to the collection inside interpreter finalization, a worker still releasing a
    finished work (the barrier's, which holds the previous collective's tensors) takes the GIL to
    drop their Python objects; Python ends such a thread during finalization (``pthread_exit``),
    and the forced unwind through torch's ``noexcept`` frames calls ``std::terminate``: "terminate
    called without an active exception", exit code -6, rarely and under load. Collecting here
    destroys the backend, which joins its workers while the interpreter is whole. Groups torch
    itself keeps alive (FSDP2's device meshes, referenced from its DTensor specs) stay.
    """
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()


@contextlib.contextmanager
def one_rank_group(folder) -> Iterator[None]:
    """A real one-rank gloo process group (file store in ``folder``) for the duration."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
    try:
        yield
    finally:
        close_process_group()


def sharded_tensor(full, parts: int):
    """``full`` as a ShardedTensor whose ``parts`` row blocks are all local to this one rank (as
    FSDP1 hands them out): saved, each block is its own piece. Needs a process group."""
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardMetadata,
        init_from_local_shards,
    )

    rows = full.shape[0] // parts
    shards = [
        Shard(full[i * rows : (i + 1) * rows].clone(), ShardMetadata([i * rows] + [0] * (full.dim() - 1), [rows, *full.shape[1:]], f"rank:0/{full.device}"))
        for i in range(parts)
    ]
    return init_from_local_shards(shards, list(full.shape))


def save_sharded_weight(path, full, parts: int) -> None:
    """Save ``{"state_dict": {"w": full}}`` as a one-rank sharded save of ``parts`` pieces."""
    import lightning_ckpt as lc

    with one_rank_group(os.path.dirname(path)):
        io = lc.ShardedCheckpointIO()
        try:
            io.save_sharded({"state_dict": {"w": sharded_tensor(full, parts)}}, path, 0, 1, lambda token: token)
        finally:
            io.teardown()


def disk_usage(folder: str | os.PathLike) -> int:
    """Bytes of every file under ``folder``, each inode counted once (hard links share one)."""
    seen, total = set(), 0
    for root, _, names in os.walk(folder):
        for name in names:
            st = os.stat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def each_alone(folder: str | os.PathLike, names: list[str]) -> Iterator[tuple[str, str]]:
    """For each checkpoint of ``names`` in ``folder``: (its name, its path in a hard-linked copy of
    ``folder`` from which every other checkpoint was deleted). The copy is removed afterwards;
    ``folder`` itself is left as it is."""
    alone = f"{os.fspath(folder).rstrip(os.sep)}-alone"
    for keep in names:
        shutil.copytree(folder, alone, copy_function=os.link, symlinks=True)
        try:
            for other in names:
                if other != keep:
                    shutil.rmtree(os.path.join(alone, other))
            yield keep, os.path.join(alone, keep)
        finally:
            shutil.rmtree(alone)
