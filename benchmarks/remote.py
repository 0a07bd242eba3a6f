"""``bench --mode remote``: checkpoints on object storage (``s3://``), against a local S3 server.

``python -m benchmarks --mode remote [--size 512MB] [--repeats 3] [--json PATH]``.

The program starts moto's S3-compatible server in a subprocess on ``127.0.0.1`` (a free port),
points every S3 client of the run at it through the environment (``AWS_ENDPOINT_URL``, test
credentials, ``us-east-1``: s3fs in the measurement process and in the writer process it starts
read them alike; no traffic leaves the machine), creates a bucket, and stops the server at the
end. The measured state is ``workloads.build_checkpoint(--size)``: 1/3 fp32 weights, 2/3 AdamW
moments. Contenders, each with a fresh plugin and a tiny untimed save of its own kind first (the
imports, the writer process, the connections: what a training run pays once):

* ``torch_io``: Lightning ``TorchCheckpointIO().save_checkpoint(state, "s3://...")`` (``torch.save``
  into memory, then one fsspec stream).
* ``sharded_sync``: ``ShardedCheckpointIO()``: committed in a local spool folder, then published;
  the call returns once published.
* ``sharded_async``: ``ShardedCheckpointIO(async_save=True)`` (pool reserved first with
  ``prepare_staging``, as ``ShardedModelCheckpoint`` does): the call returns once staged; the
  writer process commits and publishes.
* ``sharded_local_tier``: ``ShardedCheckpointIO(local_dir=...)`` in synchronous mode: the call
  returns once committed on local disk; a background thread uploads.
* ``local_disk``: ``ShardedCheckpointIO()`` to a plain local folder (the local-disk stall reference).
* ``s3fs_put``: the checkpoint written locally with ``lightning_ckpt.save_checkpoint`` (untimed),
  then ``fs.put(folder, "bucket/...", recursive=True)``: s3fs's own parallel upload, the
  throughput reference (s3fs defaults: 50 MiB parts, 10 parts of a file at once).

Per contender and repeat: **stall** = the save call; **durable** = from the call until
``io.wait()`` returned (synchronous saves: the call); **upload GB/s** = bytes uploaded / seconds of
the upload alone, where it runs alone: the local tier's publish (``WriteResult.seconds`` from
``io.poll()``) and the put; **durable GB/s** = state bytes / durable; **load** = from ``s3://``,
``TorchCheckpointIO().load_checkpoint`` for ``torch_io`` and ``ShardedCheckpointIO().load_checkpoint``
(downloaded, every object hashed) for ours; the local reference loads its folder, the put
reference is ``fs.get`` + ``lightning_ckpt.load_checkpoint``. Every loaded state is compared with
the saved one byte for byte (tensors as raw bytes, dtypes, shapes, every other value and type).

**Memory**: the peak of ``VmRSS`` and ``RssAnon`` over the save call and its wait, minus the
reading just before (``measure.RssSampler``, 20 ms samples; ``VmHWM`` reset for the exact RSS
peak), of the measurement process, and of the writer process for ``sharded_async`` (sampled the
same way). RSS includes shared memory (the async staging pool), RssAnon does not: the upload
buffers are anonymous memory, so **upload memory** = peak ΔRssAnon of the process that uploads
(the writer for async saves, else the measurement process), set against the documented budget
``upload_concurrency x upload_part_size``, and against the *streams budget*
``min(upload_concurrency, objects of at least one part) x upload_part_size``: with fewer such
objects than ``upload_concurrency`` (two at the default ``max_shard_size`` and ``--size``: the
model file and the optimizer file) the documented budget cannot fill, and the peak per stream is
what says whether it holds (``--max-shard-size`` makes more objects). Page cache is not counted.

All contenders of one repeat run in one freshly ``spawn``-ed interpreter on one state (so that
glibc reads the setting below at its start), each measured from its own baseline, with
``gc.collect()`` and ``malloc_trim(0)`` between them and ``MALLOC_MMAP_THRESHOLD_=65536`` (so freed
buffers go back to the system rather than lowering the next contender's peak); the order rotates
with each repeat so no contender always runs first. Objects are deleted after each contender (moto
keeps them in memory), and ``os.sync()`` runs before every timed save and load, so no writeback
of an earlier contender's files competes with the next one. The server is single-process Python sharing the machine's cores with the
client: absolute throughputs say more about moto than about S3; the ratios are the point.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common.measure import environment, run_in_spawned_process
from benchmarks.common.s3 import s3_environment, s3_server
from benchmarks.common.workloads import mismatches
from lightning_ckpt.bench.files import (
    DEFAULT_DIR,
    path_bytes,
    remove_path,
    run_directory,
)
from lightning_ckpt.bench.measure import (
    GB,
    MB,
    Metrics,
    RssSampler,
    Task,
    m,
    measure,
    proc_status,
    ratio,
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
from lightning_ckpt.bench.workloads import build_checkpoint, state_bytes

CONTENDERS = ("torch_io", "sharded_sync", "sharded_async", "sharded_local_tier", "local_disk", "s3fs_put")
TITLES = {
    "torch_io": "TorchCheckpointIO → s3",
    "sharded_sync": "ours sync → s3",
    "sharded_async": "ours async → s3",
    "sharded_local_tier": "ours local tier → s3",
    "local_disk": "ours → local disk (ref.)",
    "s3fs_put": "s3fs put (ref.)",
}
OURS_REMOTE = ("sharded_sync", "sharded_async", "sharded_local_tier")
DEFAULT_SIZE = "512MB"
DEFAULT_PART_SIZE = "64MiB"  # ShardedCheckpointIO's default upload_part_size
BUCKET = "lightning-ckpt-bench"
WARM_BYTES = 200_000  # the untimed first save of each contender
# read by glibc when a process starts: freed buffers go back to the system (see the docstring)
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# Targets of the remote-checkpoint issue; reported, never asserted.
TARGET_LOCAL_TIER_STALL = 1.2  # local-tier stall / local-disk stall, at most
TARGET_UPLOAD_VS_PUT = 0.8  # our upload throughput / s3fs put throughput, at least
TARGET_MEMORY_VS_BUDGET = 1.0  # peak upload memory / (upload_concurrency x upload_part_size), at most


# ----------------------------------------------------------------------------------------------
# Child side: one repeat, every contender on one state


class _ProcessRssSampler(RssSampler):
    """:class:`RssSampler` of another process of ours (the async writer): same samples, same metrics.

    Entering it also resets this process's ``VmHWM`` (the base class does): enter it before this
    process's own sampler.
    """

    def __init__(self, pid: int) -> None:
        super().__init__()
        self.pid = pid

    def read(self) -> dict[str, int]:
        return proc_status(self.pid)

    def __enter__(self) -> _ProcessRssSampler:
        super().__enter__()
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        return self


class _Run:
    """One contender's run in the measurement process: its URLs and folders, the timed save and
    load, the byte-for-byte check, and the clean-up of everything it wrote."""

    def __init__(self, task: Task, name: str, fs: Any) -> None:
        self.task, self.name, self.fs = task, name, fs
        self.prefix = f"{task['bucket']}/r{task['repeat']}/{name}"
        self.url = f"s3://{self.prefix}/x.ckpt"
        self.warm_url = f"s3://{self.prefix}/warm.ckpt"
        self.local = os.path.join(task["run_dir"], f"r{task['repeat']}-{name}")
        os.makedirs(self.local)

    def plugin_options(self) -> dict[str, Any]:
        """The ``ShardedCheckpointIO`` arguments every one of our contenders shares."""
        options = {"upload_part_size": self.task["part_size"], "upload_concurrency": self.task["concurrency"]}
        if self.task["max_shard_size"] is not None:
            options["max_shard_size"] = self.task["max_shard_size"]
        return options

    def timed_save(self, save: Callable[[], None], wait: Callable[[], None], writer_pid: int | None = None) -> Metrics:
        """Stall (the call), durable (call + ``wait``), and memory over both."""
        from lightning_ckpt.lightning.release import release_memory

        os.sync()  # no writeback of an earlier contender's files competes with this one
        release_memory("never")
        with contextlib.ExitStack() as stack:
            writer = stack.enter_context(_ProcessRssSampler(writer_pid)) if writer_pid is not None else None
            sampler = stack.enter_context(RssSampler())
            start = time.perf_counter()
            save()
            stall = time.perf_counter() - start
            wait()
            durable = time.perf_counter() - start
        result = {"stall_s": stall, "durable_s": durable, **sampler.metrics()}
        if writer is not None:
            metrics = writer.metrics()
            result.update(writer_peak_rss_mb=metrics["peak_rss_mb"], writer_peak_rss_anon_mb=metrics["peak_rss_anon_mb"])
        return result

    def timed_load(self, load: Callable[[], Any], checkpoint: dict[str, Any]) -> Metrics:
        """The load's seconds and peak memory, and whether it gave back exactly ``checkpoint``."""
        loaded: list[Any] = []
        os.sync()
        metrics = measure(lambda: loaded.append(load()))
        problems = mismatches(checkpoint, loaded.pop())
        return {
            "load_s": metrics["seconds"],
            "load_peak_rss_mb": metrics["peak_rss_mb"],
            "load_peak_rss_anon_mb": metrics["peak_rss_anon_mb"],
            "bit_exact": not problems,
            "mismatches": problems,
        }

    def objects(self) -> Metrics:
        """How many objects the save left under its URL, and how many of them hold at least one
        upload part (each such one is uploaded through a stream that buffers whole parts)."""
        self.fs.invalidate_cache(self.prefix)
        sizes = [entry["size"] for entry in self.fs.find(f"{self.prefix}/x.ckpt", detail=True).values()]
        return {"objects": len(sizes), "objects_of_a_part": sum(size >= self.task["part_size"] for size in sizes)}

    def clean(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.prefix, recursive=True)
        remove_path(self.local)


def _torch_io(run: _Run, checkpoint: dict[str, Any], warm: dict[str, Any]) -> Metrics:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    io = TorchCheckpointIO()
    io.save_checkpoint(warm, run.warm_url)
    result = run.timed_save(lambda: io.save_checkpoint(checkpoint, run.url), lambda: None)
    return {**result, **run.objects(), **run.timed_load(lambda: io.load_checkpoint(run.url), checkpoint)}


def _sharded(run: _Run, checkpoint: dict[str, Any], warm: dict[str, Any], **options: Any) -> Metrics:
    """One of our remote contenders (``options``: async_save or local_dir), loaded back from s3://
    by a plain ``ShardedCheckpointIO()`` (not from the local tier)."""
    from lightning_ckpt import ShardedCheckpointIO

    io = ShardedCheckpointIO(**options, **run.plugin_options())
    try:
        writer_pid = None
        if io.async_save:
            io.prepare_staging(run.task["state_bytes"], on_device=False)
            writer_pid = io.async_saver.worker.pid  # started by prepare_staging
        io.save_checkpoint(warm, run.warm_url)
        io.wait()
        io.poll()
        result = run.timed_save(lambda: io.save_checkpoint(checkpoint, run.url), io.wait, writer_pid)
        published = [r for r in io.poll() if r.path == run.url]
        if "local_dir" in options:  # the background upload's own time (publish, as remote.publish times it)
            if not published:
                raise RuntimeError(f"no upload result for {run.url} after io.wait()")
            result.update(upload_s=published[-1].seconds, upload_bytes=published[-1].nbytes)
    finally:
        io.teardown()
    reader = ShardedCheckpointIO(**run.plugin_options())
    return {**result, **run.objects(), **run.timed_load(lambda: reader.load_checkpoint(run.url), checkpoint)}


def _local_disk(run: _Run, checkpoint: dict[str, Any], warm: dict[str, Any]) -> Metrics:
    from lightning_ckpt import ShardedCheckpointIO

    io = ShardedCheckpointIO(**run.plugin_options())
    path = os.path.join(run.local, "x.ckpt")
    try:
        io.save_checkpoint(warm, os.path.join(run.local, "warm.ckpt"))
        result = run.timed_save(lambda: io.save_checkpoint(checkpoint, path), io.wait)
    finally:
        io.teardown()
    return {**result, **run.timed_load(lambda: io.load_checkpoint(path), checkpoint)}


def _s3fs_put(run: _Run, checkpoint: dict[str, Any], warm: dict[str, Any]) -> Metrics:
    import lightning_ckpt

    folder, warm_folder = os.path.join(run.local, "x.ckpt"), os.path.join(run.local, "warm.ckpt")
    shards = {} if run.task["max_shard_size"] is None else {"max_shard_size": run.task["max_shard_size"]}
    lightning_ckpt.save_checkpoint(checkpoint, folder, **shards)
    lightning_ckpt.save_checkpoint(warm, warm_folder)
    remote_folder = f"{run.prefix}/x.ckpt"
    run.fs.put(warm_folder, f"{run.prefix}/warm.ckpt", recursive=True)
    result = run.timed_save(lambda: run.fs.put(folder, remote_folder, recursive=True), lambda: None)
    uploaded = path_bytes(folder)
    listed = sum(run.fs.du(remote_folder, total=False).values())
    if listed != uploaded:  # the put must have landed every file where we read it back from
        raise RuntimeError(f"put {uploaded} bytes, {listed} bytes listed under {remote_folder!r}")
    result.update(upload_s=result["durable_s"], upload_bytes=uploaded, **run.objects())
    download = os.path.join(run.local, "download")

    def load() -> dict[str, Any]:
        run.fs.get(remote_folder, download, recursive=True)
        return lightning_ckpt.load_checkpoint(download)

    return {**result, **run.timed_load(load, checkpoint)}


def _contender(name: str) -> Callable[[_Run, dict[str, Any], dict[str, Any]], Metrics]:
    if name == "torch_io":
        return _torch_io
    if name == "sharded_sync":
        return _sharded
    if name == "sharded_async":
        return lambda run, checkpoint, warm: _sharded(run, checkpoint, warm, async_save=True)
    if name == "sharded_local_tier":
        return lambda run, checkpoint, warm: _sharded(run, checkpoint, warm, local_dir=os.path.join(run.local, "tier"))
    if name == "local_disk":
        return _local_disk
    if name == "s3fs_put":
        return _s3fs_put
    raise ValueError(f"unknown contender {name!r}")


def _run_repeat(task: Task) -> dict[str, Metrics]:
    """Runner of :func:`run_in_spawned_process`: every contender of ``task["order"]`` once; a failed
    contender is recorded as ``{"error": ...}`` and the others still run."""
    import tempfile
    import traceback

    import fsspec

    from lightning_ckpt.lightning.release import release_memory

    # Spool folders (tempfile.mkdtemp) on the filesystem under test, inside the run folder.
    tempfile.tempdir = task["run_dir"]
    fs = fsspec.filesystem("s3")  # the instance every contender's fsspec lookups get (cached)
    fs.ls(task["bucket"])
    checkpoint, warm = build_checkpoint(task["size_bytes"]), build_checkpoint(WARM_BYTES)
    results: dict[str, Metrics] = {}
    for name in task["order"]:
        run = _Run(task, name, fs)
        try:
            results[name] = _contender(name)(run, checkpoint, warm)
        except Exception as err:
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        finally:
            run.clean()
            release_memory("never")
    return results


# ----------------------------------------------------------------------------------------------
# Parent side: repeats, summaries, ratios, the table


def _derived(run: Metrics, nbytes: int, name: str, part_size: int, concurrency: int) -> Metrics:
    """Throughputs and the upload-memory figures of one contender's run.

    ``upload_streams_budget_mb``: part size times the streams that can each hold a whole part at
    once (``min(concurrency, objects of at least one part)``); with fewer such objects than
    ``concurrency`` the documented budget cannot be reached, and this is the one the peak can be
    held against.
    """
    ours = name in OURS_REMOTE
    upload_anon = run.get("writer_peak_rss_anon_mb") if name == "sharded_async" else run.get("peak_rss_anon_mb")
    streams = max(1, min(concurrency, run.get("objects_of_a_part", 0)))
    return {
        **run,
        "durable_GBps": nbytes / run["durable_s"] / GB,
        "upload_GBps": run["upload_bytes"] / run["upload_s"] / GB if run.get("upload_s") else None,
        "upload_peak_anon_mb": upload_anon if ours else None,
        "upload_streams_budget_mb": streams * part_size / MB if ours else None,
    }


def _check(value: float | None, op: str | None = None, target: float | None = None) -> Metrics:
    """A ratio with its target (``op`` ``"<="`` or ``">="``; none: for information) and whether it is met."""
    met = None
    if value is not None and op is not None and target is not None:
        met = value <= target if op == "<=" else value >= target
    return {"value": value, "target": None if op is None else f"{op} {target}", "met": met}


def bench(
    size_bytes: int,
    repeats: int,
    run_dir: str,
    part_size: int,
    concurrency: int,
    max_shard_size: str | None,
    log: Callable[[str], None],
) -> Metrics:
    """Every contender ``repeats`` times against the running server; summaries, ratios, errors."""
    nbytes, n_tensors = state_bytes(size_bytes)
    runs: dict[str, list[Metrics]] = {name: [] for name in CONTENDERS}
    mismatched: dict[str, list[str]] = {}
    errors: list[str] = []
    for r in range(repeats):
        order = CONTENDERS[r % len(CONTENDERS) :] + CONTENDERS[: r % len(CONTENDERS)]
        log(f"repeat {r + 1}/{repeats}: {', '.join(order)}")
        task = {
            "kind": f"remote-r{r}",
            "repeat": r,
            "order": order,
            "size_bytes": size_bytes,
            "state_bytes": nbytes,
            "bucket": BUCKET,
            "run_dir": run_dir,
            "part_size": part_size,
            "concurrency": concurrency,
            "max_shard_size": max_shard_size,
        }
        try:
            out = run_in_spawned_process(task, _run_repeat, _MALLOC_ENV)
        except RuntimeError as err:
            errors.append(f"repeat {r + 1}: {err}")
            log(f"repeat {r + 1} FAILED: {str(err).splitlines()[0]}")
            continue
        for name in order:
            result = out[name]
            if "error" in result:
                errors.append(f"repeat {r + 1} {name}: {result['error']}\n{result['traceback']}")
                log(f"repeat {r + 1} {name} FAILED: {result['error']}")
                continue
            if result["mismatches"]:
                mismatched.setdefault(name, []).extend(result["mismatches"])
            runs[name].append(_derived(result, nbytes, name, part_size, concurrency))
            log(f"  {name}: stall {result['stall_s']:.3f} s, durable {result['durable_s']:.3f} s, load {result['load_s']:.3f} s")

    contenders: dict[str, Metrics | None] = {}
    for name, values in runs.items():
        summary = summarize([{k: v for k, v in run.items() if k != "mismatches"} for run in values])
        if summary is not None:
            # every repeat must have loaded back exactly what it saved (summarize keeps one bool)
            summary["bit_exact"] = all(run["bit_exact"] for run in values)
            summary["mismatches"] = mismatched.get(name, [])
        contenders[name] = summary
    budget_mb = concurrency * part_size / MB

    def of(name: str, key: str) -> float | None:
        return m(contenders[name], key)

    ratios = {
        "local_tier_stall_vs_local_disk_stall": _check(
            ratio(of("sharded_local_tier", "stall_s"), of("local_disk", "stall_s")), "<=", TARGET_LOCAL_TIER_STALL
        ),
        "upload_GBps_vs_s3fs_put": {
            **_check(ratio(of("sharded_local_tier", "upload_GBps"), of("s3fs_put", "upload_GBps")), ">=", TARGET_UPLOAD_VS_PUT),
            "ours": "sharded_local_tier (its background publish, timed alone)",
        },
        **{
            f"upload_memory_vs_budget_{name}": _check(
                ratio(of(name, "upload_peak_anon_mb"), budget_mb), "<=", TARGET_MEMORY_VS_BUDGET
            )
            for name in OURS_REMOTE
        },
        **{
            f"upload_memory_vs_streams_budget_{name}": _check(
                ratio(of(name, "upload_peak_anon_mb"), of(name, "upload_streams_budget_mb")), "<=", TARGET_MEMORY_VS_BUDGET
            )
            for name in OURS_REMOTE
        },
        "sync_durable_vs_torch_io": _check(ratio(of("sharded_sync", "durable_s"), of("torch_io", "durable_s"))),
        "async_stall_vs_torch_io": _check(ratio(of("sharded_async", "stall_s"), of("torch_io", "stall_s"))),
        "load_vs_torch_io": _check(ratio(of("sharded_sync", "load_s"), of("torch_io", "load_s"))),
    }
    return {
        "size_bytes": size_bytes,
        "state_bytes": nbytes,
        "state_tensors": n_tensors,
        "upload_memory_budget_mb": budget_mb,
        "contenders": contenders,
        "ratios": ratios,
        "errors": errors,
    }


def render_table(result: Metrics, part_size: int, concurrency: int) -> Any:
    """One row per contender, then the ratios the targets are about."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=f"remote checkpoints, {result['state_bytes'] / GB:.3g} GB state against a local moto S3 server"
        " (medians; memory in MB = peak minus baseline; mem = upload ΔAnon)"
    )
    columns = (
        "contender", "stall s", "durable s", "durable GB/s", "upload GB/s", "ΔRSS", "ΔAnon",
        "writer ΔAnon", "objects", "mem/budget", "mem/streams", "load s", "exact",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "contender" else "right", no_wrap=column == "contender")
    budget = result["upload_memory_budget_mb"]
    for name in CONTENDERS:
        summary = result["contenders"][name]
        if summary is None:
            table.add_row(TITLES[name], "error", *["-"] * (len(columns) - 2))
            continue
        upload_mem = m(summary, "upload_peak_anon_mb")
        objects, whole = m(summary, "objects"), m(summary, "objects_of_a_part")
        table.add_row(
            TITLES[name],
            fmt(m(summary, "stall_s"), 3),
            fmt(m(summary, "durable_s"), 3),
            fmt(m(summary, "durable_GBps"), 3),
            fmt(m(summary, "upload_GBps"), 3),
            fmt(m(summary, "peak_rss_mb"), 0),
            fmt(m(summary, "peak_rss_anon_mb"), 0),
            fmt(m(summary, "writer_peak_rss_anon_mb"), 0),
            "-" if objects is None or whole is None else f"{objects:.0f} ({whole:.0f})",
            fmt(ratio(upload_mem, budget)),
            fmt(ratio(upload_mem, m(summary, "upload_streams_budget_mb"))),
            fmt(m(summary, "load_s"), 3),
            "yes" if summary["bit_exact"] else "NO",
        )
    checks = Table(title="ratios (medians) and the targets")
    for column in ("ratio", "value", "target", "met"):
        checks.add_column(column, justify="left" if column == "ratio" else "right")
    for name, entry in result["ratios"].items():
        met = "-" if entry["met"] is None else "yes" if entry["met"] else "NO"
        checks.add_row(name, fmt(entry["value"]), entry["target"] or "-", met)
    notes = Text(
        f"objects: objects written (of them, holding at least one upload part). mem: peak ΔAnon of the uploading"
        f" process (the writer for async). budget: upload_concurrency x upload_part_size = {concurrency} x"
        f" {part_size / 2**20:g} MiB = {budget:.0f} MB. streams: min(upload_concurrency, objects of at least one"
        " part) x upload_part_size, the part of the budget that objects this size can fill.",
        style="dim",
    )
    return Group(table, checks, notes)


def build_parser() -> argparse.ArgumentParser:
    from lightning_ckpt.remote import DEFAULT_CONCURRENCY

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks --mode remote",
        description="Remote (s3://) checkpoints against a local moto S3 server: stall, durable time,"
        " upload throughput, memory and loads of ShardedCheckpointIO, TorchCheckpointIO and a plain s3fs put.",
    )
    parser.add_argument("--size", default=DEFAULT_SIZE, help=f"state size (default {DEFAULT_SIZE})")
    parser.add_argument("--repeats", type=int, default=3, help="repeats, medians reported (default 3)")
    parser.add_argument(
        "--dir", default=DEFAULT_DIR, help=f"local folders (spools, local tier, references) go here (default ./{DEFAULT_DIR})"
    )
    parser.add_argument(
        "--part-size", default=DEFAULT_PART_SIZE, help=f"ShardedCheckpointIO upload_part_size (default {DEFAULT_PART_SIZE})"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"ShardedCheckpointIO upload_concurrency (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="ShardedCheckpointIO max_shard_size (default: the plugin's): smaller shards, more objects"
        " uploaded at once",
    )
    add_json_argument(parser)
    return parser


def missing_packages() -> list[str]:
    """What this mode needs and is not installed (``lightning-ckpt[test]`` brings both)."""
    return [name for name in ("s3fs", "moto") if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    """Run ``--mode remote``; print the tables (and the JSON with ``--json``). Returns 0, 1 if a
    measurement failed or a load was not bit-exact, 2 if it could not run."""
    from lightning_ckpt.format.plan import parse_size

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        size_bytes = parse_size(args.size, "--size")
        part_size = parse_size(args.part_size, "--part-size")
        if args.max_shard_size is not None:
            parse_size(args.max_shard_size, "--max-shard-size")
    except ValueError as err:
        parser.error(str(err))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    log = stderr_logger()
    if missing := missing_packages():
        log(f"bench --mode remote needs {' and '.join(missing)}: pip install 'lightning-ckpt[test]' (or s3fs 'moto[server]').")
        return 2
    directory = os.path.abspath(args.dir)
    started = time.time()
    with run_directory(directory) as run_dir:
        # at most a few local copies at once (spool or local tier, downloads), each removed after its contender
        need = 3 * state_bytes(size_bytes)[0]
        if shutil.disk_usage(run_dir).free < need:
            log(f"--dir {directory!r} has {shutil.disk_usage(run_dir).free / GB:.1f} GB free; ~{need / GB:.1f} GB needed.")
            return 2
        machine = machine_info(run_dir)
        log("starting the moto S3 server")
        with s3_server(os.path.join(run_dir, "moto.log")) as endpoint, environment(s3_environment(endpoint)):
            import s3fs

            s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
            log(f"S3 server at {endpoint}, bucket {BUCKET!r}")
            result = bench(size_bytes, args.repeats, run_dir, part_size, args.concurrency, args.max_shard_size, log)
    from lightning_ckpt.bench.report import version
    from lightning_ckpt.lightning.plugin import DEFAULT_MAX_SHARD_SIZE

    report = {
        **report_header(argv, started),
        "settings": {
            "mode": "remote",
            "size": args.size,
            "repeats": args.repeats,
            "dir": directory,
            "upload_part_size": part_size,
            "upload_concurrency": args.concurrency,
            "max_shard_size": args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
            "contenders": list(CONTENDERS),
            "server": {"implementation": "moto.server", "moto": version("moto"), "s3fs": version("s3fs"), "host": "127.0.0.1"},
            "units": "GB = 1e9 bytes, MB = 1e6 bytes; memory = peak minus the reading before the save",
            "memory": "peak VmRSS / RssAnon (20 ms samples, VmHWM) over the save call and its wait, of the"
            " measurement process and (async) of the writer process; upload memory = peak RssAnon of the"
            " uploading process",
            "stall": "the save call",
            "durable": "from the save call until io.wait() returned",
            "upload_GBps": "bytes uploaded / seconds of the upload alone (local tier: its publish; s3fs put)",
        },
        "machine": machine,
        "results": result,
    }
    emit_report(render_table(result, part_size, args.concurrency), report, args.json_path)
    failed = result["errors"] or any(s is None or not s["bit_exact"] for s in result["contenders"].values())
    return 1 if failed else 0
