"""``bench --mode release``: what releasing host memory after a save costs, and what it gives back.

Two saves, each run in fresh processes forked from the bench's preloaded server (torch and
Lightning imported: the Python heap a full ``gc.collect()`` walks is a Lightning process's):

* ``sync_big_dict``: every save builds a dict of host copies of a fixed state held in many small
  tensors (``--tensor-kb``, below glibc's mmap threshold; as a GPU model's state taken to the
  host, or an EMA snapshot, would be), keeps a 1 KB object alive beside each copy (as a training
  process allocates during a save), and saves it with ``ShardedCheckpointIO`` synchronously. The
  copies are freed when the save returns and stay as free heap that glibc cannot give back from
  the top: releasing helps (RSS comes back down). (The first 1 KB objects fill older holes in the
  heap; at tiny sizes the first saves' copies can still join the top and go back by themselves.)
* ``async``: ``ShardedCheckpointIO(async_save=True)`` of a fixed state (weights + AdamW moments,
  ``workloads.build_checkpoint``), copied into the reused staging pool: the save leaves nothing
  behind, and releasing only costs.

Contenders are the release policies as ``ShardedModelCheckpoint`` runs them around each save
(``memory.MemoryReleaser``: ``before_save``, the save call, ``after_save``, ``start_pending``):
``never`` (release off), ``always`` (``gc.collect()`` + ``malloc_trim(0)`` on the training thread
after every save: the default before ``"auto"``) and ``auto`` (the default). Between saves the
state is updated in place; then the write and any background trim are waited for (untimed)
before RSS is read. Per save: the save call, the release on the training thread, the stall
(their sum, what ``ckpt/stall_s`` counts), RSS after, the freed heap the save left behind
(``memory.heap_left``), what a trim gave back. Saves 2..N are the steady state (the first
allocates the staging pool and the heap); medians over them, then over ``--repeats`` processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common.arguments import size_argument
from benchmarks.common.measure import run_grid
from lightning_ckpt.bench.files import DEFAULT_DIR, remove_path, run_directory
from lightning_ckpt.bench.measure import GB, MB, Metrics, Task, m, ratio
from lightning_ckpt.bench.report import (
    add_json_argument,
    emit_report,
    fmt,
    machine_info,
    report_header,
    stderr_logger,
)

SCENARIOS = ("sync_big_dict", "async")
POLICIES = ("never", "always", "auto")  # release off, the old default, the new default
DEFAULT_SIZE = "512MB"
DEFAULT_TENSOR_KB = 100


def _sync_big_dict(task: Task) -> tuple[Callable[[str], None], Callable[[], None], Any]:
    """(save(path), step(), the IO) of the ``sync_big_dict`` scenario."""
    import torch

    from lightning_ckpt import ShardedCheckpointIO

    elements = task["tensor_kb"] * 1000 // 4
    weights = [torch.randn(elements) for _ in range(max(1, task["size_bytes"] // (4 * elements)))]
    io = ShardedCheckpointIO()
    kept: list[bytearray] = []  # objects that outlive each save (malloc'd: above pymalloc's 512 B)

    def save(path: str) -> None:
        copies = {}
        for i, weight in enumerate(weights):
            copies[f"model.{i}.weight"] = weight.clone()
            kept.append(bytearray(1000))
        io.save_checkpoint({"state_dict": copies, "epoch": 0, "global_step": len(kept)}, path)

    def step() -> None:
        for weight in weights:
            weight.mul_(0.999)

    return save, step, io


def _async(task: Task) -> tuple[Callable[[str], None], Callable[[], None], Any]:
    """(save(path), step(), the IO) of the ``async`` scenario."""
    from lightning_ckpt import ShardedCheckpointIO
    from lightning_ckpt.bench.workloads import build_checkpoint, state_tensors

    checkpoint = build_checkpoint(task["size_bytes"])
    tensors, counters = state_tensors(checkpoint)
    io = ShardedCheckpointIO(async_save=True)

    def save(path: str) -> None:
        io.save_checkpoint(checkpoint, path)

    def step() -> None:
        for t in tensors:
            t.mul_(0.999)
        for counter in counters:
            counter.add_(1)

    return save, step, io


def _run_task(task: Task) -> Metrics:
    """One process: ``saves`` saves of ``scenario`` under the release ``policy``."""
    from lightning_ckpt.lightning.release import MemoryReleaser, memory_stats

    save, step, io = (_sync_big_dict if task["scenario"] == "sync_big_dict" else _async)(task)
    releaser = MemoryReleaser(task["policy"], threshold_mb=task["threshold_mb"])
    since = None
    per_save: list[Metrics] = []
    previous: str | None = None
    try:
        for index in range(task["saves"]):
            path = os.path.join(task["run_dir"], f"{task['tag']}-{index}.ckpt")
            for _ in range(task["steps"]):
                step()
            # As ShardedModelCheckpoint._save_checkpoint and its save step do:
            releaser.before_save()
            before = memory_stats()
            start = time.perf_counter()
            save(path)
            call = time.perf_counter() - start
            release = releaser.after_save(before, memory_stats(), since)
            releaser.start_pending()
            since = release.after
            # Untimed: the write and the trim finish before RSS is read and the old checkpoint goes.
            if hasattr(io, "wait"):
                io.wait()
            releaser.wait()
            trim = release.trim
            released = release.released if trim is None else trim.released
            per_save.append({
                "index": index + 1,
                "call_s": call,
                "release_s": release.seconds,
                "stall_s": call + release.seconds,
                "rss_before_mb": before.host_rss / MB,
                "rss_after_mb": memory_stats().host_rss / MB,
                "heap_left_mb": release.heap_left / MB,
                "released_mb": None if released is None else released / MB,
                "trimmed": not release.skipped,
                "background_trim_s": None if trim is None else trim.seconds,
                "reason": release.reason,
            })  # fmt: skip
            if previous is not None:
                remove_path(previous)
            previous = path
    finally:
        io.teardown()
    steady = per_save[1:] or per_save

    def median_of(key: str) -> float | None:
        values = [s[key] for s in steady if s[key] is not None]
        return statistics.median(values) if values else None

    metrics: Metrics = {key: median_of(key) for key in ("call_s", "release_s", "stall_s", "heap_left_mb", "released_mb")}
    metrics["stall_over_call"] = ratio(metrics["stall_s"], metrics["call_s"])
    metrics["rss_after_mb"] = steady[-1]["rss_after_mb"]
    metrics["rss_before_first_mb"] = per_save[0]["rss_before_mb"]
    metrics["trimmed_saves"] = sum(s["trimmed"] for s in steady)
    metrics["steady_saves"] = len(steady)
    return {"metrics": metrics, "per_save": per_save}


def render_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(
        title="memory release after saves (steady saves, medians; stall = save call + release on the training thread)"
    )
    columns = ("save", "release", "save call s", "release s", "stall s", "stall / call", "RSS after GB",
               "heap left MB", "released MB", "trimmed")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("save", "release") else "right", no_wrap=True)
    for scenario, policies in report["results"]["scenarios"].items():
        for policy, entry in policies.items():
            s = entry["summary"]
            if s is None:
                table.add_row(scenario, policy, "failed")
                continue
            rss = m(s, "rss_after_mb")
            table.add_row(
                scenario, policy, fmt(m(s, "call_s"), 3), fmt(m(s, "release_s"), 4), fmt(m(s, "stall_s"), 3),
                fmt(m(s, "stall_over_call")), fmt(None if rss is None else rss * MB / GB),
                fmt(m(s, "heap_left_mb"), 0), fmt(m(s, "released_mb"), 0),
                f"{int(m(s, 'trimmed_saves') or 0)}/{int(m(s, 'steady_saves') or 0)}",
            )  # fmt: skip
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks --mode release", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size", type=size_argument("--size"), default=DEFAULT_SIZE, help=f"state saved per save, both scenarios (default {DEFAULT_SIZE})"
    )
    parser.add_argument(
        "--tensor-kb", type=int, default=DEFAULT_TENSOR_KB,
        help=f"sync_big_dict: size of each host copy, KB (default {DEFAULT_TENSOR_KB}: below glibc's mmap threshold)",
    )  # fmt: skip
    parser.add_argument("--saves", type=int, default=5, help="saves per process (default 5; steady state = saves 2..N)")
    parser.add_argument("--steps", type=int, default=2, help="in-place state updates between saves (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per scenario and policy, medians reported (default 3)")
    parser.add_argument(
        "--threshold-mb", type=float, default=None,
        help="release_threshold_mb of the auto policy (default: ShardedModelCheckpoint's)",
    )  # fmt: skip
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"where checkpoints are written (default ./{DEFAULT_DIR})")
    add_json_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the release benchmark; print a table (and the JSON with ``--json``). Returns 0, 1 if a run failed."""
    from lightning_ckpt.lightning.release import DEFAULT_RELEASE_THRESHOLD_MB

    parser = build_parser()
    args = parser.parse_args(argv)
    size_bytes = args.size  # bytes (``size_argument``)
    for option in ("saves", "repeats", "tensor_kb"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    if args.steps < 0:
        parser.error("--steps must be >= 0")
    threshold_mb = DEFAULT_RELEASE_THRESHOLD_MB if args.threshold_mb is None else args.threshold_mb
    if threshold_mb < 0:
        parser.error("--threshold-mb must be >= 0")

    log = stderr_logger()
    directory = os.path.abspath(args.dir)
    started = time.time()
    with run_directory(directory) as run_dir:

        def task_of(scenario: str, policy: str, tag: str) -> Task:
            return {
                "kind": "release", "scenario": scenario, "policy": policy, "size_bytes": size_bytes,
                "tensor_kb": args.tensor_kb, "saves": args.saves, "steps": args.steps,
                "threshold_mb": threshold_mb, "run_dir": run_dir, "tag": tag,
            }  # fmt: skip

        def remove_leftovers(tag: str) -> None:
            for leftover in os.listdir(run_dir):
                if leftover.startswith(f"{tag}-"):
                    remove_path(os.path.join(run_dir, leftover))

        scenarios, errors = run_grid(
            args.repeats, list(args.scenarios), list(POLICIES), task_of, _run_task, log, remove_leftovers
        )

    def stall(scenario: str, policy: str) -> float | None:
        return m(scenarios[scenario][policy]["summary"], "stall_s")

    ratios = {
        scenario: {
            # The target: the default's stall within 1.5x of the save call alone.
            "auto_stall_over_call": ratio(stall(scenario, "auto"), m(scenarios[scenario]["auto"]["summary"], "call_s")),
            "auto_stall_over_never_stall": ratio(stall(scenario, "auto"), stall(scenario, "never")),
            "always_stall_over_never_stall": ratio(stall(scenario, "always"), stall(scenario, "never")),
        }
        for scenario in scenarios
    }
    report = {
        **report_header(argv, started),
        "settings": {
            "mode": "release",
            "size_bytes": size_bytes,
            "tensor_kb": args.tensor_kb,
            "saves": args.saves,
            "steps_between_saves": args.steps,
            "repeats": args.repeats,
            "scenarios": list(args.scenarios),
            "policies": list(POLICIES),
            "auto_threshold_mb": threshold_mb,
            "dir": directory,
            "units": "GB = 1e9 bytes, MB = 1e6 bytes; release_s is the training thread's part (a background"
            " trim is reported as background_trim_s per save)",
        },
        "machine": machine_info(directory),
        "results": {"scenarios": scenarios, "ratios": ratios, "errors": errors},
    }
    emit_report(render_table(report), report, args.json_path)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
