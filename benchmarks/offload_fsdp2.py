"""``python -m benchmarks --mode offload --fsdp2``: ``ChunkedAdamW`` on FSDP2 shards against
``torch.optim.AdamW(fused=True)`` under the same FSDP2 run, on ``--ranks`` CPU ranks (gloo), or
on one GPU (``--device cuda``, one rank). ``--ddp`` instead: the stack under torch's DDP, with
``ChunkedAdamW`` sharding its chunks across the ranks and sending the updated values over gloo
(``exchange="host"``) and, on ``--ranks`` GPUs (NCCL), over NCCL (``exchange="device"``).

Each rank trains a stack of ``--layers`` linear layers of ``--width`` (``fully_shard`` per layer
and on the root) on ``--batch`` rows (tokens) for ``--steps`` timed steps (forward, backward,
gradient clipping, ``step()``, ``zero_grad()``) after one untimed step, ``--repeats`` times per
contender, in one process group. Reported per contender: the median step (rank 0's; every rank
steps in lockstep), the ratio to the first row, the optimizer's host bytes per rank
(ChunkedAdamW: its arena; torch's: its state tensors) and, on CUDA, the allocator's peak.

On the CPU FSDP2's ``CPUOffloadPolicy`` changes nothing (the shards already are host memory):
two rows. On CUDA (bf16 compute, ``MixedPrecisionPolicy``) four: the shards on the GPU with
fused AdamW on the GPU and with ``ChunkedAdamW``; the shards on the host (``CPUOffloadPolicy``)
with torch's fused CPU AdamW, FSDP2's own offloaded step, and with ``ChunkedAdamW``; and torchao's
``CPUOffloadOptimizer`` (shards on the GPU) where torchao is importable.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

# name -> (CPUOffloadPolicy, optimizer)
CONTENDERS = {
    "FSDP2 + AdamW fused": (False, "adamw"),
    "FSDP2 + ChunkedAdamW": (False, "chunked"),
    "FSDP2 CPUOffloadPolicy + AdamW fused (CPU)": (True, "adamw"),
    "FSDP2 CPUOffloadPolicy + ChunkedAdamW": (True, "chunked"),
    "FSDP2 + torchao CPUOffloadOptimizer": (False, "torchao"),
}
CPU_CONTENDERS = ("FSDP2 + AdamW fused", "FSDP2 + ChunkedAdamW")
# --ddp: name -> ChunkedAdamW's arguments (None: torch's fused AdamW)
DDP_CONTENDERS: dict[str, dict[str, Any] | None] = {
    "DDP + AdamW fused": None,
    "DDP + ChunkedAdamW, every rank steps all": {"shard_across_ranks": False},
    "DDP + ChunkedAdamW, host exchange (gloo)": {"exchange": "host"},
    "DDP + ChunkedAdamW, device exchange (NCCL)": {"exchange": "device"},
}


def contenders(device: str, ddp: bool = False) -> list[str]:
    """The rows of ``device``: torchao's only where it is importable; the device exchange on CUDA only."""
    if ddp:
        return [n for n, kw in DDP_CONTENDERS.items() if (kw or {}).get("exchange") != "device" or device == "cuda"]
    if device == "cpu":
        return list(CPU_CONTENDERS)
    import importlib.util

    return [n for n, (_, kind) in CONTENDERS.items() if kind != "torchao" or importlib.util.find_spec("torchao")]


def _train(rank: int, world: int, port: int, args: Any, queue: Any) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    import lightning_ckpt as lc
    from lightning_ckpt.offload.stepper import local_of

    cuda = args.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device(args.device, rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", rank=rank, world_size=world)
    mesh = None if args.ddp else init_device_mesh(args.device, (world,))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for name in contenders(args.device, args.ddp):
        offload, kind = CONTENDERS[name] if not args.ddp else (False, "chunked" if DDP_CONTENDERS[name] else "adamw")
        runs, peaks, host, local, backend = [], [], 0, 0, None
        try:
            for _ in range(args.repeats):
                torch.manual_seed(0)
                net = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers))).to(device)
                if args.ddp:
                    model: Any = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device] if cuda else None)
                else:
                    policy = {
                        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
                        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16) if cuda else MixedPrecisionPolicy(),
                    }
                    for layer in net:
                        fully_shard(layer, mesh=mesh, **policy)
                    model = fully_shard(net, mesh=mesh, **policy)
                if kind == "chunked":
                    options = DDP_CONTENDERS[name] if args.ddp else {}
                    opt = lc.ChunkedAdamW(net.parameters(), lr=1e-4, chunk_size=args.chunk_size, **options)
                    backend = opt.exchange_backend
                elif kind == "torchao":
                    from torchao.optim import CPUOffloadOptimizer

                    opt = CPUOffloadOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-4, fused=True)
                else:
                    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
                x = torch.randn(args.batch, args.width, device=device)

                def step() -> None:
                    # Lightning's order: zero_grad() after the forward, which ChunkedAdamW's last
                    # step overlaps (zero_grad() waits for it). DDP on CUDA computes in bf16 as
                    # the FSDP2 rows do (their MixedPrecisionPolicy).
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and args.ddp):
                        out = model(x)
                    opt.zero_grad()
                    out.float().pow(2).mean().backward()
                    if kind != "torchao":  # it has no gradient clipping across its host copies
                        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                    opt.step()

                step()
                sync()
                dist.barrier()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                if hasattr(opt, "wait"):
                    opt.wait()
                sync()
                runs.append((time.perf_counter() - start) / args.steps)
                if cuda:
                    peaks.append(torch.cuda.max_memory_allocated())
                if hasattr(opt, "host_bytes"):
                    host = opt.host_bytes
                elif kind == "adamw":
                    host = sum(
                        local_of(t).numel() * t.element_size()
                        for s in opt.state.values() for k, t in s.items()
                        if k != "step" and local_of(t).device.type == "cpu"
                    )  # fmt: skip
                local = sum(local_of(p).numel() for p in net.parameters())
                net = model = opt = step = None  # the optimizer's arena, the model's device memory
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
        except Exception as exc:  # a contender that cannot run here (torchao on DTensors): its row says why
            rows.append({"contender": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"})
            net = model = opt = step = None
            gc.collect()
            continue
        rows.append({"contender": name, "runs_seconds": runs, "median_step_seconds": statistics.median(runs),
                     "host_optimizer_bytes": host, "local_params": local, "tokens_per_step": args.batch,
                     "parallel": "DDP" if args.ddp else "FSDP2", "exchange_backend": backend,
                     **({"peak_device_bytes": statistics.median(peaks)} if peaks else {})})  # fmt: skip
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def run(args: Any) -> list[dict[str, Any]]:
    """Rows of the FSDP2 comparison (rank 0's step times; host bytes of every rank)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_train, args=(args.ranks, port, args, queue), nprocs=args.ranks, start_method="spawn")
    per_rank = queue.get()
    rows = []
    for i, name in enumerate(contenders(args.device, args.ddp)):
        row = dict(per_rank[0][i])
        row["ranks"] = args.ranks
        if "error" not in row:
            row["host_optimizer_bytes_per_rank"] = [r[i]["host_optimizer_bytes"] for r in per_rank]
            row["local_params_per_rank"] = [r[i]["local_params"] for r in per_rank]
        rows.append(row)
    by_name = {row["contender"]: row for row in rows if "error" not in row}
    first = rows[0].get("median_step_seconds")
    for row in by_name.values():
        row["vs_adamw"] = row["median_step_seconds"] / first if first else None
    # the target: ChunkedAdamW against torch's AdamW, both on the offloaded shards
    offloaded = by_name.get("FSDP2 CPUOffloadPolicy + AdamW fused (CPU)")
    if offloaded and "FSDP2 CPUOffloadPolicy + ChunkedAdamW" in by_name:
        row = by_name["FSDP2 CPUOffloadPolicy + ChunkedAdamW"]
        row["vs_offloaded_adamw"] = row["median_step_seconds"] / offloaded["median_step_seconds"]
    return rows


def render_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    from lightning_ckpt.bench.report import fmt

    ranks = rows[0]["ranks"]
    gpu = any("peak_device_bytes" in row for row in rows)
    where = (f"{ranks} GPUs" if ranks > 1 else "one GPU") if gpu else f"{ranks} CPU ranks"
    tokens = next((row["tokens_per_step"] for row in rows if "tokens_per_step" in row), "-")
    parallel = next((row["parallel"] for row in rows if "parallel" in row), "FSDP2")
    table = Table(title=f"{parallel} training step on {where}, {tokens} tokens per rank (medians)")
    columns = ["contender", "step s", "x first row", "x offloaded AdamW", "peak device MB", "optimizer host MB per rank", "local Mparams per rank"]
    if parallel == "DDP":
        columns.remove("x offloaded AdamW")
    if not gpu:
        columns.remove("peak device MB")
    for column in columns:
        table.add_column(column, justify="left" if column == "contender" else "right")
    for row in rows:
        if "error" in row:
            table.add_row(row["contender"], row["error"], *("-" * (len(columns) - 2)))
            continue
        peak = row.get("peak_device_bytes")
        cells = {
            "x offloaded AdamW": fmt(row.get("vs_offloaded_adamw"), 3),
            "peak device MB": fmt(peak / 2**20 if peak else None, 1),
        }
        table.add_row(
            row["contender"], fmt(row["median_step_seconds"], 4), fmt(row["vs_adamw"], 3),
            *(cells[c] for c in columns[3:-2]),
            " / ".join(fmt(b / 2**20, 2) for b in row["host_optimizer_bytes_per_rank"]),
            " / ".join(fmt(n / 1e6, 3) for n in row["local_params_per_rank"]),
        )  # fmt: skip
    return table
