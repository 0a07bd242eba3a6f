"""``python -m lightning_ckpt bench [--mode save]``: a durable save of a model + AdamW checkpoint,
``ShardedCheckpointIO`` against Lightning's ``TorchCheckpointIO``: time and peak extra RSS.

Per state size and repeat, each in a fresh process that builds ``workloads.build_checkpoint``:
``torch_io``, ``TorchCheckpointIO().save_checkpoint`` and an fsync of the file (durable, as ours);
``sharded_io``, two ``ShardedCheckpointIO().save_checkpoint`` (the first allocates its buffers).
The research version, with loads and the disk's plain-write floor, builds on this module:
``python -m benchmarks --mode save`` in a checkout of the repository.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from lightning_ckpt.bench import add_mode_argument
from lightning_ckpt.bench.files import DEFAULT_DIR, drop_page_cache, fsync_file, remove_path, run_directory
from lightning_ckpt.bench.measure import GB, Metrics, Task, m, measure, ratio, run_in_fresh_process, summarize
from lightning_ckpt.bench.report import add_json_argument, emit_report, fmt, machine_info, report_header, stderr_logger
from lightning_ckpt.bench.workloads import build_checkpoint, state_bytes

DEFAULT_SIZES = "0.5GB,3GB"
Row = tuple[str, Metrics | None, tuple[float | None, ...]]  # a contender, its summary, its ratios to torch_io


def sharded_io(task: Task) -> Any:
    """The ``ShardedCheckpointIO`` of ``task`` (its ``max_shard_size``, if any)."""
    from lightning_ckpt import ShardedCheckpointIO

    return ShardedCheckpointIO(**({} if task.get("max_shard_size") is None else {"max_shard_size": task["max_shard_size"]}))


def run_task(task: Task) -> Any:
    """Runner of :func:`run_in_fresh_process`: ``torch_io_save`` (``task["path"]``) or
    ``sharded_io_save`` (two saves, to ``task["paths"]``; the first is removed)."""
    checkpoint = build_checkpoint(task["size_bytes"])
    if task["kind"] == "torch_io_save":
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        io, path = TorchCheckpointIO(), task["path"]
        # fsspec writes a tempfile.mkstemp() file and moves it into place: on the filesystem under test, a rename
        tempfile.tempdir = os.path.dirname(os.path.abspath(path))
        result = measure(lambda: (io.save_checkpoint(checkpoint, path), fsync_file(path)))
        drop_page_cache(path)  # leave the cache as the sharded writer does
        return {**result, "bytes_written": os.path.getsize(path)}
    io, results = sharded_io(task), {}
    try:
        for key, path in zip(("first", "steady"), task["paths"]):
            results[key] = measure(lambda path=path: io.save_checkpoint(checkpoint, path))
            saved = io.last_save
            results[key].update(bytes_written=saved.nbytes, files=saved.files, direct_io=saved.direct_io)
            if key == "first":
                remove_path(path)  # keep the disk footprint at one checkpoint
    finally:
        io.teardown()
    return results


class SizeRuns:
    """The runs of one state size, by measurement; one that fails is recorded and the benchmark goes on."""

    def __init__(self, label: str, size_bytes: int, repeats: int, log: Callable[[str], None], runner: Any) -> None:
        self.label, self.size_bytes, self.repeats, self.log, self.runner = label, size_bytes, repeats, log, runner
        self.nbytes, self.tensors = state_bytes(size_bytes)
        self.runs: dict[str, list[Metrics]] = {}
        self.errors: list[str] = []

    def attempt(self, r: int, key: str, task: Task, failures: list[str] | None = None) -> Any:
        """The child's result, or None after recording its error (in ``failures``, default ``errors``)."""
        self.log(f"[{self.label} {r + 1}/{self.repeats}] {key}")
        try:
            return run_in_fresh_process(task, self.runner)
        except RuntimeError as err:
            (self.errors if failures is None else failures).append(f"repeat {r + 1}: {err}")
            self.log(f"[{self.label} {r + 1}/{self.repeats}] {key} FAILED: {str(err).splitlines()[0]}")
            return None

    def add(self, key: str, out: Metrics) -> None:
        self.runs.setdefault(key, []).append({**out, "GBps": self.nbytes / out["seconds"] / GB})

    def summary(self, key: str) -> Metrics | None:
        return summarize(self.runs.get(key, []))


def measure_repeat(size: SizeRuns, r: int, run_dir: str, max_shard_size: str | None, then: Any = None) -> None:
    """Repeat ``r``: ``TorchCheckpointIO``'s save, then ours; ``then(r, "torch_io" | "sharded_io",
    path, task)`` follows each save that succeeded, before its files are removed."""
    tag = f"{size.label.replace('/', '_')}-r{r}"
    common = {"size_bytes": size.size_bytes, "max_shard_size": max_shard_size}
    paths = [os.path.join(run_dir, f"{tag}-torch.ckpt"), *(os.path.join(run_dir, f"{tag}-sharded-{i}") for i in (1, 2))]
    try:
        if (out := size.attempt(r, "torch_io_save", {**common, "kind": "torch_io_save", "path": paths[0]})) is not None:
            size.add("torch_io_save", out)
            if then:
                then(r, "torch_io", paths[0], common)
        remove_path(paths[0])
        if (out := size.attempt(r, "sharded_io_save", {**common, "kind": "sharded_io_save", "paths": paths[1:]})) is not None:
            size.add("sharded_io_save_first", out["first"])
            size.add("sharded_io_save_steady", out["steady"])
            if then:
                then(r, "sharded_io", paths[2], common)
    finally:
        for path in paths:
            remove_path(path)


def result_of(size: SizeRuns) -> Metrics:
    """The summaries of ``size``'s saves and ours / ``TorchCheckpointIO``'s ratios."""
    torch_save, first, steady = map(size.summary, ("torch_io_save", "sharded_io_save_first", "sharded_io_save_steady"))
    ratios = {
        f"save_{key}{suffix}": ratio(m(ours, metric), m(torch_save, metric))
        for key, metric in (("seconds", "seconds"), ("peak_rss", "peak_rss_mb"))
        for suffix, ours in (("", steady), ("_first", first))
    }
    return {
        "size": size.label,
        "size_bytes": size.size_bytes,
        "state_bytes": size.nbytes,
        "state_tensors": size.tensors,
        "torch_io": {"save": torch_save},
        "sharded_io": {"save_first": first, "save_steady": steady},
        "ratios_ours_over_torch_io": ratios,
        "errors": size.errors,
    }


def bench_size(label: str, size_bytes: int, repeats: int, run_dir: str, max_shard_size: str | None, log: Any) -> Metrics:
    size = SizeRuns(label, size_bytes, repeats, log, run_task)
    for r in range(repeats):
        measure_repeat(size, r, run_dir, max_shard_size)
    return result_of(size)


def save_rows(res: Metrics) -> list[Row]:
    ratios, ours = res["ratios_ours_over_torch_io"], res["sharded_io"]
    return [
        ("torch_io save", res["torch_io"]["save"], ()),
        ("sharded_io save (1st)", ours["save_first"], (ratios["save_seconds_first"], ratios["save_peak_rss_first"])),
        ("sharded_io save", ours["save_steady"], (ratios["save_seconds"], ratios["save_peak_rss"])),
    ]


def render_table(results: list[Metrics], rows: Any = save_rows, columns: tuple[str, ...] = ("s", "GB/s")) -> Any:
    """A row per contender and size: ``columns`` (of ``s``, ``GB/s``, ``x plain``), the RSS, and as
    many ratio columns (ours / torch_io) as the longest row has."""
    from rich.table import Table

    table = Table(title="lightning_ckpt benchmark (medians; RSS = peak minus baseline)")
    keys = {"s": "seconds", "GB/s": "GBps", "x plain": "vs_plain", "ΔRSS MB": "peak_rss_mb", "ΔRssAnon MB": "peak_rss_anon_mb"}
    columns = (*columns, "ΔRSS MB", "ΔRssAnon MB")
    width = max(len(row[2]) for res in results for row in rows(res))
    for column in ("size", "contender", *columns):
        table.add_column(column, justify="left" if column in ("size", "contender") else "right")
    for column in ("ours/torch s", "ours/torch ΔRSS", "ours/torch ΔAnon")[:width]:
        table.add_column(column, justify="right", style="bold")
    for res in results:
        for i, (name, op, ratios) in enumerate(rows(res)):
            cells = [fmt(m(op, keys[c]), 3 if c == "s" else 0 if "MB" in c else 2) for c in columns] if op else ["error"]
            cells += ["-"] * (len(columns) - len(cells)) + [fmt(v) for v in ratios] + ["-"] * (width - len(ratios))
            table.add_row(f"{res['size']} ({res['state_bytes'] / GB:.3g} GB)" if i == 0 else "", name, *cells)
        table.add_section()
    return table


def _parse_sizes(text: str) -> list[tuple[str, int]]:
    from lightning_ckpt.format.plan import parse_size

    sizes = [(item.strip(), parse_size(item.strip(), "--sizes")) for item in text.split(",") if item.strip()]
    if not sizes:
        raise ValueError("`--sizes` is empty; give e.g. '0.5GB,3GB'.")
    return sizes


def add_options(parser: argparse.ArgumentParser) -> None:
    """This mode's options (``benchmarks/``' ``--mode save`` takes the same)."""
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list of state sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement, medians reported (default 3)")
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"where to write, on the filesystem under test (default ./{DEFAULT_DIR})")
    add_json_argument(parser)
    parser.add_argument("--max-shard-size", default=None, help="ShardedCheckpointIO max_shard_size (default: the plugin's)")


def run(parser: argparse.ArgumentParser, argv: list[str] | None, bench_size: Callable[..., Metrics], table: Any) -> int:
    """Parse ``argv`` (``parser`` has :func:`add_options`), run ``bench_size`` for every size, print
    the ``table`` (and the JSON with ``--json``). Returns 0, 1 if a measurement failed, 2 without room."""
    from lightning_ckpt.format.plan import parse_size
    from lightning_ckpt.lightning.plugin import DEFAULT_MAX_SHARD_SIZE

    args = parser.parse_args(argv)
    try:
        sizes = _parse_sizes(args.sizes)
        if args.max_shard_size is not None:
            parse_size(args.max_shard_size, "--max-shard-size")
    except ValueError as err:
        parser.error(str(err))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    directory, log, started = os.path.abspath(args.dir), stderr_logger(), time.time()
    machine = machine_info(directory)
    with run_directory(directory) as run_dir:
        need = max(2 * state_bytes(size_bytes)[0] for _, size_bytes in sizes)
        if (free := shutil.disk_usage(run_dir).free) < need * 1.1:
            log(f"--dir {directory!r} has {free / GB:.1f} GB free; the largest size needs ~{need / GB:.1f} GB.")
            return 2
        results = [bench_size(label, nbytes, args.repeats, run_dir, args.max_shard_size, log) for label, nbytes in sizes]
    settings = {
        "sizes": [label for label, _ in sizes],
        "repeats": args.repeats,
        "dir": directory,
        "max_shard_size": args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        "units": "GB = 1e9 bytes, MB = 1e6 bytes; RSS figures are peak minus the pre-operation baseline",
        "torch_io_tempdir": "--dir (fsspec's temporary file is kept on the filesystem under test)",
    }
    report = {**report_header(argv, started), "settings": settings, "machine": machine, "results": results}
    emit_report(table(results), report, args.json_path)
    return 1 if any(res["errors"] for res in results) else 0


def main(argv: list[str] | None = None) -> int:
    """Run ``--mode save``; ``argv`` may hold ``--mode save`` (``lightning_ckpt.bench.main`` hands it on)."""
    parser = argparse.ArgumentParser(
        prog="lightning_ckpt bench",
        description="Benchmark ShardedCheckpointIO's durable save against Lightning's TorchCheckpointIO.",
        epilog="Every other mode has its own options: `--mode MODE --help`. With loads and the disk's plain-write"
        " floor: `python -m benchmarks --mode save` in a checkout of the repository.",
    )
    add_mode_argument(parser)
    add_options(parser)
    return run(parser, argv, bench_size, render_table)
