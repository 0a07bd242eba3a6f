"""``python -m benchmarks --mode offload --fsdp2``: ``ChunkedAdamW`` on FSDP2 shards against
``torch.optim.AdamW(fused=True)`` under the same FSDP2 run, on ``--ranks`` CPU ranks (gloo).

Each rank trains a stack of ``--layers`` linear layers of ``--width`` (``fully_shard`` per layer
and on the root) for ``--steps`` timed steps (forward, backward, gradient clipping, ``step()``,
``zero_grad()``) after one untimed step, ``--repeats`` times per contender, in one process group.
Reported per contender: the median step (rank 0's; every rank steps in lockstep), the ratio to
fused AdamW, and the optimizer's host bytes per rank (ChunkedAdamW: its arena; AdamW: its state
tensors). On the CPU FSDP2's ``CPUOffloadPolicy`` changes nothing (the shards already are host
memory), so it has no row here; its GPU rows are in the prepared GPU check.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Any

CONTENDERS = ("FSDP2 + AdamW fused", "FSDP2 + ChunkedAdamW")


def _train(rank: int, world: int, port: int, args: Any, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lightning_ckpt as lc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for name in CONTENDERS:
        runs, host = [], 0
        for _ in range(args.repeats):
            torch.manual_seed(0)
            net = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers)))
            for layer in net:
                fully_shard(layer, mesh=mesh)
            fully_shard(net, mesh=mesh)
            if name.endswith("ChunkedAdamW"):
                opt = lc.ChunkedAdamW(net.parameters(), lr=1e-4, chunk_size=args.chunk_size)
            else:
                opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
            x = torch.randn(args.batch, args.width)

            def step() -> None:
                net(x).pow(2).mean().backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

            step()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            if hasattr(opt, "wait"):
                opt.wait()
            runs.append((time.perf_counter() - start) / args.steps)
            if hasattr(opt, "host_bytes"):
                host = opt.host_bytes
            else:
                host = sum(t.to_local().numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
            local = sum(p.to_local().numel() for p in net.parameters())
            del net, opt
        rows.append({"contender": name, "runs_seconds": runs, "median_step_seconds": statistics.median(runs),
                     "host_optimizer_bytes": host, "local_params": local})  # fmt: skip
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
    for i, name in enumerate(CONTENDERS):
        row = dict(per_rank[0][i])
        row["host_optimizer_bytes_per_rank"] = [r[i]["host_optimizer_bytes"] for r in per_rank]
        row["local_params_per_rank"] = [r[i]["local_params"] for r in per_rank]
        row["ranks"] = args.ranks
        rows.append(row)
    base = rows[0]["median_step_seconds"]
    for row in rows:
        row["vs_adamw"] = row["median_step_seconds"] / base
    return rows


def render_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    from lightning_ckpt.bench.report import fmt

    table = Table(title=f"FSDP2 training step on {rows[0]['ranks']} CPU ranks (medians)")
    for column in ("contender", "step s", "x AdamW fused", "optimizer host MB per rank", "local Mparams per rank"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for row in rows:
        table.add_row(
            row["contender"], fmt(row["median_step_seconds"], 4), fmt(row["vs_adamw"], 3),
            " / ".join(fmt(b / 2**20, 2) for b in row["host_optimizer_bytes_per_rank"]),
            " / ".join(fmt(n / 1e6, 3) for n in row["local_params_per_rank"]),
        )  # fmt: skip
    return table
