"""Benchmark: ShardedCheckpointIO against Lightning's TorchCheckpointIO and a plain sequential write.

Each measurement runs in a fresh subprocess (``measure.run_in_fresh_process``), so RSS figures start clean: the child builds
a model + AdamW checkpoint dict, records its baseline RSS, then times the operation while a thread
samples ``VmRSS`` and ``RssAnon`` every 20 ms (and the exact VmHWM peak). Contenders, per state size:

* ``plain_write``: the same number of bytes written sequentially and fsynced, buffered (64 MB
  writes) and ``O_DIRECT`` (16 MB writes from a page-aligned buffer); the faster is the yardstick.
* ``torch_io``: ``TorchCheckpointIO().save_checkpoint`` plus an fsync of the file (durable, as ours).
* ``sharded_io``: ``ShardedCheckpointIO().save_checkpoint`` twice in one child (first and steady).
* loads of both: ``load_checkpoint`` with the page cache dropped, then every tensor copied into
  preallocated parameters and optimizer state (what ``load_state_dict`` costs).

Medians over ``--repeats`` (each repeat a fresh child per measurement) go to a rich table; the
full JSON only with ``--json PATH`` (a file) or ``--json`` / ``--json -`` (stdout, table on stderr)::

    python -m lightning_ckpt bench --sizes 0.5GB,3GB --repeats 3 --json bench-results/bench.json

``--mode async`` lives in ``async_loop``; the research modes (``train``, ``distributed``, ...) in the
repository's ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any


from lightning_ckpt.bench import add_mode_argument
from lightning_ckpt.bench._plain_writer import (
    ALIGN,
    aligned,
    direct_buffer,
    write_and_fsync,
)
from lightning_ckpt.bench.files import (
    BUFFERED_CHUNK,
    DEFAULT_DIR,
    drop_page_cache,
    fsync_file,
    remove_path,
    run_directory,
)
from lightning_ckpt.bench.measure import (
    GB,
    Metrics,
    Task,
    m,
    measure,
    ratio,
    run_in_fresh_process,
    summarize,
)
from lightning_ckpt.bench.report import (
    add_json_argument,
    emit_report,
    fmt,
    machine_info,
    report_header,
    stderr_logger,
)
from lightning_ckpt.bench.workloads import Restored, build_checkpoint, state_bytes

DEFAULT_SIZES = "0.5GB,3GB"


# ----------------------------------------------------------------------------------------------
# Child side: the measured operations


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


def _sharded_kwargs(task: Task) -> dict[str, Any]:
    return {} if task.get("max_shard_size") is None else {"max_shard_size": task["max_shard_size"]}


def _torch_save(task: Task) -> Metrics:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    checkpoint = build_checkpoint(task["size_bytes"])
    io = TorchCheckpointIO()
    # fsspec's transaction writes a tempfile.mkstemp() file and moves it into place; keep that temp
    # file on the filesystem under test (not a possibly different /tmp), so the move is a rename.
    tempfile.tempdir = os.path.dirname(os.path.abspath(task["path"]))

    def save() -> None:
        io.save_checkpoint(checkpoint, task["path"])
        fsync_file(task["path"])

    result = measure(save)
    drop_page_cache(task["path"])  # leave the cache as the sharded writer does
    return {**result, "bytes_written": os.path.getsize(task["path"])}


def _sharded_save(task: Task) -> dict[str, Metrics]:
    from lightning_ckpt import ShardedCheckpointIO

    checkpoint = build_checkpoint(task["size_bytes"])
    io = ShardedCheckpointIO(**_sharded_kwargs(task))
    results: dict[str, Metrics] = {}
    try:
        for key, path in zip(("first", "steady"), task["paths"]):
            results[key] = measure(lambda path=path: io.save_checkpoint(checkpoint, path))
            assert io.last_save is not None
            results[key].update(
                bytes_written=io.last_save.nbytes, files=io.last_save.files, direct_io=io.last_save.direct_io
            )
            if key == "first":
                remove_path(path)  # not loaded; keep the disk footprint at one checkpoint
    finally:
        io.teardown()
    return results


def _load(task: Task, contender: str) -> Metrics:
    """Load into preallocated model and optimizer tensors, as a resumed training process does."""
    restored = Restored.zeros(task["size_bytes"])
    if contender == "torch_io":
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        io: Any = TorchCheckpointIO()
    else:
        from lightning_ckpt import ShardedCheckpointIO

        io = ShardedCheckpointIO(**_sharded_kwargs(task))
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
    """Runner of :func:`run_in_fresh_process` for this mode's measurements."""
    kind = task["kind"]
    if kind.startswith("plain_"):
        try:
            write = _plain_buffered if kind == "plain_buffered" else _plain_direct
            return write(task["path"], task["nbytes"])
        finally:  # the plain bytes are never read back
            remove_path(task["path"])
    if kind == "torch_io_save":
        return _torch_save(task)
    if kind == "sharded_io_save":
        return _sharded_save(task)
    if kind == "torch_io_load":
        return _load(task, "torch_io")
    if kind == "sharded_io_load":
        return _load(task, "sharded_io")
    raise ValueError(f"unknown task {kind!r}")


def bench_size(label: str, size_bytes: int, repeats: int, run_dir: str, max_shard_size: str | None, log: Any) -> Metrics:
    """All contenders at one state size; every measurement in a fresh process."""
    nbytes, n_tensors = state_bytes(size_bytes)
    runs: dict[str, list[Metrics]] = {
        k: []
        for k in (
            "plain_buffered",
            "plain_direct",
            "torch_io_save",
            "sharded_io_save_first",
            "sharded_io_save_steady",
            "torch_io_load",
            "sharded_io_load",
        )
    }
    errors: list[str] = []
    notes: list[str] = []
    tag = label.replace("/", "_")

    def attempt(r: int, key: str, task: Task) -> Any:
        """The child's result, or None after recording its error (the benchmark goes on).

        A failed ``O_DIRECT`` plain write (e.g. tmpfs refuses ``O_DIRECT``) is a note, not an error.
        """
        log(f"[{label} {r + 1}/{repeats}] {key}")
        try:
            return run_in_fresh_process(task, _run_task)
        except RuntimeError as err:
            (notes if key == "plain_direct" else errors).append(f"repeat {r + 1}: {err}")
            log(f"[{label} {r + 1}/{repeats}] {key} FAILED: {str(err).splitlines()[0]}")
            return None

    common = {"size_bytes": size_bytes, "max_shard_size": max_shard_size}
    for r in range(repeats):
        for kind in ("plain_buffered", "plain_direct"):
            path = os.path.join(run_dir, f"{tag}-r{r}-{kind}.bin")
            try:
                if (out := attempt(r, kind, {"kind": kind, "path": path, "nbytes": nbytes})) is not None:
                    runs[kind].append({**out, "GBps": nbytes / out["seconds"] / GB})
            finally:
                remove_path(path)

        torch_path = os.path.join(run_dir, f"{tag}-r{r}-torch.ckpt")
        try:
            if (out := attempt(r, "torch_io_save", {**common, "kind": "torch_io_save", "path": torch_path})) is not None:
                runs["torch_io_save"].append({**out, "GBps": nbytes / out["seconds"] / GB})
                if (out := attempt(r, "torch_io_load", {**common, "kind": "torch_io_load", "path": torch_path})) is not None:
                    runs["torch_io_load"].append({**out, "GBps": nbytes / out["seconds"] / GB})
        finally:
            remove_path(torch_path)

        paths = [os.path.join(run_dir, f"{tag}-r{r}-sharded-{i}") for i in (1, 2)]
        try:
            task = {**common, "kind": "sharded_io_save", "paths": paths}
            if (out := attempt(r, "sharded_io_save", task)) is not None:
                for key in ("first", "steady"):
                    runs[f"sharded_io_save_{key}"].append({**out[key], "GBps": nbytes / out[key]["seconds"] / GB})
                task = {**common, "kind": "sharded_io_load", "path": paths[1]}
                if (out := attempt(r, "sharded_io_load", task)) is not None:
                    runs["sharded_io_load"].append({**out, "GBps": nbytes / out["seconds"] / GB})
        finally:
            for path in paths:
                remove_path(path)

    ops = {key: summarize(values) for key, values in runs.items()}
    plain = [g for g in (m(ops["plain_buffered"], "GBps"), m(ops["plain_direct"], "GBps")) if g]
    best_plain = max(plain) if plain else None
    for key in ("torch_io_save", "sharded_io_save_first", "sharded_io_save_steady"):
        if ops[key] and best_plain:
            values = [v / best_plain for v in ops[key]["GBps"]["values"]]
            ops[key]["vs_plain"] = {"median": statistics.median(values), "values": values}

    torch_save, torch_load = ops["torch_io_save"], ops["torch_io_load"]
    steady, first, ours_load = ops["sharded_io_save_steady"], ops["sharded_io_save_first"], ops["sharded_io_load"]
    ratios = {
        "save_seconds": ratio(m(steady, "seconds"), m(torch_save, "seconds")),
        "save_seconds_first": ratio(m(first, "seconds"), m(torch_save, "seconds")),
        "save_peak_rss": ratio(m(steady, "peak_rss_mb"), m(torch_save, "peak_rss_mb")),
        "save_peak_rss_first": ratio(m(first, "peak_rss_mb"), m(torch_save, "peak_rss_mb")),
        "load_seconds": ratio(m(ours_load, "seconds"), m(torch_load, "seconds")),
        "load_peak_rss": ratio(m(ours_load, "peak_rss_mb"), m(torch_load, "peak_rss_mb")),
        "load_peak_rss_anon": ratio(m(ours_load, "peak_rss_anon_mb"), m(torch_load, "peak_rss_anon_mb")),
    }
    return {
        "size": label,
        "size_bytes": size_bytes,
        "state_bytes": nbytes,
        "state_tensors": n_tensors,
        "plain_write": {
            "buffered": ops["plain_buffered"],
            "direct": ops["plain_direct"],
            "best_plain_GBps": best_plain,
        },
        "torch_io": {"save": torch_save, "load": torch_load},
        "sharded_io": {"save_first": first, "save_steady": steady, "load": ours_load},
        "ratios_ours_over_torch_io": ratios,
        "errors": errors,
        "notes": notes,
    }


def render_table(results: list[Metrics]) -> Any:
    """One row per contender and size; ratio columns on our rows (ours / torch_io)."""
    from rich.table import Table

    table = Table(title="lightning_ckpt benchmark (medians; RSS = peak minus baseline)")
    for column in ("size", "contender", "s", "GB/s", "x plain", "ΔRSS MB", "ΔRssAnon MB"):
        table.add_column(column, justify="left" if column in ("size", "contender") else "right")
    for column in ("ours/torch s", "ours/torch ΔRSS", "ours/torch ΔAnon"):
        table.add_column(column, justify="right", style="bold")
    for res in results:
        plain, ratios = res["plain_write"], res["ratios_ours_over_torch_io"]
        rows: list[tuple[str, Metrics | None, tuple[float | None, float | None, float | None]]] = [
            ("plain_write buffered", plain["buffered"], (None, None, None)),
            ("plain_write O_DIRECT", plain["direct"], (None, None, None)),
            ("torch_io save", res["torch_io"]["save"], (None, None, None)),
            (
                "sharded_io save (1st)",
                res["sharded_io"]["save_first"],
                (ratios["save_seconds_first"], ratios["save_peak_rss_first"], None),
            ),
            ("sharded_io save", res["sharded_io"]["save_steady"], (ratios["save_seconds"], ratios["save_peak_rss"], None)),
            ("torch_io load", res["torch_io"]["load"], (None, None, None)),
            (
                "sharded_io load",
                res["sharded_io"]["load"],
                (ratios["load_seconds"], ratios["load_peak_rss"], ratios["load_peak_rss_anon"]),
            ),
        ]
        for i, (name, op, (r_time, r_rss, r_anon)) in enumerate(rows):
            size = f"{res['size']} ({res['state_bytes'] / GB:.3g} GB)" if i == 0 else ""
            if op is None:
                table.add_row(size, name, "error", *["-"] * 7)
                continue
            table.add_row(
                size,
                name,
                fmt(m(op, "seconds"), 3),
                fmt(m(op, "GBps")),
                fmt(m(op, "vs_plain")),
                fmt(m(op, "peak_rss_mb"), 0),
                fmt(m(op, "peak_rss_anon_mb"), 0),
                fmt(r_time),
                fmt(r_rss),
                fmt(r_anon),
            )
        table.add_section()
    return table


def _parse_sizes(text: str) -> list[tuple[str, int]]:
    from lightning_ckpt.format.plan import parse_size

    sizes = []
    for item in text.split(","):
        if item.strip():
            sizes.append((item.strip(), parse_size(item.strip(), "--sizes")))
    if not sizes:
        raise ValueError("`--sizes` is empty; give e.g. '0.5GB,3GB'.")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning_ckpt bench",
        description="Benchmark ShardedCheckpointIO against TorchCheckpointIO and a plain sequential write.",
        epilog="Every other mode has its own options: `--mode MODE --help`.",
    )
    add_mode_argument(parser)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma list of state sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement, medians reported (default 3)")
    parser.add_argument(
        "--dir",
        default=DEFAULT_DIR,
        help=f"where checkpoints are written, on the filesystem under test (default ./{DEFAULT_DIR})",
    )
    add_json_argument(parser)
    parser.add_argument(
        "--max-shard-size", default=None, help="ShardedCheckpointIO max_shard_size (default: the plugin's default)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``--mode save``; print a table (and the JSON with ``--json``). Returns 0, or 1 if any measurement failed.

    ``argv`` may hold ``--mode save`` (:func:`lightning_ckpt.bench.main` hands it on unchanged).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sizes = _parse_sizes(args.sizes)
        if args.max_shard_size is not None:
            from lightning_ckpt.format.plan import parse_size

            parse_size(args.max_shard_size, "--max-shard-size")
    except ValueError as err:
        parser.error(str(err))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    from lightning_ckpt.lightning.plugin import DEFAULT_MAX_SHARD_SIZE

    directory = os.path.abspath(args.dir)
    log = stderr_logger()
    machine = machine_info(directory)
    results = []
    started = time.time()
    with run_directory(directory) as run_dir:
        need = max(2 * state_bytes(size_bytes)[0] for _, size_bytes in sizes)
        free = shutil.disk_usage(run_dir).free
        if free < need * 1.1:
            log(f"--dir {directory!r} has {free / GB:.1f} GB free; the largest size needs ~{need / GB:.1f} GB.")
            return 2
        for label, size_bytes in sizes:
            results.append(bench_size(label, size_bytes, args.repeats, run_dir, args.max_shard_size, log))

    report = {
        **report_header(argv, started),
        "settings": {
            "sizes": [label for label, _ in sizes],
            "repeats": args.repeats,
            "dir": directory,
            "max_shard_size": args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
            "units": "GB = 1e9 bytes, MB = 1e6 bytes; RSS figures are peak minus the pre-operation baseline",
            "torch_io_tempdir": "--dir (fsspec's temporary file is kept on the filesystem under test)",
        },
        "machine": machine,
        "results": results,
    }
    emit_report(render_table(results), report, args.json_path)
    return 1 if any(res["errors"] for res in results) else 0
