"""``python -m lightning_ckpt bench --mode async``: what a save costs a training loop,
``ShardedCheckpointIO`` (async and sync) against Lightning's ``AsyncCheckpointIO`` and ``TorchCheckpointIO``.

Each contender runs in a fresh process that trains on a model + AdamW state (on ``--device``): each
step runs fixed matmuls (about ``--compute-ms``) and updates every state tensor in place. After
``--warmup`` steps (the baseline) it saves ``--saves`` times, ``--every`` steps apart and never
before the previous save is durable. Per save: its *stall* (the step holding it minus the baseline
median step) and the time until durable; *steady*: saves 2..N. The research version (DCP, the
disk's floor, memory, ...) builds on this module: ``python -m benchmarks --mode async``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_ckpt.bench.files import DEFAULT_DIR, fsync_file, remove_path, run_directory
from lightning_ckpt.bench.measure import GB, Metrics, RssSampler, Task, m, median, ratio, run_in_fresh_process, summarize
from lightning_ckpt.bench.report import add_json_argument, emit_report, fmt, machine_info, report_header, stderr_logger
from lightning_ckpt.bench.workloads import MATMUL_SIZE, MATMUL_SIZE_CUDA, MatmulWorkload, StateUpdate, build_checkpoint
from lightning_ckpt.bench.workloads import calibrate_matmuls, state_bytes, state_tensors

CONTENDERS = ("torch_io", "async_io", "sharded_async", "sharded_sync")


def fsync_torch_io(on_durable: Callable[[str, float], None]) -> Any:
    """A ``TorchCheckpointIO`` whose save fsyncs the file, then calls ``on_durable(path, perf_counter())``."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class FsyncTorchCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            fsync_file(os.fspath(path))
            on_durable(os.fspath(path), time.perf_counter())

    return FsyncTorchCheckpointIO()


def sharded_durable(results: list[Any], started: dict[str, float]) -> list[tuple[str, float]]:
    """``(path, durable_at)`` of ``ShardedCheckpointIO``'s ``WriteResult``s (``last_save``, ``poll()``):
    the save call's start (``started``, popped: each save once) plus ``seconds``, from the call until
    committed and durable, as the writer process reports it."""
    return [(r.path, started.pop(r.path) + r.seconds) for r in results if r is not None and r.path in started]


def _checkpoint_io(name: str, run_dir: str, durable: dict[str, float]) -> Any:
    if name in ("sharded_async", "sharded_sync"):
        from lightning_ckpt import ShardedCheckpointIO

        return ShardedCheckpointIO(async_save=name == "sharded_async")
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

    # fsspec writes a tempfile.mkstemp() file and moves it into place: on the filesystem under test, a rename
    tempfile.tempdir = run_dir
    io = fsync_torch_io(durable.__setitem__)
    return io if name == "torch_io" else AsyncCheckpointIO(io)


def _loop(task: Task) -> Metrics:
    """One contender's training loop (in a measurement process)."""
    device, name = task["device"], task["contender"]
    checkpoint = build_checkpoint(task["size_bytes"], device)
    state, counters = state_tensors(checkpoint)
    workload = MatmulWorkload(task["matmul_size"], task["matmuls"], device)
    update = StateUpdate(state, torch.tensor(1e-3, device=device))

    @torch.no_grad()
    def step() -> float:
        start = time.perf_counter()
        workload()
        update.step()
        for counter in counters:
            counter.add_(1)
        if device == "cuda":
            torch.cuda.current_stream().synchronize()  # as a loop's loss.item() does
        return time.perf_counter() - start

    durable: dict[str, float] = {}  # path -> perf_counter when it was durable
    started: dict[str, float] = {}  # sharded_async: path -> perf_counter when its save call started
    io = _checkpoint_io(name, task["run_dir"], durable)
    saves: dict[str, dict[str, float]] = {}  # path -> its call's start, stall, call and durable seconds
    writing: list[float] = []  # the steps that started while a save was being written
    try:
        baseline = statistics.median([step() for _ in range(2 + task["warmup"])][2:])
        deadline, since = time.perf_counter() + task["timeout_s"], 0
        with RssSampler() as sampler:
            while True:
                if (error := getattr(io, "_error", None)) is not None:  # AsyncCheckpointIO's failed save: never durable
                    raise RuntimeError(f"AsyncCheckpointIO background save failed: {type(error).__name__}: {error}")
                if started:
                    durable.update(sharded_durable(io.poll(), started))  # never blocks
                for path in [p for p, s in saves.items() if "durable_seconds" not in s and p in durable]:
                    saves[path]["durable_seconds"] = durable[path] - saves[path]["call_start"]
                    for old in [p for p in saves if p != path]:
                        remove_path(old)  # only the latest durable checkpoint stays on disk
                busy = any("durable_seconds" not in s for s in saves.values())
                if len(saves) == task["saves"] and not busy:
                    break
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{len(saves)} saves after {task['timeout_s']} s (--timeout)")
                since += 1
                if busy or since < task["every"] or len(saves) == task["saves"]:
                    (writing if busy else []).append(step())
                    continue
                seconds, path = step(), os.path.join(task["run_dir"], f"{task['tag']}-{len(saves) + 1}")
                start = time.perf_counter()
                if name == "sharded_async":
                    started[path] = start
                # as ShardedModelCheckpoint saves ours: device copies may overlap the next forward and backward
                with io.overlapping() if name.startswith("sharded") else contextlib.nullcontext():
                    io.save_checkpoint(checkpoint, path)
                call = time.perf_counter() - start
                if name == "sharded_sync":
                    durable[path] = time.perf_counter()
                durable.update(sharded_durable([getattr(io, "last_save", None)], started))
                saves[path] = {"call_start": start, "call_seconds": call, "stall_seconds": seconds + call - baseline}
                since = 0
    finally:
        try:
            io.teardown()
        finally:
            for path in saves:
                remove_path(path)
    records = [{"index": i + 1, **{k: v for k, v in s.items() if k != "call_start"}} for i, s in enumerate(saves.values())]

    def steady(key: str) -> float | None:
        return median([record[key] for record in records[1:]])

    metrics = {
        "state_bytes": sum(t.numel() * t.element_size() for t in state + counters),
        "baseline_step_median_seconds": baseline,
        "saves": len(records),
        "stall_first_seconds": records[0]["stall_seconds"],
        "stall_steady_median_seconds": steady("stall_seconds"),
        "call_steady_median_seconds": steady("call_seconds"),
        "durable_first_seconds": records[0]["durable_seconds"],
        "durable_steady_median_seconds": steady("durable_seconds"),
        "steps_while_writing": len(writing),
        "step_while_writing_median_ratio": ratio(median(writing), baseline),
        "peak_rss_mb": sampler.metrics()["peak_rss_mb"],
    }
    return {"metrics": metrics, "per_save": records}


def run_contenders(args: argparse.Namespace, names: list[str], nbytes: int, task_of: Callable[..., Task], runner: Any) -> Any:
    """``runner(task_of(name, tag, run_dir))`` in a fresh process per contender and repeat: the runs
    by contender and the failures, or None (logged) if ``--dir`` has no room for 3x ``nbytes``."""
    runs: dict[str, list[Metrics]] = {name: [] for name in names}
    errors: list[str] = []
    log = stderr_logger()
    with run_directory(os.path.abspath(args.dir)) as run_dir:
        if (free := shutil.disk_usage(run_dir).free) < 3.3 * nbytes:  # the latest durable, one being written, slack
            log(f"--dir {args.dir!r} has {free / GB:.1f} GB free; this size needs ~{3.3 * nbytes / GB:.1f} GB.")
            return None
        for r in range(args.repeats):
            for name in names:
                log(f"[{r + 1}/{args.repeats}] {name}")
                try:
                    runs[name].append(run_in_fresh_process(task_of(name, f"r{r}-{name}", run_dir), runner))
                except RuntimeError as err:
                    errors.append(f"{name} repeat {r + 1}: {err}")
                    log(f"[{r + 1}/{args.repeats}] {name} FAILED: {str(err).splitlines()[0]}")
                finally:  # a failed run's checkpoints
                    for leftover in os.listdir(run_dir):
                        if leftover.startswith(f"r{r}-{name}-"):
                            remove_path(os.path.join(run_dir, leftover))
    return runs, errors


def add_options(parser: argparse.ArgumentParser, contenders: tuple[str, ...], size: str) -> None:
    """The options of this mode and of ``benchmarks/``' ``--mode async`` (its ``contenders``, ``size``)."""
    add = parser.add_argument
    add("--size", default=size, help=f"state size: weights + AdamW moments (default {size})")
    add("--repeats", type=int, default=3, help="runs per contender, medians reported (default 3)")
    add("--saves", type=int, default=5, help="saves per run (default 5; steady state = saves 2..N)")
    add("--every", type=int, default=4, help="steps between saves (default 4)")
    add("--warmup", type=int, default=10, help="timed steps without saving: the baseline (default 10)")
    add("--compute-ms", type=float, default=75.0, help="per-step compute workload, calibrated here once (default 75)")
    add("--device", choices=("cpu", "cuda"), default="cpu", help="where the state and the step's compute live (default cpu)")
    add("--contenders", default=",".join(contenders), help=f"comma list, a subset of {','.join(contenders)} (default: all)")
    add("--dir", default=DEFAULT_DIR, help=f"where to write, on the filesystem under test (default ./{DEFAULT_DIR})")
    add_json_argument(parser)
    add("--timeout", type=float, default=1800.0, help="limit per training-loop run, seconds (default 1800)")


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace, contenders: tuple[str, ...]) -> tuple[int, list[str]]:
    """The state size in bytes and the contenders asked for, in ``contenders``' order (a bad option: a usage error)."""
    from lightning_ckpt.format.plan import parse_size

    try:
        size_bytes = parse_size(args.size, "--size")
    except ValueError as err:
        parser.error(str(err))
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    if unknown := [n for n in names if n not in contenders]:
        parser.error(f"--contenders: unknown {unknown} (choose from {', '.join(contenders)})")
    if not names:
        parser.error("--contenders is empty")
    for option in ("repeats", "saves", "every", "warmup"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    return size_bytes, [n for n in contenders if n in names]


def render_table(results: Metrics, settings: Metrics) -> Any:
    from rich.table import Table

    table = Table(
        title=f"lightning_ckpt async benchmark: a training loop on {settings['device']}, state {results['state_bytes'] / GB:.3g}"
        f" GB, {settings['saves']} saves every {settings['every']} steps, medians of {settings['repeats']}",
        caption="stall = the step holding the save - the baseline median step; durable = save call -> bytes durable;"
        " writing = the steps run while a save was written, x the baseline median",
    )
    columns = {"stall 1st s": "stall_first_seconds", "stall steady s": "stall_steady_median_seconds", "x torch_io": None,
               "durable s": "durable_steady_median_seconds", "writing x": "step_while_writing_median_ratio",
               "peak ΔRSS MB": "peak_rss_mb"}  # fmt: skip  (x torch_io: ratios["stall_steady_vs_torch_io"])
    for column in ("contender", *columns):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for name, entry in results["contenders"].items():
        values = [m(entry["summary"], key) if key else results["ratios"]["stall_steady_vs_torch_io"][name] for key in columns.values()]
        table.add_row(name, *[fmt(v, 0 if "MB" in c else 2 if c == "writing x" else 3) for c, v in zip(columns, values)])
    return table


def main(argv: list[str] | None = None) -> int:
    """Run ``--mode async``: a table (and the JSON with ``--json``). 0, 1 if a measurement failed, 2 without room."""
    parser = argparse.ArgumentParser(
        prog="lightning_ckpt bench --mode async",
        description="What a save costs a training loop: the stall per save and the time until durable.",
        epilog="With DCP's async_save, the disk's floor and more: `python -m benchmarks --mode async` in a checkout.",
    )
    add_options(parser, CONTENDERS, "1GB")
    args = parser.parse_args(argv)
    size_bytes, names = check_options(parser, args, CONTENDERS)
    (nbytes, n_tensors), started = state_bytes(size_bytes), time.time()
    matmul_size = MATMUL_SIZE_CUDA if args.device == "cuda" else MATMUL_SIZE
    matmuls, one_ms = calibrate_matmuls(args.compute_ms, matmul_size, args.device)
    machine = machine_info(os.path.abspath(args.dir), cuda=args.device == "cuda")
    options = {key: getattr(args, key) for key in ("device", "size", "repeats", "saves", "every", "warmup", "compute_ms")}
    task = {"kind": "async_loop", "size_bytes": size_bytes, "matmuls": matmuls, "matmul_size": matmul_size, "timeout_s": args.timeout}
    done = run_contenders(args, names, nbytes, lambda name, tag, run_dir: {**task, **options, "contender": name, "tag": tag, "run_dir": run_dir}, _loop)
    if done is None:
        return 2
    contenders = {name: {"summary": summarize([run["metrics"] for run in runs]), "runs": runs} for name, runs in done[0].items()}

    def versus(reference: str, key: str) -> dict[str, float | None]:
        base = m(contenders[reference]["summary"], key) if reference in contenders else None
        return {name: ratio(m(entry["summary"], key), base) for name, entry in contenders.items()}

    ratios = {
        "stall_steady_vs_torch_io": versus("torch_io", "stall_steady_median_seconds"),
        "stall_steady_vs_async_io": versus("async_io", "stall_steady_median_seconds"),
        "durable_steady_vs_async_io": versus("async_io", "durable_steady_median_seconds"),
    }
    results = {"size": args.size, "size_bytes": size_bytes, "state_bytes": nbytes, "state_tensors": n_tensors}
    results.update(contenders=contenders, ratios=ratios, errors=done[1])
    compute = {"matmuls_per_step": matmuls, "matmul_size": matmul_size, "one_matmul_ms": one_ms}
    settings = {"mode": "async", **options, "contenders": names, "dir": os.path.abspath(args.dir), "compute": compute}
    report = {**report_header(argv, started), "settings": settings, "machine": machine, "results": results}
    emit_report(render_table(results, settings), report, args.json_path)
    return 1 if done[1] else 0
