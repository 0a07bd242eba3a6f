"""Multi-rank benchmark of checkpoint saves and loads: N CPU ranks (gloo), one shared disk.

``python -m benchmarks --mode distributed [...]``.

Every measurement runs in a fresh group of rank processes (``measure.fresh_process_context``: the server
imports torch, Lightning and this package once, every rank is a fresh process forked from it), joined by a gloo
process group; no Lightning ``Trainer`` runs, but each rank saves exactly the dict Lightning builds.
Per repeat, in this order (contenders rotated from one repeat to the next):

* ``disk``: plain sequential writes + fsync of the bytes of the DDP state, once by rank 0 alone and
  once split over the N ranks writing at the same time (buffered 64 MB writes, and ``O_DIRECT`` 16 MB
  writes): whether N writers get more out of the disk than one does. The ratio N-writer time /
  one-writer time is the floor of any spread write on this disk.
* FSDP2 (each a fresh group): a model of ``nn.Linear(h, h)`` layers, each and the whole
  ``fully_shard``-ed on a 1-D mesh of the N ranks, after one AdamW step (forward, backward, step on a
  random batch); the checkpoint is the dict ``ModelParallelStrategy`` dumps with
  ``save_distributed_checkpoint=True``: ``state_dict`` = ``get_model_state_dict`` and
  ``optimizer_states`` = ``[get_optimizer_state_dict]`` (both ``StateDictOptions(full_state_dict=False,
  cpu_offload=True)``, DTensors sharing the live storage), plus the epoch, loops and other small keys.

  - ``dcp_stock``: ``ModelParallelStrategy.save_checkpoint``'s body: broadcast the path, ``mkdir``,
    ``lightning.fabric.strategies.fsdp._distributed_checkpoint_save`` (``torch.distributed.checkpoint.save``,
    whose ``FileSystemWriter`` fsyncs its files) of ``{"state_dict", "optimizer_0"}``, then on rank 0
    ``torch.save`` of the rest to ``meta.pt`` + an fsync of it (so that it is durable like the rest).
  - ``sharded_sync``: ``ShardedCheckpointIO().save_sharded(checkpoint, path, rank, N, broadcast)``.
  - ``sharded_sync_buffered``: the same with ``ShardedCheckpointIO(direct_io=False)``: buffered
    writes + fsync instead of the ``O_DIRECT`` writes the plugin picks by itself where the
    filesystem takes them (which of the two a disk prefers shows in the ``disk`` figures).
  - ``sharded_async``: the same with ``ShardedCheckpointIO(async_save=True)``, then ``io.wait()``
    (rank 0's returns once its writer process has committed the whole checkpoint).

  ``--saves`` saves per group (a training step between them changes every tensor, as training does);
  the first one allocates buffers and starts writer processes, steady = saves 2..N. Before each save
  all ranks meet at a barrier. Checkpoints are removed only after the group has ended, followed by
  an ``os.sync()`` (the filesystem may be mounted with ``discard``: deleting a checkpoint right
  before a save would time the disk's discards too). *Stall* = how long the save call blocked, max over ranks. *Durable* =
  from the earliest rank's call to the last rank's completion (sync: the call returned; async:
  ``io.wait()`` returned), on the machine's monotonic clock. *Peak extra RSS* = the rank process's
  ``VmHWM`` over its RSS just before the save (see ``measure.RssSampler``), max over ranks; the async
  writer process's own peak RSS is reported apart (it maps the same staging pool).
  After the last save the live model and optimizer state are zeroed, the page cache of the
  checkpoint's files is dropped (``POSIX_FADV_DONTNEED``, as ``--mode save`` does), and the
  checkpoint is loaded back into the live sharded model: stock with Lightning's own
  ``lightning.fabric.strategies.model_parallel._load_checkpoint`` (what ``ModelParallelStrategy.load_checkpoint``
  calls: one DCP load of the model, one per optimizer, ``set_optimizer_state_dict``, ``meta.pt``); ours
  as ``ShardedModelParallelStrategy.load_checkpoint`` does (``distributed.load_sharded`` with
  verification, ``load_state_dict``, ``set_optimizer_state_dict``). The loaded state is checked
  against the saved one (per-tensor sums).
* ``reshard``: for each of ``--reshard-world-sizes``, a group of that many ranks (a mesh of that
  size) builds the same model and loads the last stock and ``sharded_sync`` checkpoints of this
  repeat (saved on N ranks), page cache dropped before each, checked against the saved state's
  per-tensor sums.
* DDP (each a fresh group): the replicated plain-tensor Lightning dict of ``workloads.build_checkpoint``
  on every rank (1/3 weights, 2/3 AdamW moments), ``rank0_only``: ``ShardedCheckpointIO().save_checkpoint``
  on rank 0 alone (Lightning's DDP path today); ``spread``: ``save_sharded`` on every rank. Durable
  as above; bytes written per rank from the committed files. ``rank0_only_buffered`` and
  ``spread_buffered``: the same with ``direct_io=False``.
* ``--ram-dir`` (e.g. ``/dev/shm``): the plain writes and the DDP pair again, on a RAM-backed
  filesystem, where the disk is not the bottleneck (where a kernel refuses ``O_DIRECT`` on tmpfs,
  the plain ``O_DIRECT`` row is left out and our writer writes buffered). There each checkpoint is
  removed right after the next one is saved, so the filesystem's footprint stays at two.

Every save also records the CPU seconds its rank processes used (threads included, writer
processes not): with as many busy threads as cores, spreading the work over more ranks cannot
shorten it.

Medians over ``--repeats`` go to rich tables; ``--json PATH`` writes every run's values.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import re
import resource
import secrets
import shutil
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_replies
from typing import Any

import torch

from benchmarks.common.plain_writer import BUFFERED_CHUNK, aligned, direct_buffer, write_and_fsync
from lightning_ckpt.bench.files import (
    DEFAULT_DIR,
    drop_page_cache,
    fsync_file,
    remove_path,
    run_directory,
)
from lightning_ckpt.bench.measure import (
    GB,
    MB,
    Metrics,
    RssSampler,
    Task,
    fresh_process_context,
    m,
    proc_status,
    ratio,
    summarize,
)
from lightning_ckpt.bench.report import (
    add_json_argument,
    emit_report,
    filesystem_of,
    fmt,
    machine_info,
    report_header,
    stderr_logger,
    version,
)
from lightning_ckpt.bench.workloads import build_checkpoint, state_bytes

FSDP_CONTENDERS = ("dcp_stock", "sharded_sync", "sharded_sync_buffered", "sharded_async")
DDP_CONTENDERS = ("rank0_only", "spread", "rank0_only_buffered", "spread_buffered")
RAM_DDP_CONTENDERS = ("rank0_only", "spread")  # on a RAM-backed filesystem O_DIRECT or not makes no difference
_IO_OPTIONS: dict[str, dict[str, Any]] = {  # ShardedCheckpointIO(...) of each contender
    "sharded_sync": {},
    "sharded_sync_buffered": {"direct_io": False},
    "sharded_async": {"async_save": True},
    "rank0_only": {},
    "spread": {},
    "rank0_only_buffered": {"direct_io": False},
    "spread_buffered": {"direct_io": False},
}
DISK_WRITES = ("buffered", "direct")
DEFAULT_SIZE = "1GB"
DEFAULT_WORLD_SIZE = 2
DEFAULT_RESHARD_WORLD_SIZES = "1"
DEFAULT_SAVES = 3
TARGETS = {  # the targets: ours / stock (or spread / rank 0 only), at most
    "stall_async_vs_stock": 0.1,
    "durable_sync_vs_stock": 0.5,
    "durable_async_vs_stock": 0.5,
    "durable_sync_buffered_vs_stock": 0.5,
    "ddp_spread_vs_rank0_only": 0.6,
    "ddp_spread_buffered_vs_rank0_only_buffered": 0.6,
    "load_vs_stock": 1.0,
    "reshard_load_vs_stock": 1.0,
}
_RESHARDED = ("dcp_stock", "sharded_sync")  # the checkpoints loaded again on other world sizes
_LAYERS = 8
_BATCH = 8
_ERROR_GRACE_S = 10.0  # after one rank failed, how long the others get to report before they are killed
_TITLES = {
    "dcp_stock": "stock (DCP + meta.pt)",
    "sharded_sync": "ours, sync",
    "sharded_sync_buffered": "ours, sync, direct_io=False",
    "sharded_async": "ours, async",
    "rank0_only": "rank 0 writes all",
    "spread": "spread (every rank)",
    "rank0_only_buffered": "rank 0 writes all, direct_io=False",
    "spread_buffered": "spread, direct_io=False",
}


def fsdp_layout(size_bytes: int) -> tuple[int, int]:
    """(layers, hidden) of the ``nn.Linear(hidden, hidden)`` stack whose weights + AdamW moments
    take about ``size_bytes`` (fp32); ``hidden`` is a multiple of 8, so it splits evenly over 1, 2,
    4 or 8 ranks."""
    elements = max(size_bytes // 12, 1)  # weights, exp_avg, exp_avg_sq: 3 x 4 bytes per parameter
    hidden = max(8, int(math.sqrt(elements / _LAYERS)) // 8 * 8)
    return _LAYERS, hidden


def fsdp_state_bytes(size_bytes: int) -> int:
    layers, hidden = fsdp_layout(size_bytes)
    params = layers * (hidden * hidden + hidden)
    return 12 * params + 4 * 2 * layers  # + one fp32 ``step`` per parameter tensor


# ----------------------------------------------------------------------------------------------
# Rank side


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, hidden: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(_BATCH, hidden, generator=generator)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _build_fsdp(task: Task, rank: int, world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The sharded model and its AdamW after one step. Parameters are created on the meta device and
    materialised shard by shard, so no rank ever holds the whole model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers, hidden = task["layers"], task["hidden"]
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0.0, 0.02, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, optimizer, hidden, seed=0)
    return model, optimizer


def _lightning_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What ``ModelParallelStrategy(save_distributed_checkpoint=True)`` hands to ``save_checkpoint``
    (``Trainer._checkpoint_connector.dump_checkpoint``'s keys, in its order)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=False, cpu_offload=True)
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": version("lightning") or "unknown",
        "state_dict": get_model_state_dict(model, options=options),
        "loops": {"fit_loop": {"state_dict": {}, "epoch_loop.batch_progress": {"total": {"ready": step, "completed": step}}}},
        "callbacks": {},
        "optimizer_states": [get_optimizer_state_dict(model, optimizer, options=options)],
        "lr_schedulers": [],
    }


def _stock_save(checkpoint: dict[str, Any], path: str, rank: int) -> None:
    """``ModelParallelStrategy.save_checkpoint`` with ``save_distributed_checkpoint=True`` (Lightning
    2.6), plus an fsync of ``meta.pt``: DCP's ``FileSystemWriter`` fsyncs its own files, Lightning's
    ``torch.save`` does not."""
    from pathlib import Path

    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    folder = Path(_broadcast(path))
    folder.mkdir(parents=True, exist_ok=True)
    converted = {"state_dict": checkpoint.pop("state_dict")}
    converted.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    _distributed_checkpoint_save(converted, folder)
    if rank == 0:
        torch.save(checkpoint, folder / _METADATA_FILENAME)
        fsync_file(str(folder / _METADATA_FILENAME))


def _stock_load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    from pathlib import Path

    from lightning.fabric.strategies.model_parallel import _load_checkpoint

    state = {"state_dict": model, "optimizer_0": optimizer}  # as ModelParallelStrategy.load_checkpoint
    _load_checkpoint(path=Path(path), state=state, strict=True, optimizer_states_from_list=True)


def _ours_load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``ShardedModelParallelStrategy.load_checkpoint``'s body (default ``verify_on_load="full"``)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from lightning_ckpt.format.dcp import load_sharded

    targets = {"state_dict": get_model_state_dict(model), "optimizer_states": [get_optimizer_state_dict(model, optimizer)]}
    checkpoint = load_sharded(path, targets, strict=True, verify=True)
    model.load_state_dict(checkpoint.pop("state_dict"), strict=True)
    (state,) = checkpoint.pop("optimizer_states")
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(strict=True))


def _state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for param in model.parameters():
        tensors.append(param)
        state = optimizer.state.get(param, {})
        tensors += [state[key] for key in sorted(state) if isinstance(state[key], torch.Tensor)]
    return tensors


def _state_sums(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[float, float]]:
    """(sum, sum of |x|) of every whole tensor of the live state, the same on every rank and for any
    sharding (up to float64 rounding): the fingerprint a load is checked against."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    tensors = _state_tensors(model, optimizer)
    sums = torch.zeros(len(tensors), 2, dtype=torch.float64)
    sharded = torch.zeros(len(tensors), dtype=torch.bool)
    with torch.no_grad():
        for i, tensor in enumerate(tensors):
            if isinstance(tensor, DTensor):
                local, sharded[i] = tensor.to_local(), True
            else:
                local = tensor
            local = local.detach().double()
            sums[i, 0], sums[i, 1] = local.sum(), local.abs().sum()
    replicated = sums.clone()
    sums[~sharded] = 0.0
    dist.all_reduce(sums)  # sharded tensors: the sum of the ranks' pieces; replicated: rank-local values
    sums[~sharded] = replicated[~sharded]
    return [(float(a), float(b)) for a, b in sums.tolist()]


def _same_state(found: list[tuple[float, float]], expected: list[tuple[float, float]]) -> bool:
    if len(found) != len(expected):
        return False
    return all(abs(f[0] - e[0]) <= 1e-9 * max(e[1], 1e-30) and math.isclose(f[1], e[1], rel_tol=1e-9, abs_tol=1e-30)
               for f, e in zip(found, expected))  # fmt: skip


def _zero_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for tensor in _state_tensors(model, optimizer):
            tensor.zero_()


def _timed(operation: Callable[[], Any], then: Callable[[], Any] | None = None) -> Metrics:
    """Meet the other ranks, run ``operation`` (the call a training loop blocks on) and ``then`` (waiting
    until durable); times on the monotonic clock, comparable across the ranks' processes."""
    gc.collect()
    _barrier()
    with RssSampler() as sampler:
        cpu = _cpu_seconds()
        start = time.perf_counter()
        operation()
        returned = time.perf_counter()
        if then is not None:
            then()
        done = time.perf_counter()
        cpu = _cpu_seconds() - cpu
    return {
        "start": start,
        "returned": returned,
        "done": done,
        "call_seconds": returned - start,
        "cpu_seconds": cpu,
        **sampler.metrics(),
    }


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads (not its writer process)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed_load(path: str, load: Callable[[], None], rank: int) -> Metrics:
    _barrier()
    if rank == 0:
        drop_page_cache(path)
    return _timed(load)


def _writer_rss(io: Any) -> float | None:
    pid = io.async_saver.worker.pid
    if pid is None:
        return None
    return proc_status(pid).get("VmHWM", 0) / MB or None


def _fsdp_run(task: Task, rank: int, world_size: int) -> Metrics:
    from lightning_ckpt import ShardedCheckpointIO

    model, optimizer = _build_fsdp(task, rank, world_size)
    contender = task["contender"]
    io = None if contender == "dcp_stock" else ShardedCheckpointIO(**_IO_OPTIONS[contender])
    saves: list[Metrics] = []
    result: Metrics = {"rank": rank}
    paths = [os.path.join(task["run_dir"], f"{task['tag']}-save{i + 1}") for i in range(task["saves"])]
    try:
        for i, path in enumerate(paths):
            if i:
                _train_step(model, optimizer, task["hidden"], seed=i)  # every tensor changes, as in training
            checkpoint = _lightning_checkpoint(model, optimizer, step=i + 1)
            if io is None:
                record = _timed(lambda: _stock_save(checkpoint, path, rank))
            else:
                record = _timed(
                    lambda: io.save_sharded(checkpoint, path, rank, world_size, _broadcast),
                    io.wait if io.async_save else None,
                )
            del checkpoint
            saves.append(record)
        result["saves"] = saves
        result["paths"] = paths
        if io is not None and io.async_save:
            result["writer_peak_rss_mb"] = _writer_rss(io)
        saved = _state_sums(model, optimizer)
        result["saved_sums"] = saved
        _zero_state(model, optimizer)
        load = _stock_load if io is None else _ours_load
        result["load"] = _timed_load(paths[-1], lambda: load(paths[-1], model, optimizer), rank)
        result["load"]["matches"] = _same_state(_state_sums(model, optimizer), saved)
    finally:
        if io is not None:
            io.teardown()
    return result


def _reshard_run(task: Task, rank: int, world_size: int) -> Metrics:
    model, optimizer = _build_fsdp(task, rank, world_size)
    result: Metrics = {"rank": rank}
    for contender, path in task["checkpoints"].items():
        load = _stock_load if contender == "dcp_stock" else _ours_load
        _zero_state(model, optimizer)
        record = _timed_load(path, lambda: load(path, model, optimizer), rank)
        record["matches"] = _same_state(_state_sums(model, optimizer), task["expected"][contender])
        result[contender] = record
    return result


def _ddp_run(task: Task, rank: int, world_size: int) -> Metrics:
    from lightning_ckpt import ShardedCheckpointIO

    checkpoint = build_checkpoint(task["size_bytes"])  # seeded: the same on every rank
    io = ShardedCheckpointIO(**_IO_OPTIONS[task["contender"]])
    saves: list[Metrics] = []
    paths = [os.path.join(task["run_dir"], f"{task['tag']}-save{i + 1}") for i in range(task["saves"])]
    try:
        for i, path in enumerate(paths):
            if task["contender"].startswith("spread"):
                record = _timed(lambda: io.save_sharded(checkpoint, path, rank, world_size, _broadcast))
            else:
                record = _timed(lambda: io.save_checkpoint(checkpoint, path) if rank == 0 else None)
            saves.append(record)
            if task["keep_one"]:
                _barrier()
                if rank == 0 and i:
                    remove_path(paths[i - 1])
        _barrier()
    finally:
        io.teardown()
    return {"rank": rank, "saves": saves, "paths": paths}


def _plain_write(path: str, nbytes: int, direct: bool) -> Metrics:
    """Write ``nbytes`` sequentially and fsync; the buffer is prepared before the common start."""
    if direct:
        nbytes = aligned(nbytes)
        buffer = direct_buffer(nbytes)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT
    else:
        buffer = memoryview(os.urandom(min(BUFFERED_CHUNK, nbytes)))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    _barrier()
    start = time.perf_counter()
    write_and_fsync(path, flags, buffer, nbytes)
    return {"start": start, "done": time.perf_counter(), "bytes": nbytes}


def _disk_run(task: Task, rank: int, world_size: int) -> Metrics:
    result: Metrics = {"rank": rank}
    for kind in DISK_WRITES:
        if kind == "direct" and not hasattr(os, "O_DIRECT"):
            continue
        for writers in (1, world_size):
            path = os.path.join(task["run_dir"], f"{task['tag']}-{kind}-{writers}w-rank{rank}.bin")
            key = f"{kind}_{writers}w"
            try:
                if rank < writers:
                    result[key] = _plain_write(path, -(-task["nbytes"] // writers), kind == "direct")
                else:
                    _barrier()
            except OSError as err:  # e.g. O_DIRECT refused by the filesystem: a note, not a failure
                result[key] = {"error": f"{type(err).__name__}: {err}"}
            finally:
                _barrier()
                remove_path(path)
                if rank == 0:
                    os.sync()  # the removal's discards land before the next write is timed
                _barrier()
    return result


_RUNNERS: dict[str, Callable[[Task, int, int], Metrics]] = {
    "fsdp": _fsdp_run,
    "reshard": _reshard_run,
    "ddp": _ddp_run,
    "disk": _disk_run,
}


def _rank_main(task: Task, rank: int, world_size: int, conn: Connection) -> None:
    """Entry point of one rank process: join the gloo group, run the task, send the result (or the error)."""
    warnings.simplefilter("ignore")
    try:
        import torch.distributed as dist

        torch.set_num_threads(task["threads"])
        dist.init_process_group("gloo", init_method=f"file://{task['store']}", rank=rank, world_size=world_size)
        try:
            reply: Any = {"ok": _RUNNERS[task["kind"]](task, rank, world_size)}
        finally:
            dist.destroy_process_group()
    except BaseException as err:  # reported to the parent, which records it and goes on
        reply = {"error": f"rank {rank}: {type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    conn.send(reply)
    conn.close()


# ----------------------------------------------------------------------------------------------
# Parent side


def run_group(task: Task, world_size: int, timeout: float) -> list[Metrics]:
    """Run ``task`` on ``world_size`` fresh rank processes; their results in rank order.

    Raises ``RuntimeError`` with the first rank's error (the other ranks, stuck in a collective, are
    killed after a grace period) or when the group outlives ``timeout`` seconds.
    """
    context = fresh_process_context()
    store = os.path.join(task["run_dir"], f".store-{secrets.token_hex(4)}")
    task = {**task, "store": store, "threads": max(1, (os.cpu_count() or 1) // world_size)}
    processes, receivers = [], {}
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(
                target=_rank_main, args=(task, rank, world_size, sender), name=f"lightning_ckpt-bench-{task['kind']}-{rank}"
            )
            process.start()
            sender.close()
            processes.append(process)
            receivers[receiver] = rank
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while receivers:
            ready = wait_for_replies(list(receivers), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for receiver in ready:
                rank = receivers.pop(receiver)  # type: ignore[call-overload]
                try:
                    replies[rank] = receiver.recv()  # type: ignore[union-attr]
                except EOFError:
                    code = processes[rank].exitcode
                    replies[rank] = {"error": f"rank {rank} died (exit code {code}; -9 is usually the OOM killer)", "traceback": ""}
                receiver.close()  # type: ignore[union-attr]
                if "error" in replies[rank]:
                    deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
        errors = [replies[r] for r in sorted(replies) if "error" in replies[r]]
        if errors:
            raise RuntimeError(f"{task['kind']} {task.get('contender', '')}: {errors[0]['error']}\n{errors[0]['traceback']}")
        if receivers:
            missing = sorted(receivers.values())
            raise RuntimeError(f"{task['kind']} {task.get('contender', '')}: ranks {missing} did not finish within {timeout:.0f} s")
        return [replies[rank]["ok"] for rank in range(world_size)]
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        remove_path(store)


def _durable(saves: list[Metrics]) -> float:
    return max(s["done"] for s in saves) - min(s["start"] for s in saves)


def _rss(record: Metrics) -> float:
    return record["peak_hwm_mb"] if record.get("peak_hwm_mb") is not None else record["peak_rss_mb"]


def _steady(values: list[float]) -> float | None:
    return statistics.median(values[1:]) if len(values) > 1 else None


def _bytes_per_rank(path: str, world_size: int) -> list[int]:
    """Bytes of the committed checkpoint's files by the rank that wrote them."""
    per_rank = [0] * world_size
    if os.path.isfile(os.path.join(path, "manifest.json")):
        from lightning_ckpt.format.reader import read_manifest

        manifest = read_manifest(path)
        for record in manifest.files.values():
            per_rank[record.rank or 0] += record.size
        per_rank[0] += os.path.getsize(os.path.join(path, "manifest.json"))
        return per_rank
    for name in os.listdir(path):  # a DCP folder: __<rank>_<n>.distcp per rank; .metadata and meta.pt by rank 0
        match = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
        per_rank[int(match.group(1)) if match else 0] += os.path.getsize(os.path.join(path, name))
    return per_rank


def _save_metrics(ranks: list[Metrics], world_size: int) -> Metrics:
    """One run's figures from every rank's records: per save, max over ranks."""
    count = len(ranks[0]["saves"])
    per_save = [[rank["saves"][i] for rank in ranks] for i in range(count)]
    stall = [max(r["call_seconds"] for r in save) for save in per_save]
    durable = [_durable(save) for save in per_save]
    rss = [max(_rss(r) for r in save) for save in per_save]
    cpu = [sum(r["cpu_seconds"] for r in save) for save in per_save]
    nbytes = _bytes_per_rank(ranks[0]["paths"][-1], world_size)
    return {
        "stall_first_seconds": stall[0],
        "stall_steady_seconds": _steady(stall),
        "durable_first_seconds": durable[0],
        "durable_steady_seconds": _steady(durable),
        "cpu_seconds_first": cpu[0],
        "cpu_seconds_steady": _steady(cpu),
        "peak_rss_first_mb": rss[0],
        "peak_rss_steady_mb": max(rss[1:]) if count > 1 else None,
        "bytes_total": sum(nbytes),
        "bytes_max_rank": max(nbytes),
        "bytes_per_rank": nbytes,
        "per_save": [
            {
                "stall_seconds": s,
                "durable_seconds": d,
                "peak_rss_mb": m,
                "cpu_seconds": c,
                "per_rank": [
                    {
                        "call_seconds": r["call_seconds"],
                        "until_done_seconds": r["done"] - r["start"],
                        "cpu_seconds": r["cpu_seconds"],
                        "peak_rss_mb": _rss(r),
                    }
                    for r in save
                ],
            }
            for s, d, m, c, save in zip(stall, durable, rss, cpu, per_save)
        ],
    }


def _load_metrics(records: list[Metrics]) -> Metrics:
    return {
        "seconds": _durable(records),
        "peak_rss_mb": max(_rss(r) for r in records),
        "matches": all(r["matches"] for r in records),
    }


def _disk_metrics(ranks: list[Metrics], world_size: int) -> Metrics:
    out: Metrics = {}
    for kind in DISK_WRITES:
        for writers in (1, world_size):
            key = f"{kind}_{writers}w"
            records = [r[key] for r in ranks if key in r]
            if not records or any("error" in r for r in records):
                out[f"{key}_seconds"] = out[f"{key}_GBps"] = None
                if records:
                    out[f"{key}_error"] = next(r["error"] for r in records if "error" in r)
                continue
            seconds = _durable(records)
            out[f"{key}_seconds"] = seconds
            out[f"{key}_GBps"] = sum(r["bytes"] for r in records) / seconds / GB
        one, many = out.get(f"{kind}_1w_seconds"), out.get(f"{kind}_{world_size}w_seconds")
        out[f"{kind}_{world_size}w_vs_1w_seconds"] = ratio(many, one)
    return out


def _ratios(
    fsdp: dict[str, Metrics | None],
    reshard: dict[str, dict[str, Metrics | None]],
    ddp: dict[str, Metrics | None],
    disk: Metrics | None,
    world_size: int,
) -> Metrics:
    stock = fsdp.get("dcp_stock")
    ratios: Metrics = {"fsdp_ours_over_stock": {}}
    for name in FSDP_CONTENDERS[1:]:
        ours = fsdp.get(name)
        ratios["fsdp_ours_over_stock"][name] = {
            key: ratio(m(ours, key), m(stock, key))
            for key in (
                "stall_first_seconds",
                "stall_steady_seconds",
                "durable_first_seconds",
                "durable_steady_seconds",
                "peak_rss_steady_mb",
                "load_seconds",
            )
        }
    ratios["reshard_load_ours_over_stock"] = {
        size: ratio(m(loads.get("sharded_sync"), "seconds"), m(loads.get("dcp_stock"), "seconds"))
        for size, loads in reshard.items()
    }
    return {**ratios, **_write_ratios(ddp, disk, world_size)}


def _write_ratios(ddp: dict[str, Metrics | None], disk: Metrics | None, world_size: int) -> Metrics:
    ratios: Metrics = {}
    for spread, rank0 in (("spread", "rank0_only"), ("spread_buffered", "rank0_only_buffered")):
        if spread in ddp:
            ratios[f"ddp_{spread}_over_{rank0}"] = {
                key: ratio(m(ddp[spread], key), m(ddp.get(rank0), key))
                for key in ("durable_first_seconds", "durable_steady_seconds", "bytes_max_rank")
            }
    return {
        **ratios,
        "disk_n_writers_over_one_seconds": {
            kind: m(disk, f"{kind}_{world_size}w_vs_1w_seconds") for kind in DISK_WRITES
        },
    }


def _targets(ratios: Metrics, ram_ratios: Metrics | None) -> Metrics:
    fsdp = ratios["fsdp_ours_over_stock"]
    values = {
        "stall_async_vs_stock": fsdp["sharded_async"]["stall_steady_seconds"],
        "durable_sync_vs_stock": fsdp["sharded_sync"]["durable_steady_seconds"],
        "durable_async_vs_stock": fsdp["sharded_async"]["durable_steady_seconds"],
        "durable_sync_buffered_vs_stock": fsdp["sharded_sync_buffered"]["durable_steady_seconds"],
        "ddp_spread_vs_rank0_only": ratios["ddp_spread_over_rank0_only"]["durable_steady_seconds"],
        "ddp_spread_buffered_vs_rank0_only_buffered": ratios["ddp_spread_buffered_over_rank0_only_buffered"][
            "durable_steady_seconds"
        ],
        "load_vs_stock": fsdp["sharded_sync"]["load_seconds"],
    }
    targets = {name: (value, TARGETS[name]) for name, value in values.items()}
    if ram_ratios is not None:
        value = ram_ratios["ddp_spread_over_rank0_only"]["durable_steady_seconds"]
        targets["ddp_spread_vs_rank0_only_ram_fs"] = (value, TARGETS["ddp_spread_vs_rank0_only"])
    for size, value in ratios["reshard_load_ours_over_stock"].items():
        targets[f"reshard_load_vs_stock_on_{size}"] = (value, TARGETS["reshard_load_vs_stock"])
    return {
        name: {"value": value, "target": target, "met": None if value is None else value <= target}
        for name, (value, target) in targets.items()
    }


def render_tables(report: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table

    settings, results = report["settings"], report["results"]
    n = settings["world_size"]
    ratios = results["ratios"]
    reshard = results["reshard"]
    fsdp = Table(
        title=(
            f"FSDP2 on {n} CPU ranks (gloo): {results['fsdp_state_bytes'] / GB:.3g} GB of weights + AdamW state in all,"
            f" medians of {settings['repeats']}"
        ),
        caption="stall = the save call, max over ranks; durable = first rank's call -> last rank durable (async: rank 0's"
        " writer committed); steady = saves 2..N; ΔRSS = the rank's peak over its pre-save RSS, max over ranks; load ="
        " into the live sharded model, page cache dropped, on N ranks and resharded onto M; x = / stock",
    )
    columns = ["contender", "stall 1st s", "stall s", "x", "durable 1st s", "durable s", "x", "ΔRSS 1st MB",
               "ΔRSS MB", "writer RSS MB", "max GB/rank", "load s", "x"]  # fmt: skip
    for size in reshard:
        columns += [f"load on {size} s", "x"]
    for column in columns:
        fsdp.add_column(column, justify="left" if column == "contender" else "right", no_wrap=column == "contender")
    for name in FSDP_CONTENDERS:
        s = results["fsdp"][name]["summary"]
        if s is None:
            fsdp.add_row(_TITLES[name], "error", *["-"] * (len(columns) - 2))
            continue
        r = ratios["fsdp_ours_over_stock"].get(name, {})
        cells = [
            _TITLES[name],
            fmt(m(s, "stall_first_seconds"), 3),
            fmt(m(s, "stall_steady_seconds"), 3),
            fmt(r.get("stall_steady_seconds"), 3),
            fmt(m(s, "durable_first_seconds"), 3),
            fmt(m(s, "durable_steady_seconds"), 3),
            fmt(r.get("durable_steady_seconds")),
            fmt(m(s, "peak_rss_first_mb"), 0),
            fmt(m(s, "peak_rss_steady_mb"), 0),
            fmt(m(s, "writer_peak_rss_mb"), 0),
            fmt((m(s, "bytes_max_rank") or 0) / GB, 3),
            fmt(m(s, "load_seconds"), 3),
            fmt(r.get("load_seconds")),
        ]
        for size, loads in reshard.items():
            entry = loads.get(name)
            if entry is None:
                cells += ["", ""]
                continue
            load_ratio = ratios["reshard_load_ours_over_stock"][size] if name == "sharded_sync" else None
            cells += [fmt(m(entry["summary"], "seconds"), 3), fmt(load_ratio)]
        fsdp.add_row(*cells)
    ddp = Table(
        title=f"DDP on {n} ranks: the {results['ddp_state_bytes'] / GB:.3g} GB Lightning dict replicated on every rank",
        caption="durable = first rank's call -> checkpoint committed; x = / rank 0 writes all; CPU = the ranks' CPU"
        f" seconds during the save, summed ({os.cpu_count()} CPUs: at most {os.cpu_count()} x durable)",
    )
    for column in ("contender", "durable 1st s", "durable s", "x", "GB/s", "CPU s", "ΔRSS MB", "GB per rank"):
        ddp.add_column(column, justify="left" if column == "contender" else "right", no_wrap=column == "contender")
    ram = results.get("ram_fs")
    places = [("", results, ratios)] + ([(" (RAM fs)", ram, ram["ratios"])] if ram else [])
    for suffix, where, where_ratios in places:
        for name in where["ddp"]:
            s = where["ddp"][name]["summary"]
            if s is None:
                ddp.add_row(_TITLES[name] + suffix, "error", *["-"] * 6)
                continue
            durable = m(s, "durable_steady_seconds")
            rate = ratio(m(s, "bytes_total"), durable)
            ddp.add_row(
                _TITLES[name] + suffix,
                fmt(m(s, "durable_first_seconds"), 3),
                fmt(durable, 3),
                fmt(
                    where_ratios[f"ddp_{name}_over_{name.replace('spread', 'rank0_only')}"]["durable_steady_seconds"]
                    if name.startswith("spread")
                    else 1.0
                ),
                fmt(None if rate is None else rate / GB),
                fmt(m(s, "cpu_seconds_steady")),
                fmt(m(s, "peak_rss_steady_mb"), 0),
                " / ".join(f"{b / GB:.3f}" for b in s["bytes_per_rank"]),
            )
    disk = Table(
        title=f"the disk: {results['ddp_state_bytes'] / GB:.3g} GB written + fsynced by 1 writer, and split over {n} writers at once",
        caption=f"x = {n} writers' time / one writer's: below 1 the disk gains from parallel writers; ~1: it is the bottleneck",
    )
    for column in ("write", "1 writer s", "GB/s", f"{n} writers s", "GB/s", "x"):
        disk.add_column(column, justify="left" if column == "write" else "right", no_wrap=column == "write")
    for suffix, where, _ in places:
        d = where["disk"]["summary"]
        for kind in DISK_WRITES:
            disk.add_row(
                {"buffered": "buffered, 64 MB writes", "direct": "O_DIRECT, 16 MB writes"}[kind] + suffix,
                fmt(m(d, f"{kind}_1w_seconds"), 3),
                fmt(m(d, f"{kind}_1w_GBps")),
                fmt(m(d, f"{kind}_{n}w_seconds"), 3),
                fmt(m(d, f"{kind}_{n}w_GBps")),
                fmt(m(d, f"{kind}_{n}w_vs_1w_seconds")),
            )
    targets = Table(title="targets (ours / stock; spread / rank 0 only)")
    for column in ("target", "value", "at most", "met"):
        targets.add_column(column, justify="left" if column == "target" else "right")
    for name, t in results["targets"].items():
        met = "-" if t["met"] is None else ("yes" if t["met"] else "NO")
        targets.add_row(name, fmt(t["value"], 3), fmt(t["target"]), met)
    return Group(fsdp, ddp, disk, targets)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks --mode distributed",
        description=(
            "Multi-rank saves and loads on CPU ranks (gloo): Lightning's stock DCP path against ShardedCheckpointIO"
            " (FSDP2-sharded state), rank-0-only against spread writes (DDP state), and the disk's one- and"
            " N-writer throughput. Each measurement runs in a fresh group of rank processes."
        ),
    )
    parser.add_argument("--mode", choices=("distributed",), default="distributed", help=argparse.SUPPRESS)
    parser.add_argument(
        "--size", default=DEFAULT_SIZE, help=f"state size across all ranks: weights + AdamW moments (default {DEFAULT_SIZE})"
    )
    parser.add_argument("--world-size", type=int, default=DEFAULT_WORLD_SIZE, help=f"ranks (default {DEFAULT_WORLD_SIZE})")
    parser.add_argument(
        "--reshard-world-sizes",
        default=DEFAULT_RESHARD_WORLD_SIZES,
        help="comma list of world sizes that load the FSDP2 checkpoints saved on --world-size ranks"
        f" (default {DEFAULT_RESHARD_WORLD_SIZES})",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement, medians reported (default 3)")
    parser.add_argument(
        "--saves", type=int, default=DEFAULT_SAVES, help=f"saves per run, >= 2 (default {DEFAULT_SAVES}; steady = saves 2..N)"
    )
    parser.add_argument(
        "--dir",
        default=DEFAULT_DIR,
        help=f"where checkpoints are written, on the filesystem under test (default ./{DEFAULT_DIR})",
    )
    parser.add_argument(
        "--ram-dir",
        default=None,
        help="also run the DDP saves and the plain writes in this folder on a RAM-backed filesystem (e.g."
        " /dev/shm): the same comparison where the disk is not the bottleneck (default: not run)",
    )
    add_json_argument(parser)
    parser.add_argument("--timeout", type=float, default=1800.0, help="limit per group of rank processes, seconds (default 1800)")
    return parser


def _parse_world_sizes(text: str, world_size: int) -> list[int]:
    try:
        sizes = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--reshard-world-sizes {text!r}: give a comma list of integers, e.g. '1,4'") from None
    if not sizes or any(size < 1 or size == world_size for size in sizes):
        raise ValueError(f"--reshard-world-sizes {text!r}: each must be at least 1 and differ from --world-size {world_size}")
    return list(dict.fromkeys(sizes))


def _rotated(names: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The contenders in the order repeat ``repeat`` runs them: rotated, so that none always runs
    first after the disk test or last before the next one (the disk's speed drifts)."""
    shift = repeat % len(names) if names else 0
    return names[shift:] + names[:shift]


def _remove_all(paths: list[str]) -> None:
    """Remove checkpoints between groups, then let the filesystem's discards land (``os.sync``)."""
    for path in paths:
        remove_path(path)
    os.sync()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the tables (and the JSON with ``--json``). Returns 0, 1 if a measurement failed, 2 on bad setup."""
    from lightning_ckpt.format.plan import parse_size

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("--world-size must be at least 2 (a multi-rank save)")
    try:
        size_bytes = parse_size(args.size, "--size")
        reshard_sizes = _parse_world_sizes(args.reshard_world_sizes, args.world_size)
    except ValueError as err:
        parser.error(str(err))
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.saves < 2:
        parser.error("--saves must be at least 2 (the first save allocates; steady = saves 2..N)")
    n = args.world_size
    layers, hidden = fsdp_layout(size_bytes)
    fsdp_bytes = fsdp_state_bytes(size_bytes)
    ddp_bytes, _ = state_bytes(size_bytes)
    log = stderr_logger()
    directory = os.path.abspath(args.dir)
    machine = machine_info(directory)
    machine["loadavg_start"] = os.getloadavg()
    log(
        f"{n} ranks; FSDP2 state {fsdp_bytes / GB:.3g} GB ({layers} x Linear({hidden}, {hidden}) + AdamW),"
        f" DDP state {ddp_bytes / GB:.3g} GB on every rank; reshard onto {', '.join(map(str, reshard_sizes))} rank(s)"
    )
    total_ram = machine.get("total_ram_gb")
    if total_ram and total_ram * GB < 1.5 * n * ddp_bytes + 2 * fsdp_bytes:
        log(f"warning: {total_ram:.1f} GB of RAM; the DDP runs hold the whole state on each of {n} ranks")

    fsdp_runs: dict[str, list[Metrics]] = {name: [] for name in FSDP_CONTENDERS}
    reshard_runs = {str(size): {name: [] for name in _RESHARDED} for size in reshard_sizes}
    ddp_runs: dict[str, list[Metrics]] = {name: [] for name in DDP_CONTENDERS}
    disk_runs: list[Metrics] = []
    errors: list[str] = []
    started = time.time()
    common = {"layers": layers, "hidden": hidden, "saves": args.saves}

    def attempt(label: str, task: Task, world_size: int) -> list[Metrics] | None:
        log(label)
        try:
            return run_group(task, world_size, args.timeout)
        except RuntimeError as err:
            errors.append(f"{label}: {err}")
            log(f"{label} FAILED: {str(err).splitlines()[0]}")
            return None

    def writes(
        r: int, run_dir: str, ddp_runs: dict[str, list[Metrics]], disk_runs: list[Metrics], where: str, ram: bool
    ) -> None:
        """The plain writes (before) or the DDP saves (after the FSDP2 groups) of repeat ``r`` in ``run_dir``.

        On the RAM-backed filesystem each save's predecessor is removed right after it (no discards
        to wait for there), so tmpfs reuses the pages just freed: on this VM, memory a process touches
        for the first time costs far more than memory reused, which made the 3rd of 3 kept saves 2-4x
        slower than the 1st.
        """
        step = f"[{r + 1}/{args.repeats}]{where}"
        base = {"run_dir": run_dir, "size_bytes": size_bytes}
        if not ddp_runs:
            out = attempt(f"{step} disk", {**base, "kind": "disk", "tag": f"r{r}-disk", "nbytes": ddp_bytes}, n)
            if out is not None:
                disk_runs.append(_disk_metrics(out, n))
            return
        for name in _rotated(tuple(ddp_runs), r):
            task = {
                **base,
                "saves": args.saves,
                "kind": "ddp",
                "contender": name,
                "tag": f"r{r}-ddp-{name}",
                "keep_one": ram,
            }
            out = attempt(f"{step} ddp {name}", task, n)
            if out is not None:
                ddp_runs[name].append(_save_metrics(out, n))
                _remove_all(out[0]["paths"])

    ram_ddp_runs: dict[str, list[Metrics]] = {name: [] for name in RAM_DDP_CONTENDERS}
    ram_disk_runs: list[Metrics] = []
    ram_directory = os.path.abspath(args.ram_dir) if args.ram_dir else None
    with contextlib.ExitStack() as stack:
        run_dir = stack.enter_context(run_directory(directory))
        ram_run_dir = stack.enter_context(run_directory(ram_directory)) if ram_directory else None
        needs = [("--dir", run_dir, (args.saves + 2) * fsdp_bytes + args.saves * ddp_bytes)]
        if ram_run_dir is not None:
            needs.append(("--ram-dir", ram_run_dir, args.saves * ddp_bytes))
        for option, folder, need in needs:
            free = shutil.disk_usage(folder).free
            if free < need * 1.1:
                log(f"{option} {folder!r} has {free / GB:.1f} GB free; this size needs ~{need / GB:.1f} GB.")
                return 2
        for r in range(args.repeats):
            step = f"[{r + 1}/{args.repeats}]"
            base = {"run_dir": run_dir, "size_bytes": size_bytes}
            writes(r, run_dir, {}, disk_runs, "", ram=False)
            kept: dict[str, str] = {}
            expected: dict[str, Any] = {}
            for name in _rotated(FSDP_CONTENDERS, r):
                task = {**base, **common, "kind": "fsdp", "contender": name, "tag": f"r{r}-{name}"}
                out = attempt(f"{step} fsdp {name}", task, n)
                if out is None:
                    continue
                run = _save_metrics(out, n)
                load = _load_metrics([rank["load"] for rank in out])
                run.update(load_seconds=load["seconds"], load_peak_rss_mb=load["peak_rss_mb"], load_matches=load["matches"])
                if name == "sharded_async":
                    run["writer_peak_rss_mb"] = max((rank.get("writer_peak_rss_mb") or 0) for rank in out) or None
                if not load["matches"]:
                    errors.append(f"{step} fsdp {name}: the loaded state differs from the saved one")
                fsdp_runs[name].append(run)
                paths = out[0]["paths"]
                if name in _RESHARDED:
                    kept[name], expected[name] = paths[-1], out[0]["saved_sums"]
                    paths = paths[:-1]
                _remove_all(paths)
            for size in reshard_sizes if kept else ():
                checkpoints = {name: kept[name] for name in _rotated(tuple(kept), r)}
                task = {**base, **common, "kind": "reshard", "tag": f"r{r}-reshard", "checkpoints": checkpoints, "expected": expected}
                out = attempt(f"{step} reshard {n} -> {size} ranks", task, size)
                for name in kept if out is not None else ():
                    load = _load_metrics([rank[name] for rank in out])  # type: ignore[union-attr]
                    reshard_runs[str(size)][name].append(load)
                    if not load["matches"]:
                        errors.append(f"{step} reshard {n} -> {size} {name}: the loaded state differs from the saved one")
            _remove_all(list(kept.values()))
            writes(r, run_dir, ddp_runs, disk_runs, "", ram=False)
            if ram_run_dir is not None:
                writes(r, ram_run_dir, {}, ram_disk_runs, " RAM fs", ram=True)
                writes(r, ram_run_dir, ram_ddp_runs, ram_disk_runs, " RAM fs", ram=True)
            for folder in (run_dir, ram_run_dir):  # a failed run's files
                if folder is not None:
                    _remove_all([os.path.join(folder, leftover) for leftover in os.listdir(folder)])

    def entry(runs: list[Metrics]) -> Metrics:
        return {"summary": summarize(runs), "runs": runs}

    fsdp = {name: entry(runs) for name, runs in fsdp_runs.items()}
    reshard = {size: {name: entry(runs) for name, runs in loads.items()} for size, loads in reshard_runs.items()}
    ddp = {name: entry(runs) for name, runs in ddp_runs.items()}
    disk = entry(disk_runs)
    ratios = _ratios(
        {k: v["summary"] for k, v in fsdp.items()},
        {size: {k: v["summary"] for k, v in loads.items()} for size, loads in reshard.items()},
        {k: v["summary"] for k, v in ddp.items()},
        disk["summary"],
        n,
    )
    ram_fs = None
    if ram_directory is not None:
        ram_ddp = {name: entry(runs) for name, runs in ram_ddp_runs.items()}
        ram_disk = entry(ram_disk_runs)
        ram_fs = {
            "dir": ram_directory,
            "filesystem": filesystem_of(ram_directory),
            "ddp": ram_ddp,
            "disk": ram_disk,
            "ratios": _write_ratios({k: v["summary"] for k, v in ram_ddp.items()}, ram_disk["summary"], n),
        }
    machine["loadavg_end"] = os.getloadavg()
    results: Metrics = {
        "size": args.size,
        "size_bytes": size_bytes,
        "fsdp_state_bytes": fsdp_bytes,
        "ddp_state_bytes": ddp_bytes,
        "fsdp": fsdp,
        "reshard": reshard,
        "ddp": ddp,
        "disk": disk,
        "ratios": ratios,
        "ram_fs": ram_fs,
        "targets": _targets(ratios, None if ram_fs is None else ram_fs["ratios"]),
        "errors": errors,
    }
    report = {
        **report_header(argv, started),
        "settings": {
            "mode": "distributed",
            "size": args.size,
            "world_size": n,
            "reshard_world_sizes": reshard_sizes,
            "repeats": args.repeats,
            "saves": args.saves,
            "dir": directory,
            "ram_dir": ram_directory,
            "timeout_s": args.timeout,
            "backend": "gloo, CPU; each rank torch.set_num_threads(max(1, cpu_count // world_size))",
            "order": "per repeat: disk; the FSDP2 contenders, rotated by the repeat's index (the reshard loads too);"
            " the reshard groups; the DDP contenders, rotated likewise",
            "processes": "every measurement a fresh group of rank processes forked from a forkserver that preloaded"
            " torch, Lightning and lightning_ckpt",
            "fsdp_model": {"layers": layers, "hidden": hidden, "batch": _BATCH, "optimizer": "AdamW(lr=1e-3)"},
            "durable": {
                "dcp_stock": "every rank's save call returned (DCP fsyncs its files; rank 0 fsyncs meta.pt)",
                "sharded_sync": "every rank's save_sharded returned (rank 0's after committing)",
                "sharded_sync_buffered": "as sharded_sync, with ShardedCheckpointIO(direct_io=False)",
                "sharded_async": "every rank's io.wait() returned (rank 0's once its writer committed)",
                "rank0_only": "rank 0's save_checkpoint returned",
                "spread": "every rank's save_sharded returned",
                "rank0_only_buffered, spread_buffered": "as rank0_only, spread, with ShardedCheckpointIO(direct_io=False)",
            },
            "load": "page cache of the checkpoint's files dropped (POSIX_FADV_DONTNEED) before each load",
            "units": "GB = 1e9 bytes, MB = 1e6 bytes; RSS = peak (VmHWM) minus the rank's RSS just before the operation",
        },
        "machine": machine,
        "results": results,
    }
    emit_report(render_tables(report), report, args.json_path)
    return 1 if errors else 0
