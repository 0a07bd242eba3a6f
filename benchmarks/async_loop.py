"""Training-loop benchmark of checkpoint saves: how long a save stalls training, and what it costs
while it is written in the background.

``python -m benchmarks --mode async [...]``: the research version of the package's
``python -m lightning_ckpt bench --mode async`` (``lightning_ckpt.bench.async_loop``, whose options
it takes and adds to), with every contender below, both schedules and the memory over the saves.

Each contender runs in a fresh process (``measure.run_in_fresh_process``) that builds
the state of ``workloads.build_checkpoint`` (1/3 fp32 weights, 2/3 AdamW ``exp_avg``/``exp_avg_sq``)
and runs a simulated training loop on it. Every step does

* a fixed compute workload: ``--matmuls`` products of two 1024x1024 fp32 matrices, calibrated once
  in the parent to about ``--compute-ms`` and the same for every contender;
* an in-place update of every state tensor, ``t.lerp_(c, 1e-3)`` (one pass over the memory, the
  form of AdamW's ``exp_avg`` update), and ``step += 1`` on the optimizer step counters. It mutates
  the state right after a save returns, which is what makes snapshot semantics matter.

The checkpoint dict *is* that live state (its tensors are the ones updated), so saving it saves the
live state. The loop runs 2 untimed and ``--warmup`` timed steps without saving (the baseline step
time), then ``--saves`` saves, one every ``--every`` steps, and keeps stepping after the last save
until the contender reports it durable. ``--schedule``:

* ``after-durable`` (default): a save is due ``--every`` steps after the previous one, but not
  before the previous one is durable (the loop keeps stepping meanwhile). Stalls are then the cost
  of taking a snapshot, not of waiting for the previous write.
* ``fixed``: strictly every ``--every`` steps. What happens when the previous save is still being
  written is each contender's own policy: ShardedCheckpointIO (``when_busy="wait"``) blocks in
  ``save_checkpoint``; DCP waits for the previous future inside the save (its warm stager's buffers
  are reused, so it must); AsyncCheckpointIO queues another clone (unbounded) - a save is deferred
  only when ``MemAvailable`` falls below 2x the state + 1 GB (counted as ``memory_guard_deferrals``).

Per save: the save call's duration; its *stall* (the duration of the step holding the save call
minus the baseline median step); the time from the save call until the bytes are durable (the
contender's own completion signal); the steps that started while it was being written, and the
training time they lost (*lost while writing*: their sum minus as many baseline median steps); RSS,
RssAnon, RssShmem, /dev/shm and system ``Shmem`` right after the call. Steady state = saves 2..N.
Contenders:

* ``torch_io``: Lightning ``TorchCheckpointIO`` + an fsync of the file (durable when the call returns).
* ``async_io``: Lightning ``AsyncCheckpointIO(TorchCheckpointIO())``; the inner plugin's
  ``save_checkpoint`` is wrapped to fsync the file and record when that finished.
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` in THREAD mode (no process group) with
  one ``DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
  use_async_staging=False, use_non_blocking_copy=False))`` kept across saves (warm staging
  buffers); durable when the future completes (FileSystemWriter fsyncs its files). It saves the
  same Lightning dict (non-tensor values are pickled by DCP).
* ``dcp_sync``: ``torch.distributed.checkpoint.save`` of the same dict, no process group (durable
  when it returns: FileSystemWriter fsyncs its files).
* ``sharded_async``: ``ShardedCheckpointIO(async_save=True)``; durable = start of the save call +
  ``WriteResult.seconds`` (save call -> committed and durable, as the writer process reports it),
  from ``io.last_save`` and ``io.poll()`` between steps (never blocking).
* ``sharded_sync``: ``ShardedCheckpointIO()`` (durable when the call returns).
* ``disk_floor``: the floor for the cost of writing in the background: a helper process writes as
  many bytes as the state holds, sequentially from one reused buffer (``O_DIRECT`` where the
  filesystem takes it) and fsyncs, copying, serialising and hashing nothing and reading no training
  memory (``contenders.PlainWrite``). The steps lost while it writes are what writing those bytes
  to this disk costs the loop on this host, whatever the writer.
* ``plain_copy``: the floor for a stall: one ``copy_`` of the whole state into already-allocated,
  pre-faulted buffers (median of 3 copies).

Only the latest durable checkpoint is kept on disk while the loop runs (older ones are removed
between steps, outside any step's timing); everything is removed after each measurement.

``--device cuda`` puts the weights and moments on the GPU (the ``step`` counters stay on the CPU,
as AdamW keeps them) and runs the workload there: ``--matmul-size`` defaults to 4096 (fp32), and
every step ends with ``torch.cuda.current_stream().synchronize()`` (what a loop's ``loss.item()``
does), so a step's time includes its device work. The update runs as an ``Optimizer.step`` in
both modes, so global optimizer-step pre-hooks fire where a training loop's would. Work that a save
leaves queued on the device lands in the step after the save (ShardedCheckpointIO hands a save
whose device-to-host copies are still landing to its writer from that pre-hook): *stall + next* =
the step holding the save + the following step - 2 x the baseline median counts it (the loop stops
once the last save is durable, so a save durable when its call returns and that is the last one has
no following step and no *stall + next*). On CUDA,
``dcp_async`` uses ``StagingOptions(use_pinned_memory=True, use_shared_memory=False,
use_async_staging=False, use_non_blocking_copy=True)`` and ``plain_copy`` is one copy of the state
into already-allocated pinned host buffers (device to host). With torch < 2.13, ``DefaultStager``
can stage only once (its ``_stage`` ends by closing its ``StateDictStager``, which empties the
table of staged storages; the next stage raises ``KeyError``), so there ``dcp_async`` gets a fresh
stager per save (closed once its save completed): no warm staging buffers, a measured difference of
that torch version, recorded in the run's notes and ``settings.dcp``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.common.contenders import Contender, DcpAsync, dcp_stager_reusable, dcp_staging_options, make_contender
from benchmarks.common.measure import delta_mb, meminfo, memory_snapshot, p95
from lightning_ckpt.bench import async_loop as lean
from lightning_ckpt.bench.files import path_bytes, remove_path
from lightning_ckpt.bench.measure import GB, MB, Metrics, RssSampler, Task, m, median, proc_status, ratio, summarize
from lightning_ckpt.bench.report import emit_report, fmt, machine_info, report_header, stderr_logger
from lightning_ckpt.bench.workloads import (
    MATMUL_SIZE,
    MATMUL_SIZE_CUDA,
    UPDATE_WEIGHT,
    MatmulWorkload,
    StateUpdate,
    build_checkpoint,
    calibrate_matmuls,
    state_bytes,
    state_tensors,
)

CONTENDERS = ("torch_io", "async_io", "dcp_async", "dcp_sync", "sharded_async", "sharded_sync", "disk_floor")
REFERENCE = "plain_copy"
ALL = (*CONTENDERS, REFERENCE)
ASYNC_CONTENDERS = ("async_io", "dcp_async", "sharded_async", "disk_floor")
SCHEDULES = ("after-durable", "fixed")
DEFAULT_SIZE = "3GB"
_UNTIMED_WARMUP = 2
_CONTENDER_TITLES = {
    "torch_io": "torch_io (sync)",
    "async_io": "async_io (Lightning)",
    "dcp_async": "dcp_async (thread)",
    "dcp_sync": "dcp_sync (DCP save)",
    "sharded_async": "sharded_async",
    "sharded_sync": "sharded_sync",
    "disk_floor": "disk_floor (plain O_DIRECT write)",
}


# ----------------------------------------------------------------------------------------------
# Child side: the training loop


def _train_loop(task: Task) -> Metrics:
    device = task.get("device", "cpu")
    cuda = device == "cuda"
    checkpoint = build_checkpoint(task["size_bytes"], device)
    state, counters = state_tensors(checkpoint)
    nbytes = sum(t.numel() * t.element_size() for t in state + counters)
    workload = MatmulWorkload(task["matmul_size"], task["matmuls"], device)
    update = StateUpdate(state, torch.tensor(1e-3, device=device))

    @torch.no_grad()
    def step() -> None:
        workload()
        update.step()
        for c in counters:
            c.add_(1)
        checkpoint["global_step"] += 1
        if cuda:
            torch.cuda.current_stream().synchronize()  # as a loop's loss.item() does

    contender = make_contender(task["contender"], task["run_dir"], task.get("max_write_rate"), device)
    tag, n_saves, every, schedule = task["tag"], task["saves"], task["every"], task["schedule"]
    guard_bytes = 2 * nbytes + GB  # fixed schedule: defer a save while this much memory is not available
    saves: list[dict[str, Any]] = []
    by_path: dict[str, dict[str, Any]] = {}
    steps: list[tuple[float, float, int | None]] = []  # (start, end, index of the save it holds)
    durable_on_disk: list[str] = []
    removal_seconds = 0.0
    deferred_steps = guard_deferrals = 0
    try:
        for _ in range(_UNTIMED_WARMUP):
            step()
        baseline_steps = []
        for _ in range(task["warmup"]):
            start = time.perf_counter()
            step()
            baseline_steps.append(time.perf_counter() - start)
        base_median, base_p95 = statistics.median(baseline_steps), p95(baseline_steps)
        gc.collect()
        before = memory_snapshot()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            cuda_before = torch.cuda.memory_allocated()
        deadline = time.perf_counter() + task["timeout_s"]
        with RssSampler() as sampler:
            since = 0
            while True:
                for path, at in contender.poll():
                    record = by_path[path]
                    record["durable_at"] = at
                    # keep only the latest durable checkpoint on disk (removed between steps, untimed)
                    start = time.perf_counter()
                    for old in durable_on_disk:
                        remove_path(old)
                    removal_seconds += time.perf_counter() - start
                    durable_on_disk = [path]
                if len(saves) >= n_saves and not contender.pending():
                    break
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"{task['contender']}: {len(saves)}/{n_saves} saves, durable:"
                        f" {sum('durable_at' in s for s in saves)}, after {task['timeout_s']} s (--timeout)"
                    )
                since += 1
                due = len(saves) < n_saves and since >= every
                previous_in_flight = contender.pending()
                if due and previous_in_flight:
                    if schedule == "after-durable":
                        due = False
                        deferred_steps += 1
                    elif meminfo().get("MemAvailable", guard_bytes) < guard_bytes:
                        due = False
                        guard_deferrals += 1
                start = time.perf_counter()
                step()
                if not due:
                    steps.append((start, time.perf_counter(), None))
                    continue
                path = os.path.abspath(os.path.join(task["run_dir"], f"{tag}-save{len(saves) + 1}.ckpt"))
                call_start = time.perf_counter()
                contender.save(checkpoint, path)
                call_end = time.perf_counter()
                steps.append((start, call_end, len(saves)))
                memory = memory_snapshot()
                record = {
                    "index": len(saves) + 1,
                    "path": path,
                    "step_start": start,
                    "call_start": call_start,
                    "call_end": call_end,
                    "previous_in_flight": previous_in_flight,
                    "memory": memory,
                }
                saves.append(record)
                by_path[path] = record
                since = 0
            loop_end = time.perf_counter()
            end_memory = memory_snapshot()
            cuda_peak_extra_mb = (torch.cuda.max_memory_allocated() - cuda_before) / MB if cuda else None
            helpers = {pid: proc_status(pid) for pid in contender.helper_pids()}
        helper_pids = contender.helper_pids()
    finally:
        teardown_start = time.perf_counter()
        try:
            contender.teardown()
        finally:
            teardown_seconds = time.perf_counter() - teardown_start
            bytes_on_disk = path_bytes(durable_on_disk[-1]) if durable_on_disk else None
            for record in saves:
                remove_path(record["path"])
    after_teardown = memory_snapshot()
    helpers_alive = [pid for pid in helper_pids if os.path.exists(f"/proc/{pid}")]
    return _loop_metrics(
        contender,
        task,
        nbytes,
        base_median,
        base_p95 if base_p95 is not None else base_median,
        saves,
        steps,
        before,
        end_memory,
        after_teardown,
        sampler.metrics(),
        helpers,
        helpers_alive,
        extra={
            "teardown_seconds": teardown_seconds,
            "baseline_steps": len(baseline_steps),
            "loop_seconds": loop_end - saves[0]["step_start"] if saves else None,
            "steps_after_warmup": len(steps),
            "deferred_steps": deferred_steps,
            "memory_guard_deferrals": guard_deferrals,
            "removal_seconds": removal_seconds,
            "bytes_on_disk": bytes_on_disk,
            "cuda_peak_extra_mb": cuda_peak_extra_mb,
        },
    )


def _loop_metrics(
    contender: Contender,
    task: Task,
    nbytes: int,
    base_median: float,
    base_p95: float,
    saves: list[dict[str, Any]],
    steps: list[tuple[float, float, int | None]],
    before: dict[str, int | None],
    end_memory: dict[str, int | None],
    after_teardown: dict[str, int | None],
    peak: Metrics,
    helpers: dict[int, dict[str, int]],
    helpers_alive: list[int],
    extra: Metrics,
) -> Metrics:
    """Per-save records and the scalar metrics of one training-loop run."""
    windows = [(s["call_end"], s["durable_at"]) for s in saves] if contender.asynchronous else []
    writing: list[float] = []  # steps that started while any save was being written
    writing_steady: list[float] = []  # ... while only saves 2..N were (not the first one)
    idle: list[float] = []
    per_save_writing: list[list[float]] = [[] for _ in saves]
    origin = saves[0]["step_start"] if saves else 0.0
    trace = []  # (start relative to the first save's step, duration, "S<n>" save step | "W" writing | "-")
    next_step: dict[int, float] = {}  # save index -> duration of the step right after the save's step
    after: int | None = None
    for start, end, held in steps:
        if after is not None:
            next_step[after] = end - start
        after = held
        if held is not None:
            trace.append((round(start - origin, 4), round(end - start, 4), f"S{held + 1}"))
            continue
        inside = [i for i, (lo, hi) in enumerate(windows) if lo <= start < hi]
        (writing if inside else idle).append(end - start)
        if inside and 0 not in inside:
            writing_steady.append(end - start)
        for i in inside:
            per_save_writing[i].append(end - start)
        trace.append((round(start - origin, 4), round(end - start, 4), "W" if inside else "-"))

    records = []
    for i, s in enumerate(saves):
        memory = s["memory"]
        step_seconds = s["call_end"] - s["step_start"]
        following = next_step.get(i)
        records.append(
            {
                "index": s["index"],
                "call_seconds": s["call_end"] - s["call_start"],
                "step_seconds": step_seconds,
                "stall_seconds": step_seconds - base_median,
                "next_step_seconds": following,
                "stall_with_next_seconds": None if following is None else step_seconds + following - 2 * base_median,
                "durable_seconds": s["durable_at"] - s["call_start"],
                "previous_in_flight": s["previous_in_flight"],
                "steps_while_writing": len(per_save_writing[i]),
                # training time the write cost: the steps while writing, over the baseline median
                "excess_while_writing_seconds": sum(d - base_median for d in per_save_writing[i]),
                "step_while_writing_median_seconds": median(per_save_writing[i]),
                "rss_mb": memory["rss"] / MB,
                "rss_delta_mb": delta_mb(memory["rss"], before["rss"]),
                "rss_anon_delta_mb": delta_mb(memory["anon"], before["anon"]),
                "rss_shmem_delta_mb": delta_mb(memory["shmem"], before["shmem"]),
                "dev_shm_delta_mb": delta_mb(memory["dev_shm"], before["dev_shm"]),
                "sys_shmem_delta_mb": delta_mb(memory["sys_shmem"], before["sys_shmem"]),
            }
        )
    first, steady = records[:1], records[1:]

    def pick(rows: list[dict[str, Any]], key: str) -> list[float]:
        return [row[key] for row in rows]

    post_save_rss = pick(steady, "rss_mb")
    writing_median, writing_p95 = median(writing), p95(writing)
    helper_status = {
        str(pid): {
            "rss_mb": status.get("VmRSS", 0) / MB,
            "rss_anon_mb": status.get("RssAnon", 0) / MB,
            "rss_shmem_mb": status.get("RssShmem", 0) / MB,
        }
        for pid, status in helpers.items()
    }
    metrics: Metrics = {
        "state_bytes": nbytes,
        "baseline_step_median_seconds": base_median,
        "baseline_step_p95_seconds": base_p95,
        "saves": len(records),
        "stall_first_seconds": first[0]["stall_seconds"] if first else None,
        "stall_steady_median_seconds": median(pick(steady, "stall_seconds")),
        "stall_steady_max_seconds": max(pick(steady, "stall_seconds"), default=None),
        "stall_with_next_first_seconds": first[0]["stall_with_next_seconds"] if first else None,
        "stall_with_next_steady_median_seconds": median(
            [v for v in pick(steady, "stall_with_next_seconds") if v is not None]
        ),
        "call_first_seconds": first[0]["call_seconds"] if first else None,
        "call_steady_median_seconds": median(pick(steady, "call_seconds")),
        "durable_first_seconds": first[0]["durable_seconds"] if first else None,
        "durable_steady_median_seconds": median(pick(steady, "durable_seconds")),
        "durable_median_seconds": median(pick(records, "durable_seconds")),
        "steps_while_writing": len(writing),
        "excess_while_writing_steady_median_seconds": median(pick(steady, "excess_while_writing_seconds")),
        "step_while_writing_median_seconds": writing_median,
        "step_while_writing_p95_seconds": writing_p95,
        "step_while_writing_median_ratio": ratio(writing_median, base_median),
        "step_while_writing_p95_ratio": ratio(writing_p95, base_p95),
        "steps_while_writing_steady": len(writing_steady),
        "step_while_writing_steady_median_ratio": ratio(median(writing_steady), base_median),
        "step_while_writing_steady_p95_ratio": ratio(p95(writing_steady), base_p95),
        "step_idle_median_ratio": ratio(median(idle), base_median),
        "baseline_rss_mb": before["rss"] / MB if before["rss"] is not None else None,
        "rss_flat_range_mb": max(post_save_rss) - min(post_save_rss) if post_save_rss else None,
        "rss_growth_mb": records[-1]["rss_delta_mb"] if records else None,
        "rss_anon_growth_mb": records[-1]["rss_anon_delta_mb"] if records else None,
        "rss_end_delta_mb": delta_mb(end_memory["rss"], before["rss"]),
        "rss_anon_end_delta_mb": delta_mb(end_memory["anon"], before["anon"]),
        "rss_shmem_end_delta_mb": delta_mb(end_memory["shmem"], before["shmem"]),
        "rss_after_teardown_delta_mb": delta_mb(after_teardown["rss"], before["rss"]),
        "peak_rss_mb": peak["peak_rss_mb"],
        "peak_rss_anon_mb": peak["peak_rss_anon_mb"],
        "peak_hwm_mb": peak["peak_hwm_mb"],
        "dev_shm_max_delta_mb": max((r["dev_shm_delta_mb"] for r in records if r["dev_shm_delta_mb"] is not None), default=None),
        "dev_shm_end_delta_mb": delta_mb(end_memory["dev_shm"], before["dev_shm"]),
        "sys_shmem_max_delta_mb": max(
            (r["sys_shmem_delta_mb"] for r in records if r["sys_shmem_delta_mb"] is not None), default=None
        ),
        "helper_rss_mb": sum(h["rss_mb"] for h in helper_status.values()) if helper_status else None,
        "helper_rss_anon_mb": sum(h["rss_anon_mb"] for h in helper_status.values()) if helper_status else None,
        **extra,
    }
    notes = list(contender.notes)
    if isinstance(contender, DcpAsync) and contender.waits:
        notes.append(f"waited for the previous DCP save before {len(contender.waits)} saves ({sum(contender.waits):.2f} s)")
        metrics["dcp_waited_for_previous_seconds"] = sum(contender.waits)
    if helpers_alive:
        notes.append(f"helper processes still alive after teardown: {helpers_alive}")
    return {
        "metrics": metrics,
        "per_save": records,
        "helpers": helper_status,
        "helpers_alive_after_teardown": helpers_alive,
        "notes": notes,
        "step_trace": trace,
    }


def _plain_copy(task: Task) -> Metrics:
    """One ``copy_`` of the whole state into already-allocated, pre-faulted buffers: a stall's floor.

    On CUDA the buffers are page-locked host memory (a device-to-host snapshot's floor).
    """
    cuda = task.get("device", "cpu") == "cuda"
    checkpoint = build_checkpoint(task["size_bytes"], task.get("device", "cpu"))
    state, counters = state_tensors(checkpoint)
    tensors = state + counters
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if cuda:
        buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    else:
        buffers = [torch.empty_like(t) for t in tensors]
    for b in buffers:
        b.fill_(0)  # fault every page in
    seconds = []
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    mid = statistics.median(seconds)
    return {"metrics": {"state_bytes": nbytes, "seconds": mid, "GBps": nbytes / mid / GB}, "copies_seconds": seconds}


def _run_task(task: Task) -> Metrics:
    """Runner of ``run_in_fresh_process`` for this module's measurements."""
    if task["kind"] == "async_loop":
        return _train_loop(task)
    if task["kind"] == "copy_floor":
        return _plain_copy(task)
    raise ValueError(f"unknown task {task['kind']!r}")


# ----------------------------------------------------------------------------------------------
# Parent side


def render_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    results = report["results"]
    settings = report["settings"]
    table = Table(
        title=(
            f"lightning_ckpt async benchmark: training loop on {settings.get('device', 'cpu')}, state"
            f" {results['state_bytes'] / GB:.3g} GB,"
            f" {settings['saves']} saves every {settings['every']} steps ({settings['schedule']}), medians"
            f" of {settings['repeats']}"
        ),
        caption=(
            "stall = step holding the save - baseline median step; stall+next = that step + the next one -"
            " 2 x baseline median; durable = save call -> bytes durable; teardown = the contender's teardown after the loop;"
            " writing = steps started while saves 2..N were being written, x baseline median / p95"
            " (p95 x all: saves 1..N); lost writing = those steps' time over as many baseline median steps;"
            " RSS flat = max-min post-save RSS over saves 2..N"
        ),
    )
    columns = (
        "contender",
        "stall 1st s",
        "stall steady s",
        "x torch_io",
        "stall+next steady s",
        "call steady s",
        "durable s",
        "teardown s",
        "writing med x",
        "p95 x",
        "lost writing s",
        "p95 x all",
        "RSS flat MB",
        "RSS growth MB",
        "peak ΔRSS MB",
        "/dev/shm MB",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "contender" else "right", no_wrap=column == "contender")
    ratios = results["ratios"]
    for name, entry in results["contenders"].items():
        summary = entry["summary"]
        if summary is None:
            table.add_row(_CONTENDER_TITLES.get(name, name), "error", *["-"] * (len(columns) - 2))
            continue
        durable = m(summary, "durable_steady_median_seconds")
        if durable is None:
            durable = m(summary, "durable_median_seconds")
        table.add_row(
            _CONTENDER_TITLES.get(name, name),
            fmt(m(summary, "stall_first_seconds"), 3),
            fmt(m(summary, "stall_steady_median_seconds"), 3),
            fmt(ratios["stall_steady_vs_torch_io"].get(name), 3),
            fmt(m(summary, "stall_with_next_steady_median_seconds"), 3),
            fmt(m(summary, "call_steady_median_seconds"), 3),
            fmt(durable, 3),
            fmt(m(summary, "teardown_seconds"), 3),
            fmt(m(summary, "step_while_writing_steady_median_ratio")),
            fmt(m(summary, "step_while_writing_steady_p95_ratio")),
            fmt(m(summary, "excess_while_writing_steady_median_seconds"), 2),
            fmt(m(summary, "step_while_writing_p95_ratio")),
            fmt(m(summary, "rss_flat_range_mb"), 0),
            fmt(m(summary, "rss_growth_mb"), 0),
            fmt(m(summary, "peak_rss_mb"), 0),
            fmt(m(summary, "dev_shm_max_delta_mb"), 0),
        )
    copy = results.get("plain_copy")
    if copy is not None:
        table.add_section()
        summary = copy["summary"]
        seconds = m(summary, "seconds") if summary else None
        label = "plain copy_ to pinned host" if settings.get("device") == "cuda" else "plain copy_"
        table.add_row(
            f"{label} (floor, {m(summary, 'GBps') or 0:.1f} GB/s)" if summary else f"{label} (error)",
            "",
            fmt(seconds, 3),
            fmt(ratios.get("plain_copy_vs_torch_io_stall"), 3),
            *[""] * (len(columns) - 4),
        )
    return table


def _plus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _ratios(contenders: dict[str, Metrics], copy: Metrics | None) -> Metrics:
    def summary(name: str) -> Metrics | None:
        entry = contenders.get(name)
        return entry["summary"] if entry else None

    torch_io = summary("torch_io")
    ratios: Metrics = {
        "stall_first_vs_torch_io": {},
        "stall_steady_vs_torch_io": {},
        "stall_with_next_steady_vs_torch_io": {},
        "call_steady_vs_torch_io": {},
    }
    for name in contenders:
        s = summary(name)
        ratios["stall_first_vs_torch_io"][name] = ratio(m(s, "stall_first_seconds"), m(torch_io, "stall_first_seconds"))
        ratios["stall_steady_vs_torch_io"][name] = ratio(
            m(s, "stall_steady_median_seconds"), m(torch_io, "stall_steady_median_seconds")
        )
        ratios["stall_with_next_steady_vs_torch_io"][name] = ratio(
            m(s, "stall_with_next_steady_median_seconds"), m(torch_io, "stall_with_next_steady_median_seconds")
        )
        ratios["call_steady_vs_torch_io"][name] = ratio(
            m(s, "call_steady_median_seconds"), m(torch_io, "call_steady_median_seconds")
        )
    ours, dcp = summary("sharded_async"), summary("dcp_async")
    ratios["sharded_async_vs_dcp_async"] = {
        "durable_first": ratio(m(ours, "durable_first_seconds"), m(dcp, "durable_first_seconds")),
        "durable_steady": ratio(m(ours, "durable_steady_median_seconds"), m(dcp, "durable_steady_median_seconds")),
        "stall_first": ratio(m(ours, "stall_first_seconds"), m(dcp, "stall_first_seconds")),
        "stall_steady": ratio(m(ours, "stall_steady_median_seconds"), m(dcp, "stall_steady_median_seconds")),
        "stall_with_next_steady": ratio(
            m(ours, "stall_with_next_steady_median_seconds"), m(dcp, "stall_with_next_steady_median_seconds")
        ),
        "peak_rss": ratio(m(ours, "peak_rss_mb"), m(dcp, "peak_rss_mb")),
    }
    dcp_sync = summary("dcp_sync")
    ratios["sharded_async_vs_dcp_sync"] = {
        "durable_steady": ratio(m(ours, "durable_steady_median_seconds"), m(dcp_sync, "durable_steady_median_seconds")),
        # the last save's durable time plus the teardown that follows it (what a run's end waits for)
        "durable_steady_plus_teardown": ratio(
            _plus(m(ours, "durable_steady_median_seconds"), m(ours, "teardown_seconds")),
            _plus(m(dcp_sync, "durable_steady_median_seconds"), m(dcp_sync, "teardown_seconds")),
        ),
    }
    floor = summary("disk_floor")
    ratios["sharded_async_vs_disk_floor"] = {  # against the cheapest writer of the same bytes
        "durable_steady": ratio(m(ours, "durable_steady_median_seconds"), m(floor, "durable_steady_median_seconds")),
        "step_while_writing_steady_median": ratio(
            m(ours, "step_while_writing_steady_median_ratio"), m(floor, "step_while_writing_steady_median_ratio")
        ),
        "step_while_writing_steady_p95": ratio(
            m(ours, "step_while_writing_steady_p95_ratio"), m(floor, "step_while_writing_steady_p95_ratio")
        ),
        "lost_while_writing_steady": ratio(
            m(ours, "excess_while_writing_steady_median_seconds"), m(floor, "excess_while_writing_steady_median_seconds")
        ),
    }
    copy_summary = copy["summary"] if copy else None
    ratios["plain_copy_vs_torch_io_stall"] = ratio(m(copy_summary, "seconds"), m(torch_io, "stall_steady_median_seconds"))
    ratios["stall_steady_vs_plain_copy"] = {
        name: ratio(m(summary(name), "stall_steady_median_seconds"), m(copy_summary, "seconds")) for name in contenders
    }
    return ratios


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks --mode async",
        description=(
            "Training-loop benchmark of checkpoint saves: stall per save, time until durable, step slowdown"
            " while writing, memory over repeated saves. Each contender runs in a fresh process."
        ),
    )
    lean.add_options(parser, ALL, DEFAULT_SIZE)  # --device cuda: see the module docstring
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="after-durable",
        help="after-durable: a save is due --every steps after the previous one, and not before that one is"
        " durable (default); fixed: strictly every --every steps, each contender's policy when busy",
    )
    parser.add_argument("--matmuls", type=int, default=None, help="matmuls per step (overrides --compute-ms)")
    parser.add_argument(
        "--matmul-size",
        type=int,
        default=None,
        help=f"n of the n x n fp32 matmuls of the workload (default {MATMUL_SIZE}; {MATMUL_SIZE_CUDA} with --device cuda)",
    )
    parser.add_argument(
        "--max-write-rate", default=None, help="ShardedCheckpointIO(max_write_rate=...) for sharded_async, e.g. 1GB (per second)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the async benchmark; print a table (and the JSON with ``--json``). Returns 0, 1 if a measurement failed, 2 on bad setup."""
    parser = build_parser()
    args = parser.parse_args(argv)
    size_bytes, names = lean.check_options(parser, args, ALL)
    if args.matmuls is not None and args.matmuls < 0:
        parser.error("--matmuls must be >= 0")
    matmul_size = args.matmul_size or (MATMUL_SIZE_CUDA if args.device == "cuda" else MATMUL_SIZE)
    if matmul_size < 1:
        parser.error("--matmul-size must be at least 1")

    log = stderr_logger()
    directory = os.path.abspath(args.dir)
    nbytes, n_tensors = state_bytes(size_bytes)
    if args.matmuls is not None:
        matmuls, one_ms = args.matmuls, None
    else:
        matmuls, one_ms = calibrate_matmuls(args.compute_ms, matmul_size, args.device)
    log(
        f"state {nbytes / GB:.3g} GB in {n_tensors} tensors on {args.device}; compute workload {matmuls} x"
        f" {matmul_size}^2 matmuls per step"
    )
    machine = machine_info(directory, cuda=args.device == "cuda")
    total_ram = machine.get("total_ram_gb")
    if total_ram and total_ram * GB < 3.5 * nbytes:
        log(f"warning: {total_ram:.1f} GB of RAM; contenders that copy the state (async_io, dcp_async) need ~2-3x {nbytes / GB:.2f} GB")

    def task_of(name: str, tag: str, run_dir: str) -> Task:
        if name == REFERENCE:
            return {"kind": "copy_floor", "size_bytes": size_bytes, "device": args.device}
        return {
            "kind": "async_loop",
            "contender": name,
            "size_bytes": size_bytes,
            "run_dir": run_dir,
            "tag": tag,
            "saves": args.saves,
            "every": args.every,
            "warmup": args.warmup,
            "schedule": args.schedule,
            "matmuls": matmuls,
            "matmul_size": matmul_size,
            "device": args.device,
            "timeout_s": args.timeout,
            "max_write_rate": args.max_write_rate,
        }

    started = time.time()
    if (done := lean.run_contenders(args, names, nbytes, task_of, _run_task)) is None:
        return 2
    contender_runs, errors = done
    contenders = {
        name: {"summary": summarize([run["metrics"] for run in runs]), "runs": runs}
        for name, runs in contender_runs.items()
        if name != REFERENCE
    }
    copy = None
    if REFERENCE in contender_runs:
        runs = contender_runs[REFERENCE]
        copy = {"summary": summarize([run["metrics"] for run in runs]), "runs": runs}
    results: Metrics = {
        "size": args.size,
        "size_bytes": size_bytes,
        "state_bytes": nbytes,
        "state_tensors": n_tensors,
        "contenders": contenders,
        "plain_copy": copy,
        "ratios": _ratios(contenders, copy),
        "errors": errors,
    }
    report = {
        **report_header(argv, started),
        "settings": {
            "mode": "async",
            "device": args.device,
            "size": args.size,
            "repeats": args.repeats,
            "saves": args.saves,
            "every": args.every,
            "warmup_steps": args.warmup,
            "untimed_warmup_steps": _UNTIMED_WARMUP,
            "schedule": args.schedule,
            "contenders": names,
            "dir": directory,
            "timeout_s": args.timeout,
            "compute": {
                "matmuls_per_step": matmuls,
                "matmul_size": matmul_size,
                "target_ms": None if args.matmuls is not None else args.compute_ms,
                "one_matmul_ms_at_calibration": one_ms,
            },
            "update": f"every state tensor t.lerp_(1e-3, {UPDATE_WEIGHT}) (as an Optimizer.step) and step counters"
            " += 1, each step"
            + ("; the step ends with torch.cuda.current_stream().synchronize()" if args.device == "cuda" else ""),
            "dcp": "async_save THREAD mode, no process group; DefaultStager(StagingOptions("
            + ", ".join(f"{k}={v}" for k, v in dcp_staging_options(args.device).items())
            + "))"
            + (
                " kept across saves"
                if dcp_stager_reusable()
                else f" created afresh for every save (torch {torch.__version__}: its DefaultStager stages only once,"
                " then raises KeyError)"
            )
            + "; the loop waits for the previous future before restaging",
            "durable": {
                "torch_io": "save_checkpoint + fsync of the file",
                "async_io": "the wrapped inner TorchCheckpointIO's save + fsync finished (background thread)",
                "dcp_async": "the async_save future completed (FileSystemWriter fsyncs its files)",
                "dcp_sync": "dcp.save returned (FileSystemWriter fsyncs its files)",
                "sharded_async": "start of save_checkpoint + WriteResult.seconds from io.last_save / io.poll() (save call -> committed + durable)",
                "sharded_sync": "save_checkpoint returned",
                "disk_floor": "its helper process's fsync of the plain O_DIRECT write returned",
            },
            "units": "GB = 1e9 bytes, MB = 1e6 bytes; *delta_mb / growth / peak figures are relative to the RSS"
            " after warm-up (state built and warm), just before the first save",
        },
        "machine": machine,
        "results": results,
    }
    emit_report(render_table(report), report, args.json_path)
    return 1 if errors else 0
