"""Generator of ``tests/golden/v3``: a 2-rank save (format version 3, ``SHARDED_FORMAT_VERSION``).

``python tests/golden/make_v3.py`` (from the repository root, CPU only) starts 2 ranks joined by a
gloo process group; each turns :func:`golden_sharded_checkpoint` into what an FSDP2 /
``ModelParallelStrategy`` run hands the plugin (parameters and AdamW moments as DTensors sharded
on dim 0, one of them unevenly) plus the plain tensors a DDP run would hold on every rank
(replicated: each is written by one of its holders), and calls ``save_sharded`` on every rank.
Rank 0 commits the parts into one checkpoint: per-rank shard files, the shared metadata file and
the merged manifest.

Every value is fixed (``torch.manual_seed(0)`` and ``arange``), so the shard files come out
byte for byte the same on every run; the manifest differs only in ``created_by`` (versions) and
its checksum. Regenerate only with a deliberate format change, and once v3 is released make a new
version directory with a ``SHARDED_FORMAT_VERSION`` bump instead.
``tests/unit/test_golden_v3.py`` loads the result without starting processes;
``tests/distributed/test_golden_v3_writer.py`` (marked slow) checks that today's writer still
produces it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

WORLD_SIZE = 2
GOLDEN_V3 = Path(__file__).resolve().parent / "v3" / "epoch=0-step=3.ckpt"
# which parameters and AdamW moments are sharded on dim 0 (the others are replicated)
SHARDED = ("encoder.weight", "encoder.bias", "head.weight")


def golden_sharded_checkpoint() -> dict[str, Any]:
    """The whole checkpoint, with every tensor whole: what a single-process load gives back."""
    generator = torch.Generator().manual_seed(0)
    state = OrderedDict(
        [
            ("encoder.weight", torch.randn(4, 3, generator=generator)),  # 2 rows per rank
            ("encoder.bias", torch.arange(5, dtype=torch.float32)),  # uneven: 3 rows on rank 0, 2 on rank 1
            ("head.weight", torch.randn(2, 4, generator=generator).to(torch.bfloat16)),
            ("norm.weight", torch.tensor([1.0, 0.5, 0.25], dtype=torch.float16)),  # replicated
            ("norm.num_batches_tracked", torch.tensor(3)),  # replicated
        ]
    )
    moments = {
        index: {
            "step": torch.tensor(3.0),
            "exp_avg": torch.full_like(state[name], 0.125, dtype=torch.float32),
            "exp_avg_sq": torch.arange(state[name].numel(), dtype=torch.float32).reshape(state[name].shape) / 64,
        }
        for index, name in enumerate(SHARDED)
    }
    return {
        "epoch": 0,
        "global_step": 3,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": state,
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1, "completed": 0}}}},
        "callbacks": {"EMA": {"shadow": {"encoder.bias": torch.arange(5, dtype=torch.float32) * 0.5}, "decay": 0.99}},
        "optimizer_states": [
            {"state": moments, "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1, 2]}]}
        ],
        "lr_schedulers": [{"last_epoch": 3, "_last_lr": [0.01]}],
        "hyper_parameters": {"hidden": 4, "name": "golden-v3"},
    }


def _rank_checkpoint(checkpoint: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """This rank's view: the tensors of :data:`SHARDED` (and their moments) as ``Shard(0)`` DTensors."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def shard(tensor: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(tensor, mesh, [Shard(0)])

    state = checkpoint["state_dict"]
    for name in SHARDED:
        state[name] = shard(state[name])
    for moments in checkpoint["optimizer_states"][0]["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            moments[key] = shard(moments[key])
    return checkpoint


def _save_on_rank(rank: int, store: str, target: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import lightning_ckpt as lc

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE)
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        io = lc.ShardedCheckpointIO()
        io.use_part_token("golden")  # the same on both ranks: no broadcast needed
        io.save_sharded(_rank_checkpoint(golden_sharded_checkpoint(), mesh), target, rank, WORLD_SIZE, lambda t: t)
        io.teardown()
        dist.barrier()  # rank 0 has committed before either rank leaves
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """``make_v3.py`` rewrites ``tests/golden/v3``; ``make_v3.py FOLDER`` writes the checkpoint
    into FOLDER instead (``tests/distributed/test_golden_v3_writer.py`` compares it)."""
    import torch.multiprocessing as mp

    destination = Path(argv[0]) / GOLDEN_V3.name if argv else GOLDEN_V3
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, GOLDEN_V3.name)
        mp.start_processes(
            _save_on_rank, args=(os.path.join(tmp, "store"), target), nprocs=WORLD_SIZE, start_method="spawn"
        )
        if not argv:
            shutil.rmtree(GOLDEN_V3.parent, ignore_errors=True)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(target, destination)
    print("wrote", destination, sorted(os.listdir(destination)))


if __name__ == "__main__":
    main(sys.argv[1:])
