"""Run by test_chunked_adamw_fsdp2.py as a script: ``chunked_adamw_fsdp2.py REPORT`` spawns 2 CPU
ranks (gloo), each training the same FSDP2-sharded network (``fully_shard`` per layer and on the
root) with ``torch.optim.AdamW(fused=True)`` and then with ``ChunkedAdamW`` whose worker starts
every chunk late; rank 0 writes the report: losses and gathered weights equal (fp32, and bf16
compute under ``MixedPrecisionPolicy``), each rank's host bytes against its local shards, the
collectives run inside ``step()``, and whether steps were still running after ``step()`` returned.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning_ckpt as lc  # noqa: E402

STEPS, ACCUMULATE = 6, 2
COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "barrier", "send", "recv", "scatter", "gather", "all_to_all", "all_to_all_single",
)  # fmt: skip


class Counter:
    """Counts calls of torch.distributed's collectives while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[str] = []
        for name in COLLECTIVES:
            for module in (dist, dist.distributed_c10d):
                original = getattr(module, name)
                setattr(module, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            if self.on:
                self.calls.append(name)
            return original(*args, **kwargs)

        return counted


def build(chunked: bool, mesh, mixed: bool):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3)
    )
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}]
    if chunked:
        return net, lc.ChunkedAdamW(groups, lr=1e-2, chunk_size="1KiB")
    return net, torch.optim.AdamW(groups, lr=1e-2, fused=True)


def train(rank: int, chunked: bool, mesh, counter: Counter, mixed: bool = False) -> dict:
    net, opt = build(chunked, mesh, mixed)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    pending_after_step = 0
    if chunked:  # every chunk starts 5 ms late: the next forward must wait for its shards
        run = opt._worker.run
        opt._worker.run = lambda job: (time.sleep(0.005), run(job))[1]
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(STEPS):
        for _ in range(ACCUMULATE):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        counter.on = True
        opt.step()
        counter.on = False
        if chunked:
            pending_after_step += sum(not c.done.is_set() for c in opt._chunks)
            counter.on = True
            opt.wait()
            counter.on = False
        scheduler.step()
        opt.zero_grad()
    report = {"losses": losses, "weights": {n: p.full_tensor() for n, p in net.named_parameters()}}
    if chunked:
        local = sum(p.to_local().numel() for p in net.parameters())
        chunks = opt.layout.chunks
        report.update(
            host_bytes=opt.host_bytes, local_params=local, pending_after_step=pending_after_step,
            chunk_params=[spec.numel for spec in chunks], chunks_with_master=sum(spec.master for spec in chunks),
        )  # fmt: skip
    return report


def main(rank: int, world: int, path: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    counter = Counter()
    reference, chunked = train(rank, False, mesh, counter), train(rank, True, mesh, counter)
    collectives_in_step = list(counter.calls)
    mixed_reference, mixed = train(rank, False, mesh, counter, mixed=True), train(rank, True, mesh, counter, mixed=True)
    per_rank = [None] * world
    keys = ("host_bytes", "local_params", "pending_after_step", "chunk_params", "chunks_with_master")
    dist.all_gather_object(per_rank, {**{k: chunked[k] for k in keys}, "collectives_in_step": collectives_in_step})
    if rank == 0:
        worst_mixed = max((mixed["weights"][n] - w).abs().max().item() for n, w in mixed_reference["weights"].items())
        with open(path, "w") as f:
            json.dump({
                "losses_equal": chunked["losses"] == reference["losses"],
                "weights_equal": all(torch.equal(chunked["weights"][n], w) for n, w in reference["weights"].items()),
                "total_params": sum(w.numel() for w in reference["weights"].values()),
                "mixed_max_abs_difference": worst_mixed,
                "mixed_losses_close": all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(mixed["losses"], mixed_reference["losses"])),
                "ranks": per_rank,
            }, f)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(main, args=(2, sys.argv[1], port), nprocs=2)
