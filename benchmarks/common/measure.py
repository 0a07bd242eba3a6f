"""Measurement beyond the package's lean core (``lightning_ckpt.bench.measure``) that only the research
modes use: system memory readings (``/proc/meminfo``, ``/dev/shm``), the p95 of a series, measurement
processes started with environment variables of their own, and :func:`run_grid`, a grid of
scenarios x variants each run in a fresh process."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import statistics
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from lightning_ckpt.bench.measure import MB, Task, parse_status, proc_status, run_child, run_in_fresh_process, summarize


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


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=20, method="inclusive")[18]


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


def run_in_spawned_process(task: Task, runner: Callable[[Task], Any], env: dict[str, str]) -> Any:
    """``run_in_fresh_process`` in a freshly ``spawn``-ed interpreter with ``env`` set from its very
    start (glibc's ``MALLOC_*`` tunables are read once, at start-up): a process forked from the
    fresh-process server would run with the server's."""
    environ = {**os.environ, **env}
    with environment(env):  # a spawned interpreter takes its environment from this process
        return run_child(multiprocessing.get_context("spawn"), task, runner, environ)


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
