"""Measurement, one way for every mode (``benchmarks/`` too): fresh measurement processes, timing,
RSS readings, and the statistics of repeated runs. ``GB`` = 1e9 bytes, ``MB`` = 1e6 bytes."""

from __future__ import annotations

import gc
import multiprocessing
import os
import statistics
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

GB = 10**9
MB = 10**6
# VmHWM gives the exact VmRSS peak; sampling (for RssAnon) stays light so it does not perturb what it measures
SAMPLE_INTERVAL_S = 0.02

Task = dict[str, Any]
Metrics = dict[str, Any]


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
    """Samples ``VmRSS`` and ``RssAnon`` of this process every 20 ms; also resets and reads ``VmHWM``.
    Invariant: ``peak`` >= ``baseline`` (both start at the reading taken on ``__enter__``)."""

    def __init__(self, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.interval = interval
        self._fd = os.open("/proc/self/status", os.O_RDONLY)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self.baseline = self.peak = (0, 0)
        self.hwm = 0
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


def measure(operation: Callable[[], Any]) -> Metrics:
    """Time ``operation`` and record its peak RSS over the baseline; its result lives until the end."""
    gc.collect()
    with RssSampler() as sampler:
        start = time.perf_counter()
        result = operation()
        seconds = time.perf_counter() - start
    del result
    return {"seconds": seconds, **sampler.metrics()}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: list[Metrics]) -> Metrics | None:
    """Per metric: median and individual values over the repeats (non-numeric: the first value);
    ``None`` values (a metric a repeat could not measure) are left out of the median."""
    if not runs:
        return None
    result: Metrics = {}
    for key in runs[0]:
        values = [run.get(key) for run in runs]
        numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numeric and len(numeric) == len([v for v in values if v is not None]):
            result[key] = {"median": statistics.median(numeric), "values": values}
        else:
            result[key] = values[0]
    return result


def m(summarized: Metrics | None, key: str) -> float | None:
    """The median of ``key`` in a :func:`summary` (``None`` where absent or not numeric)."""
    if not summarized or not isinstance(summarized.get(key), dict):
        return None
    value = summarized[key]["median"]
    return float(value) if value is not None else None


# What the fresh-process server imports once, so a measurement process starts in a fraction of a
# second instead of importing torch and Lightning again (seconds each). None of it touches CUDA, so
# the processes forked from the server can initialise it. A module missing here is skipped.
PRELOAD = [
    "torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "lightning.pytorch",
    "lightning.fabric.strategies.model_parallel", "lightning_ckpt.lightning.plugin", "lightning_ckpt.format.dcp",
    "lightning_ckpt.bench.measure",
]  # fmt: skip


def fresh_process_context() -> Any:
    """The ``forkserver`` context whose server (one per parent, started on first use) has imported
    :data:`PRELOAD`: its children are fresh processes without the import time of a ``spawn``."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _child(task: Task, conn: Connection, runner: Callable[[Task], Any], environ: dict[str, str]) -> None:
    """Entry point of a measurement subprocess: run one task, send its metrics (or the error) back."""
    # a forkserver child inherits the server's environment, not the caller's current one
    os.environ.clear()
    os.environ.update(environ)
    warnings.simplefilter("ignore")
    try:
        result: Any = {"ok": runner(task)}
    except BaseException as err:  # reported to the parent, which records it and goes on
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    conn.send(result)
    conn.close()


def run_in_fresh_process(task: Task, runner: Callable[[Task], Any]) -> Any:
    """Run ``runner(task)`` (a module-level function) in a fresh process, so that RSS and device
    memory start clean, with this process's ``os.environ``; raise ``RuntimeError`` with the child's
    error. ``task["kind"]`` names the measurement in process titles and errors."""
    return run_child(fresh_process_context(), task, runner, dict(os.environ))


def run_child(context: Any, task: Task, runner: Callable[[Task], Any], environ: dict[str, str]) -> Any:
    """``runner(task)`` in a process of the multiprocessing ``context`` with ``environ`` as its environment."""
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(task, sender, runner, environ), name=f"lightning_ckpt-bench-{task['kind']}")
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
