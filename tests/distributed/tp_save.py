"""Run by test_sharded.py: tensor-parallel DTensor layouts on 2 CPU ranks (gloo), no Trainer.

Saves ``Shard(0)`` (uneven), ``Shard(1)`` and ``Replicate`` DTensors plus a plain tensor with
``ShardedCheckpointIO.save_sharded`` from both ranks, then loads them back with ``load_sharded``
into the same layout and into a data-parallel one (everything ``Shard(0)``), comparing whole
tensors. Rank 0 writes the JSON report to ``argv[1]``; the checkpoint is ``<dir>/tp.ckpt``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from helpers import close_process_group  # noqa: E402

FULL = {
    "attn.wq": torch.arange(5 * 6, dtype=torch.float32).reshape(5, 6),  # Shard(0), uneven on 2 ranks
    "attn.wo": torch.arange(4 * 7, dtype=torch.bfloat16).reshape(4, 7),  # Shard(1), uneven
    "norm.weight": torch.linspace(0, 1, 9),  # Replicate
    "step": torch.tensor(11),  # plain tensor
}


def _layout(name: str, tensor_parallel: bool):
    from torch.distributed.tensor import Replicate, Shard

    if not tensor_parallel:
        return [Shard(0)]
    return {"attn.wq": [Shard(0)], "attn.wo": [Shard(1)], "norm.weight": [Replicate()]}[name]


def _state(mesh, tensor_parallel: bool, zeros: bool) -> dict:
    from torch.distributed.tensor import distribute_tensor

    state = {}
    for name, full in FULL.items():
        value = torch.zeros_like(full) if zeros else full
        state[name] = value.clone() if name == "step" else distribute_tensor(value, mesh, _layout(name, tensor_parallel))
    return state


def _whole(state: dict) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def _rank(rank: int, folder: str, report: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_ckpt as lc
    from lightning_ckpt.format.dcp import load_sharded

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    path = os.path.join(folder, "tp.ckpt")

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    io = lc.ShardedCheckpointIO()
    io.save_sharded({"state_dict": _state(mesh, True, zeros=False), "epoch": 3}, path, rank, 2, broadcast)
    dist.barrier()  # rank 0 committed before anyone reads (the test's ordering, not the save's)
    results = {}
    for name, tensor_parallel in (("same_layout", True), ("data_parallel", False)):
        target = _state(mesh, tensor_parallel, zeros=True)
        loaded = load_sharded(path, {"state_dict": target})
        whole = _whole(target)
        results[name] = all(torch.equal(whole[k], FULL[k]) for k in FULL) and loaded["epoch"] == 3
    io.teardown()
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(report, "w") as f:
            json.dump({"ranks": gathered}, f)
    close_process_group()


if __name__ == "__main__":
    report = sys.argv[1]
    mp.spawn(_rank, args=(os.path.dirname(os.path.abspath(report)), report), nprocs=2)
