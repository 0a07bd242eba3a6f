"""Measurement, one way for every mode: fresh measurement processes, timing, RSS and memory
readings, and the statistics (medians, p95, ratios, per-metric summaries) of repeated runs.

Units: ``GB`` = 1e9 bytes, ``MB`` = 1e6 bytes; ``*_mb`` figures are in MB.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import shutil
import statistics
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

GB = 10**9
MB = 10**6
# VmHWM gives the exact VmRSS peak; sampling (for RssAnon) stays light so it does not perturb what it measures
SAMPLE_INTERVAL_S = 0.02

Task = dict[str, Any]
Metrics = dict[str, Any]


# ----------------------------------------------------------------------------------------------
# Memory readings (Linux /proc)


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


def meminfo() -> dict[str, int]:
    """``parse_status`` of /proc/meminfo (empty where it cannot be read)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            return parse_status(f.read())
    except OSError:
        return {}


def dev_shm_used() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").used
    except OSError:
        return None


def memory_snapshot() -> dict[str, int | None]:
    """This process's RSS, RssAnon and RssShmem, /dev/shm usage and the system's ``Shmem`` (bytes)."""
    status, system = proc_status(), meminfo()
    return {
        "rss": status.get("VmRSS", 0),
        "anon": status.get("RssAnon", 0),
        "shmem": status.get("RssShmem", 0),
        "dev_shm": dev_shm_used(),
        "sys_shmem": system.get("Shmem"),
    }


def delta_mb(after: int | None, before: int | None) -> float | None:
    return None if after is None or before is None else (after - before) / MB


class RssSampler:
    """Samples ``VmRSS`` and ``RssAnon`` of this process every 20 ms; also resets and reads ``VmHWM``.

    Invariant: ``peak`` >= ``baseline`` (both start at the reading taken on ``__enter__``).
    """

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


# ----------------------------------------------------------------------------------------------
# Statistics


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[18]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: list[Metrics]) -> Metrics | None:
    """Per metric: median and individual values over the repeats (non-numeric: the first value).

    ``None`` values (a metric a repeat could not measure) are left out of the median; ``None``
    for no runs at all.
    """
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


# ----------------------------------------------------------------------------------------------
# Fresh measurement processes


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``values`` inside the block (children started there inherit
    it), restored afterwards."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# What the fresh-process server imports once, so a measurement process starts in a fraction of a
# second instead of importing torch and Lightning again (seconds each). None of it touches CUDA, so
# the processes forked from the server can initialise it. A module missing here is skipped.
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "lightning.pytorch",
    "lightning.fabric.strategies.model_parallel",
    "lightning_ckpt.lightning.plugin",
    "lightning_ckpt.format.dcp",
    "lightning_ckpt.bench.measure",
]


def fresh_process_context() -> Any:
    """The ``forkserver`` multiprocessing context whose server has imported :data:`PRELOAD`.

    One server per parent process, started on first use: its forked children are fresh processes
    (no state of earlier measurements) without the import time of a ``spawn``.
    """
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


def run_in_fresh_process(task: Task, runner: Callable[[Task], Any], env: dict[str, str] | None = None) -> Any:
    """Run ``runner(task)`` in a new process; raise ``RuntimeError`` with the child's error.

    ``runner`` must be a module-level function (the child imports it); ``task["kind"]`` names the
    measurement in process titles and errors. A fresh process per measurement keeps RSS and device
    memory figures clean of earlier runs. It is forked from :func:`fresh_process_context`'s server
    and runs with this process's current ``os.environ``. ``env`` adds variables that must be there
    from the process's very start (glibc's ``MALLOC_*`` tunables): with it the child is a freshly
    ``spawn``-ed interpreter instead.
    """
    environ = {**os.environ, **(env or {})}
    if env:
        context = multiprocessing.get_context("spawn")
        with environment(env):  # a spawned interpreter takes its environment from this process
            return _run_child(context, task, runner, environ)
    return _run_child(fresh_process_context(), task, runner, environ)


def _run_child(context: Any, task: Task, runner: Callable[[Task], Any], environ: dict[str, str]) -> Any:
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


def run_grid(
    repeats: int,
    scenarios: list[str],
    variants: list[str],
    task_of: Callable[[str, str, str], Task],
    runner: Callable[[Task], Any],
    log: Callable[[str], None],
    after: Callable[[str], None] = lambda tag: None,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Run ``runner(task_of(scenario, variant, tag))`` in a fresh process for every scenario and
    variant, ``repeats`` times (repeat by repeat); ``after(tag)`` follows each run, failed or
    not. Returns ``{scenario: {variant: {"summary": summarize(metrics), "runs": [...]}}}`` (each
    run's result holds its ``"metrics"``) and the failures, one line per failed run."""
    runs: dict[str, dict[str, list[Any]]] = {s: {v: [] for v in variants} for s in scenarios}
    errors: list[str] = []
    for r in range(repeats):
        for scenario in scenarios:
            for variant in variants:
                tag = f"r{r}-{scenario}-{variant}"
                log(f"[{r + 1}/{repeats}] {scenario} / {variant}")
                try:
                    runs[scenario][variant].append(run_in_fresh_process(task_of(scenario, variant, tag), runner))
                except RuntimeError as err:
                    errors.append(f"{tag}: {err}")
                    log(f"{tag} FAILED: {str(err).splitlines()[0]}")
                finally:
                    after(tag)
    summarized = {
        scenario: {
            variant: {"summary": summarize([run["metrics"] for run in variant_runs]), "runs": variant_runs}
            for variant, variant_runs in by_variant.items()
        }
        for scenario, by_variant in runs.items()
    }
    return summarized, errors
