"""``python -m benchmarks --mode save``: ShardedCheckpointIO against Lightning's TorchCheckpointIO and
a plain sequential write, the disk's floor.

The package's ``python -m lightning_ckpt bench --mode save`` (``lightning_ckpt.bench.save``, whose saves
and options it takes) with the loads and the floor beside its contenders. Each measurement runs in a fresh subprocess
(``measure.run_in_fresh_process``), so RSS figures start clean: the child builds a model + AdamW
checkpoint dict, records its baseline RSS, then times the operation while a thread samples
``VmRSS`` and ``RssAnon`` every 20 ms (and the exact VmHWM peak). Contenders, per state size:

* ``plain_write``: the same number of bytes written sequentially and fsynced, buffered (64 MB
  writes) and ``O_DIRECT`` (16 MB writes from a page-aligned buffer); the faster is the yardstick
  (``vs_plain`` of each save).
* ``torch_io``: ``TorchCheckpointIO().save_checkpoint`` plus an fsync of the file (durable, as ours).
* ``sharded_io``: ``ShardedCheckpointIO().save_checkpoint`` twice in one child (first and steady).
* loads of both: ``load_checkpoint`` with the page cache dropped, then every tensor copied into
  preallocated parameters and optimizer state (what ``load_state_dict`` costs).

Medians over ``--repeats`` (each repeat a fresh child per measurement, the plain writes first) go
to a rich table; the full JSON only with ``--json PATH`` (a file) or ``--json`` / ``--json -``
(stdout, table on stderr)::

    python -m benchmarks --mode save --sizes 0.5GB,3GB --repeats 3 --json bench-results/bench.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

from benchmarks.common.plain_writer import ALIGN, BUFFERED_CHUNK, aligned, direct_buffer, write_and_fsync
from benchmarks.common.workloads import Restored
from lightning_ckpt.bench import save as lean
from lightning_ckpt.bench.files import drop_page_cache, remove_path
from lightning_ckpt.bench.measure import Metrics, Task, m, measure, ratio

PLAIN = ("plain_buffered", "plain_direct")


# ----------------------------------------------------------------------------------------------
# Child side: the plain writes and the loads (the saves are lean.run_task's)


def _plain_buffered(path: str, nbytes: int) -> Metrics:
    buffer = memoryview(os.urandom(min(BUFFERED_CHUNK, nbytes)))  # preallocated, reused

    def write() -> None:
        write_and_fsync(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, buffer, nbytes)

    return {**measure(write), "bytes_written": nbytes}


def _plain_direct(path: str, nbytes: int) -> Metrics:
    if not hasattr(os, "O_DIRECT"):
        raise OSError("O_DIRECT is not available on this platform")
    total = aligned(nbytes)
    buffer = direct_buffer(total)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            left = total
            while left:
                n = os.write(fd, buffer[: min(left, len(buffer))])
                if n % ALIGN:
                    raise OSError(f"short O_DIRECT write of {n} bytes")
                left -= n
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        result = measure(write)
    finally:
        buffer.release()  # the only reference to its mapping: unmapped here
    return {**result, "bytes_written": total}


def _load(task: Task) -> Metrics:
    """Load into preallocated model and optimizer tensors, as a resumed training process does."""
    restored = Restored.zeros(task["size_bytes"])
    if task["kind"] == "torch_io_load":
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        io: Any = TorchCheckpointIO()
    else:
        io = lean.sharded_io(task)
    drop_page_cache(task["path"])
    phases: dict[str, float] = {}

    def load() -> dict[str, Any]:
        start = time.perf_counter()
        checkpoint = io.load_checkpoint(task["path"])
        phases["load_checkpoint_seconds"] = time.perf_counter() - start
        phases["tensors_copied"] = restored.copy_from(checkpoint)
        return checkpoint

    result = measure(load)
    if phases["tensors_copied"] != restored.tensors:
        raise RuntimeError(f"copied {phases['tensors_copied']} tensors, expected {restored.tensors}")
    return {**result, **phases}


def _run_task(task: Task) -> Any:
    """Runner of ``run_in_fresh_process`` for this mode's measurements."""
    if task["kind"] in ("torch_io_load", "sharded_io_load"):
        return _load(task)
    if task["kind"] not in PLAIN:
        return lean.run_task(task)
    try:
        write = _plain_buffered if task["kind"] == "plain_buffered" else _plain_direct
        return write(task["path"], task["nbytes"])
    finally:  # the plain bytes are never read back
        remove_path(task["path"])


# ----------------------------------------------------------------------------------------------
# Parent side


def bench_size(label: str, size_bytes: int, repeats: int, run_dir: str, max_shard_size: str | None, log: Any) -> Metrics:
    """All contenders at one state size, the plain writes first in every repeat, each save's load
    right after it; every measurement in a fresh process."""
    size = lean.SizeRuns(label, size_bytes, repeats, log, _run_task)
    notes: list[str] = []  # a failed O_DIRECT write (tmpfs refuses O_DIRECT) is a note, not an error

    def load(r: int, contender: str, path: str, common: Task) -> None:
        if (out := size.attempt(r, f"{contender}_load", {**common, "kind": f"{contender}_load", "path": path})) is not None:
            size.add(f"{contender}_load", out)

    for r in range(repeats):
        for kind in PLAIN:
            path = os.path.join(run_dir, f"{label.replace('/', '_')}-r{r}-{kind}.bin")
            try:
                task = {"kind": kind, "path": path, "nbytes": size.nbytes}
                if (out := size.attempt(r, kind, task, notes if kind == "plain_direct" else None)) is not None:
                    size.add(kind, out)
            finally:
                remove_path(path)
        lean.measure_repeat(size, r, run_dir, max_shard_size, then=load)

    result = lean.result_of(size)
    torch_load, ours_load = size.summary("torch_io_load"), size.summary("sharded_io_load")
    result["torch_io"]["load"], result["sharded_io"]["load"] = torch_load, ours_load
    result["ratios_ours_over_torch_io"].update(
        load_seconds=ratio(m(ours_load, "seconds"), m(torch_load, "seconds")),
        load_peak_rss=ratio(m(ours_load, "peak_rss_mb"), m(torch_load, "peak_rss_mb")),
        load_peak_rss_anon=ratio(m(ours_load, "peak_rss_anon_mb"), m(torch_load, "peak_rss_anon_mb")),
    )
    buffered, direct = size.summary("plain_buffered"), size.summary("plain_direct")
    plain = [g for g in (m(buffered, "GBps"), m(direct, "GBps")) if g]
    best_plain = max(plain) if plain else None
    for op in (result["torch_io"]["save"], result["sharded_io"]["save_first"], result["sharded_io"]["save_steady"]):
        if op and best_plain:
            values = [v / best_plain for v in op["GBps"]["values"]]
            op["vs_plain"] = {"median": statistics.median(values), "values": values}
    return {**result, "plain_write": {"buffered": buffered, "direct": direct, "best_plain_GBps": best_plain}, "notes": notes}


def _rows(res: Metrics) -> list[lean.Row]:
    plain, ratios = res["plain_write"], res["ratios_ours_over_torch_io"]
    return [
        ("plain_write buffered", plain["buffered"], ()),
        ("plain_write O_DIRECT", plain["direct"], ()),
        *lean.save_rows(res),
        ("torch_io load", res["torch_io"]["load"], ()),
        ("sharded_io load", res["sharded_io"]["load"], (ratios["load_seconds"], ratios["load_peak_rss"], ratios["load_peak_rss_anon"])),
    ]


render_table = functools.partial(lean.render_table, rows=_rows, columns=("s", "GB/s", "x plain"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks --mode save",
        description="Benchmark ShardedCheckpointIO against TorchCheckpointIO and a plain sequential write.",
    )
    lean.add_options(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``--mode save``; print a table (and the JSON with ``--json``). Returns 0, 1 if any
    measurement failed, 2 without room on ``--dir``."""
    return lean.run(build_parser(), argv, bench_size, render_table)
