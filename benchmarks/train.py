"""Real training-loop benchmark of checkpoint saves: how much training time each save costs.

``python -m benchmarks --mode train --device cuda|cpu [...]``.

Each (contender, repeat) runs in a fresh process (``measure.run_in_fresh_process``) that
trains a decoder-only transformer built in plain torch (``workloads.Decoder``: embedding, pre-norm
blocks of causal attention + 4x MLP with RMSNorm, an LM head tied or not) with AdamW (``fused``
on CUDA) on synthetic token batches made on the device; on CUDA the forward runs under bf16
autocast. ``--params`` sizes it (GPT-3 aspect), or ``--layers`` / ``--width``.

The loop runs 3 untimed steps and ``--warmup`` timed steps without saving, then saves. The
*baseline* step time is the median of those warm-up steps and of every step outside a save's
window. Saves are driven the way Lightning drives a ``CheckpointIO``: at the end of
a step, after ``optimizer.step()`` (where ``ModelCheckpoint.on_train_batch_end`` saves), the dict
``Trainer.dump_checkpoint`` builds (``workloads.lightning_checkpoint``: ``state_dict``,
``optimizer_states``, ``global_step``, ...) goes to ``save_checkpoint(checkpoint, path)``. Every
step ends by synchronising the training stream on CUDA, so a step's time includes its device work
and every wait a save puts on it (not side-stream copies running beside it). The async
``ShardedCheckpointIO`` is driven as ``ShardedModelCheckpoint`` drives it: its staging pool is
prepared after the first step, and saves between steps may overlap their copies.

Per save, its *window*: the step holding the save, the steps that started while it was not yet
durable, and ``--window`` more steps. A save is due ``--every`` steps after the previous one, and
not before the previous window closed (windows never overlap). Per save:

* **lost** = the sum over the window of (step time - baseline median): the training time the save
  cost, its own step and the slowdown of the steps after it (background writing, deferred copies,
  DCP's wait for async staging) together;
* **durable** = from the save call until the contender's own completion signal: the call's return
  plus an fsync (``torch_io``), the wrapped inner save + fsync done (``async_io``), the DCP future
  done (its ``FileSystemWriter`` fsyncs), ``io.poll()`` / ``io.last_save`` (``WriteResult.seconds``
  from the hand-off to the writer) for ``sharded_async``, the call's return for ``sharded_sync``;
* **post-save worst / median**: the slowest and the median step of the window after the save's
  own step, as ratios to the baseline median.

The first save is *cold* (buffers allocated and pinned, writer processes started); *steady* =
the median of saves 2..N. Memory: GPU ``max_memory_allocated`` over the save phase minus that over
the baseline steps, ``memory_reserved`` after minus before; host peak RSS (``VmHWM``) over the save
phase minus the RSS before it. After the measured saves, one more save is the *verification*
save: right before it, every tensor of the checkpoint dict is cloned (on CUDA into device memory,
queued on the training stream, no host sync), training goes on until it is durable, then the
checkpoint is loaded (page cache dropped first; **load** time) and compared bit for bit with the
clone. The verification save is left out of every other figure.

Contenders: ``torch_io`` (Lightning ``TorchCheckpointIO``), ``async_io`` (Lightning
``AsyncCheckpointIO``), ``dcp_async`` (``torch.distributed.checkpoint.async_save`` in its strongest
one-GPU setup: ``AsyncCheckpointerType.PROCESS`` where available, a ``DefaultStager`` kept across
saves, pinned + shared memory, non-blocking copies and async staging on CUDA - the loop waits for
the staging future right before the next ``optimizer.step``, as torchtitan does), ``sharded_sync``
(``ShardedCheckpointIO()``) and ``sharded_async`` (``ShardedCheckpointIO(async_save=True)``).
Medians over ``--repeats`` go to a rich table (ratios against ``torch_io`` and ``async_io``); the
JSON only with ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import time
from typing import Any

import torch

from benchmarks.common.arguments import parse_count
from benchmarks.common.contenders import (
    DcpAsync,
    dcp_process_available,
    dcp_staging_options,
    make_contender,
)
from benchmarks.common.measure import p95
from benchmarks.common.workloads import (
    Decoder,
    DecoderConfig,
    decoder_config,
    lightning_checkpoint,
)
from lightning_ckpt.bench.files import (
    DEFAULT_DIR,
    drop_page_cache,
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
    median,
    proc_status,
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

CONTENDERS = ("torch_io", "async_io", "dcp_async", "sharded_sync", "sharded_async")
DEVICES = ("cuda", "cpu")
_TITLES = {
    "torch_io": "torch_io (Lightning)",
    "async_io": "async_io (Lightning)",
    "dcp_async": "dcp_async",
    "sharded_sync": "sharded_sync",
    "sharded_async": "sharded_async",
}
# per device: --params, --vocab, --batch, --seq
_DEFAULTS = {"cuda": ("1.3B", 32000, 4, 2048), "cpu": ("8M", 4096, 4, 64)}
_UNTIMED_WARMUP = 3


# ----------------------------------------------------------------------------------------------
# Child side


def _flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested dict / list, keyed by its path (int and str keys alike)."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items: Any = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_flat_tensors(value, f"{prefix}/{key}"))
    return out


def _state_bytes(checkpoint: dict[str, Any]) -> int:
    """Bytes of the checkpoint's tensors, each storage once (a tied head shares the embedding's)."""
    storages = {}
    for t in _flat_tensors(checkpoint).values():
        storages[(t.device, t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _load(name: str, path: str, reference: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(seconds, the loaded dict) of loading ``path`` as a resumed run of ``name`` would."""
    drop_page_cache(path)
    start = time.perf_counter()
    if name in ("torch_io", "async_io"):
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        loaded = TorchCheckpointIO().load_checkpoint(path)
    elif name == "dcp_async":
        import torch.distributed.checkpoint as dcp

        # DCP loads in place: a target of the saved structure with preallocated host tensors
        def empty(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return torch.empty(obj.shape, dtype=obj.dtype)
            if isinstance(obj, dict):
                return {k: empty(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [empty(v) for v in obj]
            return obj

        loaded = empty(reference)
        dcp.load(loaded, checkpoint_id=path)
    else:
        from lightning_ckpt import ShardedCheckpointIO

        loaded = ShardedCheckpointIO().load_checkpoint(path)
    return time.perf_counter() - start, loaded


def _compare(loaded: dict[str, Any], expected: dict[str, torch.Tensor], global_step: int) -> Metrics:
    """Bit-exact comparison of every tensor of ``loaded`` (and its ``global_step``) with ``expected``."""
    found = _flat_tensors(loaded)
    mismatches = sorted(set(found) ^ set(expected))
    for key in sorted(set(found) & set(expected)):
        a, b = found[key].cpu(), expected[key].cpu()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            mismatches.append(key)
    if loaded.get("global_step") != global_step:
        mismatches.append("global_step")
    return {"bit_exact": not mismatches, "verified_tensors": len(expected), "mismatches": mismatches[:10]}


def _state_size(checkpoint: dict[str, Any]) -> tuple[int, bool]:
    tensors = list(_flat_tensors(checkpoint).values())
    return sum(t.nbytes for t in tensors), any(t.is_cuda for t in tensors)


def _train_run(task: Task) -> Metrics:
    device = torch.device(task["device"])
    cuda = device.type == "cuda"
    if task.get("threads"):
        torch.set_num_threads(task["threads"])
    torch.manual_seed(0)
    config = DecoderConfig(**task["config"])
    model = Decoder(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True if cuda else None)
    generator = torch.Generator(device=device).manual_seed(1)
    batch, seq = task["batch"], task["seq"]
    name = task["contender"]
    contender = make_contender(name, task["run_dir"], device=task["device"], dcp=task["dcp"])
    global_step = 0

    def sync() -> None:
        # The training stream only: a contender's side-stream copies count where the training
        # stream waits for them, not while they overlap its work.
        if cuda:
            torch.cuda.current_stream().synchronize()

    def train_step() -> None:
        nonlocal global_step
        tokens = torch.randint(0, config.vocab, (batch, seq + 1), device=device, generator=generator)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        contender.before_update()  # a snapshot still in progress must finish before the state changes
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_step += 1

    n_saves, every, window, verify = task["saves"], task["every"], task["window"], task["verify"]
    total = n_saves + (1 if verify else 0)  # the last one is the verification save
    saves: list[dict[str, Any]] = []
    by_path: dict[str, dict[str, Any]] = {}
    steps: list[tuple[float, float, int | None, int | None]] = []  # (start, end, save held, window of)
    kept: list[str] = []  # the latest durable checkpoint; older ones are removed between steps
    reference: dict[str, Any] | None = None
    sampler = RssSampler()
    sampling = False
    measured: Metrics = {}
    helpers: dict[int, dict[str, int]] = {}
    try:
        for _ in range(_UNTIMED_WARMUP):
            train_step()
            if global_step == 1:  # the optimizer state exists now
                nbytes, on_device = _state_size(lightning_checkpoint(model, optimizer, global_step))
                contender.prepare(nbytes, on_device)
        sync()
        gc.collect()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        baseline = []
        for _ in range(task["warmup"]):
            start = time.perf_counter()
            train_step()
            sync()
            baseline.append(time.perf_counter() - start)
        gpu_before = (
            {"peak": torch.cuda.max_memory_allocated(), "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
            if cuda
            else None
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        state_bytes = _state_bytes(lightning_checkpoint(model, optimizer, global_step))
        deadline = time.perf_counter() + task["timeout_s"]
        sampler.__enter__()
        sampling = True
        since = 0
        while True:
            for path, at in contender.poll():
                by_path[path]["durable_at"] = at
                for old in kept:  # untimed, between steps
                    remove_path(old)
                kept = [path]
            last = saves[-1] if saves else None
            closed = last is None or ("durable_at" in last and last["after_durable"] >= window)
            if last is not None and closed and len(saves) == n_saves and not measured:
                # the measured phase ends here: its memory figures exclude the verification save
                sampler.__exit__(None, None, None)
                sampling = False
                measured = {"rss": sampler.metrics(), "gpu_peak": torch.cuda.max_memory_allocated() if cuda else None,
                            "gpu_reserved": torch.cuda.memory_reserved() if cuda else None}  # fmt: skip
            if len(saves) == total and closed:
                break
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"{name}: {len(saves)}/{total} saves, durable: {sum('durable_at' in s for s in saves)},"
                    f" after {task['timeout_s']} s (--timeout)"
                )
            since += 1
            due = len(saves) < total and since >= every and closed
            open_window = None if closed or last is None else last["index"] - 1
            start = time.perf_counter()
            train_step()
            if not due:
                sync()
                steps.append((start, time.perf_counter(), None, open_window))
                if last is not None and "durable_at" in last:
                    last["after_durable"] += 1
                continue
            index = len(saves)
            checkpoint = lightning_checkpoint(model, optimizer, global_step)
            if index == n_saves:  # the verification save: the state as saved, cloned without a host sync
                tensors = {key: t.detach().clone() for key, t in _flat_tensors(checkpoint).items()}
                reference = {"structure": checkpoint, "tensors": tensors, "global_step": global_step}
            path = os.path.abspath(os.path.join(task["run_dir"], f"{task['tag']}-save{index + 1}.ckpt"))
            call_start = time.perf_counter()
            contender.save(checkpoint, path)
            call_end = time.perf_counter()
            del checkpoint
            sync()
            end = time.perf_counter()
            steps.append((start, end, index, index))
            record = {
                "index": index + 1,
                "path": path,
                "step_start": start,
                "call_start": call_start,
                "call_end": call_end,
                "step_end": end,
                "after_durable": 0,
                "rss_mb": proc_status().get("VmRSS", 0) / MB,
                "gpu_allocated_delta_mb": (torch.cuda.memory_allocated() - gpu_before["allocated"]) / MB if gpu_before else None,
            }
            saves.append(record)
            by_path[record["path"]] = record
            since = 0
        helpers = {pid: proc_status(pid) for pid in contender.helper_pids()}
    finally:
        try:
            contender.teardown()
        finally:
            if sampling:
                sampler.__exit__(None, None, None)
    helpers_alive = [pid for pid in helpers if os.path.exists(f"/proc/{pid}")]
    verification: Metrics = {}
    load_seconds = bytes_on_disk = None
    if reference is not None:
        path = saves[-1]["path"]
        bytes_on_disk = path_bytes(path)
        load_seconds, loaded = _load(name, path, reference["structure"])
        verification = _compare(loaded, reference["tensors"], reference["global_step"])
        del loaded, reference
    for record in saves:
        remove_path(record["path"])
    # The baseline: the warm-up steps and every step outside any save's window (many steps, so a
    # burst of noise on a shared machine moves it little); the figures above used only the warm-up.
    baseline += [end - start for start, end, held, window in steps if held is None and window is None]
    base = statistics.median(baseline)
    records = _save_records(saves[:n_saves], steps, base)
    first, steady = records[:1], records[1:]

    def pick(rows: list[Metrics], key: str) -> list[float]:
        return [row[key] for row in rows if row[key] is not None]

    post = [d for r in steady for d in r["post_steps"]]
    metrics: Metrics = {
        "state_bytes": state_bytes,
        "parameters": config.parameters(),
        "baseline_step_median_seconds": base,
        "baseline_step_p95_seconds": p95(baseline),
        "baseline_steps": len(baseline),
        "tokens_per_second": batch * seq / base,
        "saves": len(records),
        "lost_first_seconds": first[0]["lost_seconds"] if first else None,
        "lost_steady_median_seconds": median(pick(steady, "lost_seconds")),
        "save_step_extra_first_seconds": first[0]["save_step_extra_seconds"] if first else None,
        "save_step_extra_steady_median_seconds": median(pick(steady, "save_step_extra_seconds")),
        "call_first_seconds": first[0]["call_seconds"] if first else None,
        "call_steady_median_seconds": median(pick(steady, "call_seconds")),
        "durable_first_seconds": first[0]["durable_seconds"] if first else None,
        "durable_steady_median_seconds": median(pick(steady, "durable_seconds")),
        "post_save_worst_first_ratio": first[0]["post_worst_ratio"] if first else None,
        "post_save_worst_steady_ratio": max(pick(steady, "post_worst_ratio"), default=None),
        "post_save_median_steady_ratio": ratio(median(post), base),
        "window_steps_steady_median": median(pick(steady, "window_steps")),
        "peak_rss_mb": measured.get("rss", {}).get("peak_rss_mb"),
        "peak_hwm_mb": measured.get("rss", {}).get("peak_hwm_mb"),
        "baseline_rss_mb": measured.get("rss", {}).get("baseline_rss_mb"),
        "gpu_peak_delta_mb": (measured["gpu_peak"] - gpu_before["peak"]) / MB if gpu_before and measured else None,
        "gpu_reserved_delta_mb": (measured["gpu_reserved"] - gpu_before["reserved"]) / MB if gpu_before and measured else None,
        "gpu_baseline_peak_mb": gpu_before["peak"] / MB if gpu_before else None,
        "load_seconds": load_seconds,
        "bytes_on_disk": bytes_on_disk,
        "bit_exact": verification.get("bit_exact"),
        "verified_tensors": verification.get("verified_tensors"),
    }
    notes = list(contender.notes)
    if isinstance(contender, DcpAsync) and contender.waits:
        notes.append(f"waited for the previous DCP save before {len(contender.waits)} saves ({sum(contender.waits):.2f} s)")
    if isinstance(contender, DcpAsync) and contender.staging_waits:
        metrics["dcp_staging_wait_seconds"] = sum(contender.staging_waits)
    if helpers_alive:
        notes.append(f"helper processes still alive after teardown: {helpers_alive}")
    origin = saves[0]["step_start"] if saves else 0.0
    return {
        "metrics": metrics,
        "per_save": records,
        "verification": verification,
        "helpers": {str(pid): status.get("VmHWM", 0) / MB for pid, status in helpers.items()},
        "helpers_alive_after_teardown": helpers_alive,
        "notes": notes,
        # (start relative to the first save's step, seconds, "S<n>" save step | "W<n>" in its window | "-")
        "step_trace": [
            (round(a - origin, 4), round(b - a, 4), f"S{held + 1}" if held is not None else f"W{w + 1}" if w is not None else "-")
            for a, b, held, w in steps
        ],
    }


def _save_records(saves: list[dict[str, Any]], steps: list[tuple[float, float, int | None, int | None]], base: float) -> list[Metrics]:
    """Per measured save: its step, its window's steps and what they cost over the baseline median."""
    records = []
    for i, s in enumerate(saves):
        post = [end - start for start, end, held, window in steps if window == i and held is None]
        save_step = s["step_end"] - s["step_start"]
        records.append(
            {
                "index": s["index"],
                "call_seconds": s["call_end"] - s["call_start"],
                "step_seconds": save_step,
                "save_step_extra_seconds": save_step - base,
                "post_steps": post,
                "window_steps": 1 + len(post),
                "lost_seconds": save_step - base + sum(d - base for d in post),
                "durable_seconds": s["durable_at"] - s["call_start"],
                "post_worst_ratio": ratio(max(post, default=None), base),
                "post_median_ratio": ratio(median(post), base),
                "rss_mb": s["rss_mb"],
                "gpu_allocated_delta_mb": s["gpu_allocated_delta_mb"],
            }
        )
    return records


def _run_task(task: Task) -> Metrics:
    """Runner of :func:`run_in_fresh_process` for this mode."""
    if task["kind"] == "train_loop":
        return _train_run(task)
    raise ValueError(f"unknown task {task['kind']!r}")


# ----------------------------------------------------------------------------------------------
# Parent side


def _ratios(contenders: dict[str, Metrics]) -> Metrics:
    """Per contender, its steady lost time, durable time and memory over ``torch_io``'s and ``async_io``'s."""
    keys = ("lost_steady_median_seconds", "lost_first_seconds", "durable_steady_median_seconds", "peak_rss_mb",
            "gpu_peak_delta_mb", "load_seconds")  # fmt: skip
    ratios: Metrics = {}
    for reference in ("torch_io", "async_io"):
        ref = contenders.get(reference, {}).get("summary")
        ratios[f"vs_{reference}"] = {
            key: {name: ratio(m(entry["summary"], key), m(ref, key)) for name, entry in contenders.items()} for key in keys
        }
    return ratios


def render_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    settings, results = report["settings"], report["results"]
    model = settings["model"]
    base = [m(e["summary"], "baseline_step_median_seconds") for e in results["contenders"].values() if e["summary"]]
    table = Table(
        title=(
            f"lightning_ckpt train benchmark on {settings['device']}: {model['parameters'] / 1e6:.0f}M-parameter decoder"
            f" ({model['layers']} x {model['width']}, vocab {model['vocab']}{', tied' if model['tied'] else ''}),"
            f" state {results['state_bytes'] / GB:.3g} GB, batch {settings['batch']} x {settings['seq']},"
            f" baseline step {1000 * statistics.median(base) if base else 0:.0f} ms; {settings['saves']} saves,"
            f" medians of {settings['repeats']}"
        ),
        caption=(
            "lost = sum over the save's window (its step, the steps until durable, --window more) of step - baseline"
            " median; save step = that step's extra; durable = save call -> durable; post worst / med = slowest /"
            " median step after the save step, x baseline; ΔGPU = peak allocated / reserved over the baseline's;"
            " ΔRSS = host peak (VmHWM) over the pre-save RSS; load = page cache dropped; exact = the reloaded last"
            " checkpoint equals a copy taken at the save, bit for bit"
        ),
    )
    columns = ("contender", "lost 1st s", "lost s", "x torch_io", "x async_io", "save step s", "durable 1st s",
               "durable s", "post worst x", "post med x", "ΔGPU peak MB", "ΔGPU rsv MB", "ΔRSS MB", "load s", "exact")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "contender" else "right", no_wrap=column == "contender")
    vs_torch, vs_async = results["ratios"]["vs_torch_io"], results["ratios"]["vs_async_io"]
    for name, entry in results["contenders"].items():
        s = entry["summary"]
        if s is None:
            table.add_row(_TITLES.get(name, name), "error", *["-"] * (len(columns) - 2))
            continue
        exact = [run["metrics"]["bit_exact"] for run in entry["runs"]]
        table.add_row(
            _TITLES.get(name, name) + (" (process)" if name == "dcp_async" and settings["dcp"]["checkpointer"] == "process" else ""),
            fmt(m(s, "lost_first_seconds"), 3),
            fmt(m(s, "lost_steady_median_seconds"), 3),
            fmt(vs_torch["lost_steady_median_seconds"].get(name), 3),
            fmt(vs_async["lost_steady_median_seconds"].get(name), 3),
            fmt(m(s, "save_step_extra_steady_median_seconds"), 3),
            fmt(m(s, "durable_first_seconds"), 3),
            fmt(m(s, "durable_steady_median_seconds"), 3),
            fmt(m(s, "post_save_worst_steady_ratio")),
            fmt(m(s, "post_save_median_steady_ratio")),
            fmt(m(s, "gpu_peak_delta_mb"), 0),
            fmt(m(s, "gpu_reserved_delta_mb"), 0),
            fmt(m(s, "peak_hwm_mb") if m(s, "peak_hwm_mb") is not None else m(s, "peak_rss_mb"), 0),
            fmt(m(s, "load_seconds"), 3),
            "-" if None in exact else "yes" if all(exact) else "NO",
        )
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks --mode train",
        description=(
            "Real training loop (decoder-only transformer + AdamW, synthetic tokens): training time lost per save,"
            " time until durable, post-save step slowdown, GPU and host memory, load time and a bit-exact check,"
            " for Lightning's TorchCheckpointIO / AsyncCheckpointIO, DCP async_save and ShardedCheckpointIO."
            " Each contender runs in a fresh process."
        ),
    )
    parser.add_argument("--device", choices=DEVICES, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model trains (default: cuda when available)")  # fmt: skip
    parser.add_argument(
        "--params",
        default=None,
        help="model size in parameters, e.g. 1.3B, 350M (default "
        + ", ".join(f"{v[0]} on {k}" for k, v in _DEFAULTS.items())
        + "); --layers / --width override the shape",
    )
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (default: from --params)")
    parser.add_argument("--width", type=int, default=None, help="model width (default: from --params)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default 32000 on cuda, 4096 on cpu)")
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048 on cuda, 64 on cpu)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender, medians reported (default 3)")
    parser.add_argument("--saves", type=int, default=4, help="measured saves per run (default 4; steady = saves 2..N)")
    parser.add_argument("--every", type=int, default=5, help="steps between saves, at least (default 5)")
    parser.add_argument("--window", type=int, default=3, help="steps counted after a save is durable (default 3)")
    parser.add_argument("--warmup", type=int, default=8, help="timed steps without saving: the baseline (default 8)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip the verification save (reload + bit-exact comparison)")  # fmt: skip
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list, a subset of {','.join(CONTENDERS)}")
    parser.add_argument("--dcp-checkpointer", choices=("process", "thread"), default="process",
                        help="DCP async_save checkpointer (default process where this torch has it)")  # fmt: skip
    parser.add_argument("--no-dcp-async-staging", dest="dcp_async_staging", action="store_false",
                        help="CUDA: stage DCP's device-to-host copy synchronously in the save call")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads in each run (default: torch's choice)")
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"where checkpoints are written (default ./{DEFAULT_DIR})")
    add_json_argument(parser)
    parser.add_argument("--timeout", type=float, default=1800.0, help="limit per run, seconds (default 1800)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``--mode train``; print a table (and the JSON with ``--json``).

    Returns 0; 1 if a run failed or a checkpoint did not reload bit-exact; 2 on bad setup.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (use --device cpu)")
    default_params, default_vocab, default_batch, default_seq = _DEFAULTS[args.device]
    try:
        params = parse_count(args.params or default_params, "--params")
    except ValueError as err:
        parser.error(str(err))
    for option in ("repeats", "saves", "every", "warmup", "timeout"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    if args.window < 0:
        parser.error("--window must be >= 0")
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        parser.error(f"--contenders: unknown {unknown} (choose from {', '.join(CONTENDERS)})" if unknown else "--contenders is empty")
    names = [n for n in CONTENDERS if n in names]
    vocab, batch, seq = args.vocab or default_vocab, args.batch or default_batch, args.seq or default_seq
    for option, value in (("vocab", vocab), ("batch", batch), ("seq", seq), ("layers", args.layers), ("width", args.width)):
        if value is not None and value < 1:
            parser.error(f"--{option} must be at least 1")
    config = decoder_config(params, vocab, args.tied, args.layers, args.width)
    checkpointer = args.dcp_checkpointer if dcp_process_available() else "thread"
    cuda = args.device == "cuda"
    dcp = {"checkpointer": checkpointer, "async_staging": cuda and args.dcp_async_staging}

    log = stderr_logger()
    directory = os.path.abspath(args.dir)
    nbytes = config.parameters() * 4 * 3  # fp32 weights + AdamW exp_avg and exp_avg_sq
    log(
        f"decoder {config.parameters() / 1e6:.1f}M parameters ({config.layers} x {config.width}, {config.heads} heads,"
        f" vocab {config.vocab}), ~{nbytes / GB:.3g} GB of state on {args.device}; batch {batch} x {seq} tokens"
    )
    machine = machine_info(directory, cuda=cuda)
    runs: dict[str, list[Metrics]] = {n: [] for n in names}
    errors: list[str] = []
    started = time.time()
    with run_directory(directory) as run_dir:
        free = shutil.disk_usage(run_dir).free
        if free < 3 * nbytes * 1.1:  # the latest durable checkpoint, one being written, and slack
            log(f"--dir {directory!r} has {free / GB:.1f} GB free; this size needs ~{3 * nbytes / GB:.1f} GB.")
            return 2
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotated: no fixed first contender
                tag = f"r{r}-{name}"
                task: Task = {
                    "kind": "train_loop", "contender": name, "device": args.device, "config": _config_dict(config),
                    "batch": batch, "seq": seq, "run_dir": run_dir, "tag": tag, "saves": args.saves, "every": args.every,
                    "window": args.window, "warmup": args.warmup, "verify": args.verify, "dcp": dcp,
                    "threads": args.threads, "timeout_s": args.timeout,
                }  # fmt: skip
                log(f"[{r + 1}/{args.repeats}] {name}")
                try:
                    out = run_in_fresh_process(task, _run_task)
                    runs[name].append(out)
                    if out["metrics"]["bit_exact"] is False:
                        errors.append(f"{name} repeat {r + 1}: the reloaded checkpoint differs: {out['verification']['mismatches']}")
                except RuntimeError as err:
                    errors.append(f"{name} repeat {r + 1}: {err}")
                    log(f"[{r + 1}/{args.repeats}] {name} FAILED: {str(err).splitlines()[0]}")
                finally:
                    for leftover in os.listdir(run_dir):  # a failed run's checkpoints
                        if leftover.startswith(f"{tag}-"):
                            remove_path(os.path.join(run_dir, leftover))

    contenders = {name: {"summary": summarize([run["metrics"] for run in rs]), "runs": rs} for name, rs in runs.items()}
    measured_bytes = [run["metrics"]["state_bytes"] for rs in runs.values() for run in rs]
    results: Metrics = {
        "state_bytes": measured_bytes[0] if measured_bytes else nbytes,
        "contenders": contenders,
        "ratios": _ratios(contenders),
        "errors": errors,
    }
    report = {
        **report_header(argv, started),
        "settings": {
            "mode": "train",
            "device": args.device,
            "model": {**_config_dict(config), "parameters": config.parameters()},
            "batch": batch,
            "seq": seq,
            "precision": "bf16 autocast, fp32 weights and AdamW state" if cuda else "fp32",
            "optimizer": "AdamW(lr=1e-4, weight_decay=0.1" + (", fused=True)" if cuda else ")"),
            "repeats": args.repeats,
            "saves": args.saves,
            "every": args.every,
            "window": args.window,
            "warmup_steps": args.warmup,
            "untimed_warmup_steps": _UNTIMED_WARMUP,
            "verify": args.verify,
            "contenders": names,
            "dcp": {**dcp, "staging_options": dcp_staging_options(args.device, checkpointer == "process", dcp["async_staging"])},
            "dir": directory,
            "units": "GB = 1e9 bytes, MB = 1e6 bytes; *_ratio = / the baseline median step",
        },
        "machine": machine,
        "results": results,
    }
    emit_report(render_table(report), report, args.json_path)
    return 1 if errors else 0


def _config_dict(config: DecoderConfig) -> dict[str, Any]:
    return {"vocab": config.vocab, "width": config.width, "layers": config.layers, "heads": config.heads, "tied": config.tied}
