"""Benchmark: ShardedCheckpointIO against Lightning's TorchCheckpointIO and a plain sequential write.

Each measurement runs in a fresh ``spawn`` subprocess, so RSS figures start clean: the child builds
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

    python -m lightning_ckpt.bench --sizes 0.5GB,3GB --repeats 3 --json bench-results/bench.json

``--mode async`` runs the training-loop benchmark of async saves instead (``bench_async.py``);
``--mode activations`` the activation checkpointing benchmark (``bench_activations.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import mmap
import multiprocessing
import os
import platform
import secrets
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata as importlib_metadata
from multiprocessing.connection import Connection
from typing import Any

import torch

from lightning_ckpt import _fs

GB = 10**9
MB = 10**6
_BUFFERED_CHUNK = 64 * 2**20
_DIRECT_CHUNK = 16 * 2**20
_ALIGN = 4096
_LAYERS = 6
_SAMPLE_INTERVAL_S = 0.02  # VmHWM gives the exact VmRSS peak; sampling (for RssAnon) stays light so it does not perturb what it measures
DEFAULT_SIZES = "0.5GB,3GB"
DEFAULT_DIR = os.path.join("bench-results", "tmp")

Task = dict[str, Any]
Metrics = dict[str, Any]


# ----------------------------------------------------------------------------------------------
# The checkpoint dict


def model_layout(param_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a small transformer-like model (51 fp32 tensors) of about ``param_bytes``."""
    elements = max(param_bytes // 4, 1)
    # Each block holds 12 h^2 + 9 h elements; the blocks take ~3/4, the embedding the rest.
    hidden = max(8, int(math.sqrt(0.75 * elements / (12 * _LAYERS))) // 8 * 8)
    blocks: list[tuple[str, tuple[int, ...]]] = []
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        blocks += [
            (p + "attn.qkv.weight", (3 * hidden, hidden)),
            (p + "attn.qkv.bias", (3 * hidden,)),
            (p + "attn.proj.weight", (hidden, hidden)),
            (p + "mlp.fc1.weight", (4 * hidden, hidden)),
            (p + "mlp.fc1.bias", (4 * hidden,)),
            (p + "mlp.fc2.weight", (hidden, 4 * hidden)),
            (p + "norm.weight", (hidden,)),
            (p + "norm.bias", (hidden,)),
        ]
    blocks += [("model.norm.weight", (hidden,)), ("model.norm.bias", (hidden,))]
    used = sum(math.prod(shape) for _, shape in blocks)
    vocab = max(1, (elements - used) // hidden)
    return [("model.embed.weight", (vocab, hidden)), *blocks]


def build_checkpoint(size_bytes: int, device: str | torch.device = "cpu") -> dict[str, Any]:
    """A Lightning-style checkpoint of about ``size_bytes``: 1/3 weights, 2/3 AdamW state (fp32).

    Weights and moments are created on ``device``; the ``step`` counters stay on the CPU, as
    AdamW keeps them (not ``capturable``, not ``fused``).
    """
    torch.manual_seed(0)
    layout = model_layout(size_bytes // 3)
    state_dict = {name: torch.randn(shape, device=device) for name, shape in layout}
    optimizer_state = {
        i: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(shape, device=device),
            "exp_avg_sq": torch.randn(shape, device=device).abs_(),
        }
        for i, (_, shape) in enumerate(layout)
    }
    param_group = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "params": list(range(len(layout))),
    }
    return {
        "epoch": 3,
        "global_step": 1200,
        "pytorch-lightning_version": _version("lightning") or "unknown",
        "state_dict": state_dict,
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_progress": {"total": {"ready": 4, "completed": 3}, "current": {"ready": 4, "completed": 3}},
                "epoch_loop.batch_progress": {"total": {"ready": 1200, "completed": 1200}},
            }
        },
        "callbacks": {},
        "optimizer_states": [{"state": optimizer_state, "param_groups": [param_group]}],
        "lr_schedulers": [],
    }




def state_bytes(size_bytes: int) -> tuple[int, int]:
    """(tensor bytes, tensor count) of ``build_checkpoint(size_bytes)``, without building it."""
    layout = model_layout(size_bytes // 3)
    elements = sum(math.prod(shape) for _, shape in layout)
    return 4 * (3 * elements + len(layout)), 4 * len(layout)


# ----------------------------------------------------------------------------------------------
# Child side: memory sampling and the measured operations


def parse_status(data: bytes) -> dict[str, int]:
    """The ``kB`` fields of a /proc/PID/status (or /proc/meminfo) text, in bytes."""
    fields: dict[str, int] = {}
    for line in data.split(b"\n"):
        if line.endswith(b" kB") and b":" in line:
            key, value = line.split(b":", 1)
            fields[key.decode()] = int(value.split()[0]) * 1024
    return fields


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """``parse_status`` of /proc/PID/status (empty if the process is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            return parse_status(f.read())
    except OSError:
        return {}


class RssSampler:
    """Samples ``VmRSS`` and ``RssAnon`` of this process every 20 ms; also resets and reads ``VmHWM``."""

    def __init__(self, interval: float = _SAMPLE_INTERVAL_S) -> None:
        self.interval = interval
        self._fd = os.open("/proc/self/status", os.O_RDONLY)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self.baseline = self.peak = (0, 0)
        self.hwm_reset = False
        self.samples = 0

    def read(self) -> dict[str, int]:
        """Fields of /proc/self/status in bytes (only the ``kB`` ones)."""
        os.lseek(self._fd, 0, os.SEEK_SET)
        return parse_status(os.read(self._fd, 16384))

    def _sample(self) -> None:
        fields = self.read()
        rss, anon = fields.get("VmRSS", 0), fields.get("RssAnon", 0)
        self.peak = (max(self.peak[0], rss), max(self.peak[1], anon))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> RssSampler:
        fields = self.read()
        self.baseline = self.peak = (fields.get("VmRSS", 0), fields.get("RssAnon", 0))
        try:  # "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            pass
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.hwm = self.read().get("VmHWM", 0)
        os.close(self._fd)

    def metrics(self) -> Metrics:
        return {
            "peak_rss_mb": (self.peak[0] - self.baseline[0]) / MB,
            "peak_rss_anon_mb": (self.peak[1] - self.baseline[1]) / MB,
            "peak_hwm_mb": (self.hwm - self.baseline[0]) / MB if self.hwm_reset else None,
            "baseline_rss_mb": self.baseline[0] / MB,
            "rss_samples": self.samples,
        }


def _measure(operation: Callable[[], Any]) -> Metrics:
    """Time ``operation`` and record its peak RSS over the baseline; its result lives until the end."""
    gc.collect()
    with RssSampler() as sampler:
        start = time.perf_counter()
        result = operation()
        seconds = time.perf_counter() - start
    del result
    return {"seconds": seconds, **sampler.metrics()}


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    return [path] if os.path.exists(path) else []


def drop_page_cache(path: str) -> None:
    """``POSIX_FADV_DONTNEED`` on every file of ``path`` (clean pages only; all of ours are fsynced)."""
    for name in _files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            _fs.drop_page_cache(fd)
        finally:
            os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def write_and_fsync(path: str, flags: int, buffer: memoryview, nbytes: int) -> None:
    """Write ``nbytes`` to a new file at ``path`` by repeating ``buffer``, then fsync it."""
    fd = os.open(path, flags, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, buffer[: min(left, len(buffer))])
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain_buffered(path: str, nbytes: int) -> Metrics:
    buffer = memoryview(os.urandom(min(_BUFFERED_CHUNK, nbytes)))  # preallocated, reused

    def write() -> None:
        write_and_fsync(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, buffer, nbytes)

    return {**_measure(write), "bytes_written": nbytes}


def _plain_direct(path: str, nbytes: int) -> Metrics:
    if not hasattr(os, "O_DIRECT"):
        raise OSError("O_DIRECT is not available on this platform")
    total = -(-nbytes // _ALIGN) * _ALIGN
    raw = mmap.mmap(-1, min(_DIRECT_CHUNK, total))  # anonymous maps are page-aligned
    raw[:] = os.urandom(len(raw))
    buffer = memoryview(raw)

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            left = total
            while left:
                n = os.write(fd, buffer[: min(left, len(buffer))])
                if n % _ALIGN:
                    raise OSError(f"short O_DIRECT write of {n} bytes")
                left -= n
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        result = _measure(write)
    finally:
        buffer.release()
        raw.close()
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
        _fsync_file(task["path"])

    result = _measure(save)
    drop_page_cache(task["path"])  # leave the cache as the sharded writer does
    return {**result, "bytes_written": os.path.getsize(task["path"])}


def _sharded_save(task: Task) -> dict[str, Metrics]:
    from lightning_ckpt import ShardedCheckpointIO

    checkpoint = build_checkpoint(task["size_bytes"])
    io = ShardedCheckpointIO(**_sharded_kwargs(task))
    results: dict[str, Metrics] = {}
    try:
        for key, path in zip(("first", "steady"), task["paths"]):
            results[key] = _measure(lambda path=path: io.save_checkpoint(checkpoint, path))
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
    layout = model_layout(task["size_bytes"] // 3)
    params = {name: torch.zeros(shape) for name, shape in layout}
    opt_state = {
        i: {"step": torch.zeros(()), "exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape)}
        for i, (_, shape) in enumerate(layout)
    }
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
        copied = 0
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(checkpoint["state_dict"][name])
                copied += 1
            for index, saved in checkpoint["optimizer_states"][0]["state"].items():
                for key, value in saved.items():
                    opt_state[index][key].copy_(value)
                    copied += 1
        phases["tensors_copied"] = copied
        return checkpoint

    result = _measure(load)
    if phases["tensors_copied"] != 4 * len(layout):
        raise RuntimeError(f"copied {phases['tensors_copied']} tensors, expected {4 * len(layout)}")
    return {**result, **phases}


def _run_task(task: Task) -> Any:
    kind = task["kind"]
    if kind == "plain_buffered":
        return _plain_buffered(task["path"], task["nbytes"])
    if kind == "plain_direct":
        return _plain_direct(task["path"], task["nbytes"])
    if kind == "torch_io_save":
        return _torch_save(task)
    if kind == "sharded_io_save":
        return _sharded_save(task)
    if kind == "torch_io_load":
        return _load(task, "torch_io")
    if kind == "sharded_io_load":
        return _load(task, "sharded_io")
    raise ValueError(f"unknown task {kind!r}")


def _child(task: Task, conn: Connection, runner: Callable[[Task], Any] | None = None) -> None:
    """Entry point of a measurement subprocess: run one task, send its metrics (or the error) back."""
    warnings.simplefilter("ignore")
    try:
        result: Any = {"ok": (runner or _run_task)(task)}
    except BaseException as err:  # reported to the parent, which records it and goes on
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    finally:
        if task["kind"].startswith("plain_") and "path" in task:
            remove_path(task["path"])
    conn.send(result)
    conn.close()


# ----------------------------------------------------------------------------------------------
# Parent side


def run_in_fresh_process(task: Task, runner: Callable[[Task], Any] | None = None) -> Any:
    """Run ``task`` in a new ``spawn`` process; raise ``RuntimeError`` with the child's error.

    ``runner`` (a module-level function, so the child can import it) runs the task; default: this
    module's save/load measurements.
    """
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(task, sender, runner), name=f"lightning_ckpt-bench-{task['kind']}")
    process.start()
    sender.close()
    try:
        reply = receiver.recv()
    except EOFError:
        process.join()
        raise RuntimeError(
            f"{task['kind']}: the measurement process died (exit code {process.exitcode}; -9 is usually the OOM killer)"
        ) from None
    finally:
        receiver.close()
    process.join()
    if "error" in reply:
        raise RuntimeError(f"{task['kind']}: {reply['error']}\n{reply['traceback']}")
    return reply["ok"]


def _version(package: str) -> str | None:
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return None


def filesystem_of(path: str) -> dict[str, str] | None:
    """The /proc/mounts entry (longest mount point prefix) holding ``path``."""
    path = os.path.realpath(path)
    best: dict[str, str] | None = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) >= len(best["mount_point"])):
                    best = {"device": parts[0], "mount_point": mount, "type": parts[2], "options": parts[3]}
    except OSError:
        return None
    return best


def machine_info(directory: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": None,
        "total_ram_gb": None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "lightning": _version("lightning"),
        "lightning_ckpt": _version("lightning-ckpt"),
        "filesystem": filesystem_of(directory),
        "tmp_filesystem": filesystem_of(tempfile.gettempdir()),
    }
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["total_ram_gb"] = int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def _summary(runs: list[Metrics]) -> Metrics:
    """Per metric: median and individual values over the repeats (non-numeric: the first value).

    ``None`` values (a metric a repeat could not measure) are left out of the median.
    """
    summary: Metrics = {}
    for key in runs[0] if runs else ():
        values = [run.get(key) for run in runs]
        numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numeric and len(numeric) == len([v for v in values if v is not None]):
            summary[key] = {"median": statistics.median(numeric), "values": values}
        else:
            summary[key] = values[0]
    return summary


def _median(op: Metrics | None, key: str) -> float | None:
    if not op or not isinstance(op.get(key), dict):
        return None
    value = op[key]["median"]
    return float(value) if value is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


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
            return run_in_fresh_process(task)
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

    ops = {key: _summary(values) if values else None for key, values in runs.items()}
    plain = [g for g in (_median(ops["plain_buffered"], "GBps"), _median(ops["plain_direct"], "GBps")) if g]
    best_plain = max(plain) if plain else None
    for key in ("torch_io_save", "sharded_io_save_first", "sharded_io_save_steady"):
        if ops[key] and best_plain:
            values = [v / best_plain for v in ops[key]["GBps"]["values"]]
            ops[key]["vs_plain"] = {"median": statistics.median(values), "values": values}

    torch_save, torch_load = ops["torch_io_save"], ops["torch_io_load"]
    steady, first, ours_load = ops["sharded_io_save_steady"], ops["sharded_io_save_first"], ops["sharded_io_load"]
    ratios = {
        "save_seconds": _ratio(_median(steady, "seconds"), _median(torch_save, "seconds")),
        "save_seconds_first": _ratio(_median(first, "seconds"), _median(torch_save, "seconds")),
        "save_peak_rss": _ratio(_median(steady, "peak_rss_mb"), _median(torch_save, "peak_rss_mb")),
        "save_peak_rss_first": _ratio(_median(first, "peak_rss_mb"), _median(torch_save, "peak_rss_mb")),
        "load_seconds": _ratio(_median(ours_load, "seconds"), _median(torch_load, "seconds")),
        "load_peak_rss": _ratio(_median(ours_load, "peak_rss_mb"), _median(torch_load, "peak_rss_mb")),
        "load_peak_rss_anon": _ratio(_median(ours_load, "peak_rss_anon_mb"), _median(torch_load, "peak_rss_anon_mb")),
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


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


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
                _fmt(_median(op, "seconds"), 3),
                _fmt(_median(op, "GBps")),
                _fmt(_median(op, "vs_plain")),
                _fmt(_median(op, "peak_rss_mb"), 0),
                _fmt(_median(op, "peak_rss_anon_mb"), 0),
                _fmt(r_time),
                _fmt(r_rss),
                _fmt(r_anon),
            )
        table.add_section()
    return table


def _parse_sizes(text: str) -> list[tuple[str, int]]:
    from lightning_ckpt.plan import parse_size

    sizes = []
    for item in text.split(","):
        if item.strip():
            sizes.append((item.strip(), parse_size(item.strip(), "--sizes")))
    if not sizes:
        raise ValueError("`--sizes` is empty; give e.g. '0.5GB,3GB'.")
    return sizes


MODES = ("save", "async", "activations")


def split_mode(argv: list[str]) -> tuple[str, list[str]]:
    """``--mode save|async|activations`` (default ``save``) and the other arguments."""
    mode_parser = argparse.ArgumentParser(add_help=False)
    mode_parser.add_argument("--mode", choices=MODES, default="save")
    known, rest = mode_parser.parse_known_args(argv)
    return known.mode, rest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning_ckpt bench",
        description="Benchmark ShardedCheckpointIO against TorchCheckpointIO and a plain sequential write.",
        epilog="`--mode async` runs the training-loop benchmark of async saves instead (`--mode async --help`).",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="save",
        help="save: save/load throughput and memory (default); async: stalls of a simulated training loop;"
        " activations: activation checkpointing memory and step time (`--mode activations --help`)",
    )
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


@contextlib.contextmanager
def run_directory(directory: str) -> Iterator[str]:
    """A fresh ``run-*`` folder under ``directory``; removed afterwards with every folder this made."""
    created = []  # folders this run made, innermost first; removed again if left empty
    folder = directory
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(directory, exist_ok=True)
    run_dir = os.path.join(directory, f"run-{os.getpid()}-{secrets.token_hex(3)}")
    os.makedirs(run_dir)
    try:
        yield run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        for folder in created:
            try:
                os.rmdir(folder)
            except OSError:
                break


def stderr_logger() -> Callable[[str], None]:
    """``log(message)``: a timestamped progress line on stderr."""
    from rich.console import Console

    err_console = Console(stderr=True)

    def log(message: str) -> None:
        err_console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}", highlight=False)

    return log


def report_header(argv: list[str] | None, started: float) -> dict[str, Any]:
    """The command line and timing fields every report starts with."""
    return {
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_seconds": time.time() - started,
    }


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """``--json [PATH]``: the results JSON only when asked for; ``--json`` or ``--json -`` is stdout."""
    parser.add_argument(
        "--json",
        dest="json_path",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="also write the results JSON (every run's values, the machine, the command) to PATH;"
        " `--json` alone or `--json -` prints it on stdout instead (the table then goes to stderr)",
    )


def emit_report(table: Any, report: dict[str, Any], json_path: str | None) -> None:
    """Print the rich table; the JSON only when ``json_path`` asks for it.

    ``json_path``: ``None`` (the table alone, on stdout), ``"-"`` (the JSON document alone on
    stdout, so it can be piped; the table on stderr), or a file to write the JSON to.
    """
    from rich.console import Console

    to_stdout = json_path == "-"
    console = Console(stderr=to_stdout)
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(stderr=to_stdout, width=170)
    console.print(table)
    if json_path is None:
        return
    text = json.dumps(report, indent=2)
    if to_stdout:
        print(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        f.write(text + "\n")
    Console(stderr=True).print(f"[dim]results JSON written to {json_path}[/dim]", highlight=False)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table (and the JSON with ``--json``). Returns 0, or 1 if any measurement failed.

    ``--mode async`` hands the other arguments to :func:`lightning_ckpt.bench_async.main`.
    """
    mode, rest = split_mode(list(sys.argv[1:] if argv is None else argv))
    if mode == "async":
        from lightning_ckpt import bench_async

        return bench_async.main(rest)
    if mode == "activations":
        from lightning_ckpt import bench_activations

        return bench_activations.main(rest)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sizes = _parse_sizes(args.sizes)
        if args.max_shard_size is not None:
            from lightning_ckpt.plan import parse_size

            parse_size(args.max_shard_size, "--max-shard-size")
    except ValueError as err:
        parser.error(str(err))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    from lightning_ckpt.io import DEFAULT_MAX_SHARD_SIZE

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


if __name__ == "__main__":
    sys.exit(main())
