"""Each rank's own share of a sharded ``ChunkedAdamW``'s state, for saves where every rank writes.

Under DDP a sharded ``ChunkedAdamW`` holds the moments of the chunks it owns only. Its plain
``state_dict()`` gathers the rest from their owners (a broadcast per chunk), so that
``torch.save`` of it is torch's full AdamW format. A multi-rank save (every rank writes its part,
``ShardedCheckpointIO.save_sharded``) needs no gather: inside :func:`own_shares`, ``state_dict()``
returns each moment as a ``DTensor`` replicated over a mesh of its owner rank alone (a view of the
owner's arena; an empty local tensor elsewhere). The multi-rank planner (``distributed.plan_part``)
has a DTensor's pieces written by the ranks of its mesh, so each rank writes its own chunks; a
load assembles whole tensors (torch's format again), on any number of ranks.

``owner_meshes`` is a collective (process groups are made), run once, where the optimizer is
built; nothing else here is. Called on the main thread, every rank alike.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

_wanted = threading.local()


@contextmanager
def own_shares(enabled: bool = True) -> Iterator[None]:
    """Inside (``enabled``), sharded ``ChunkedAdamW`` state dicts hold this rank's share only (see
    the module docstring). Enter it around building a checkpoint that every rank writes a part of."""
    before = getattr(_wanted, "on", False)
    _wanted.on = enabled or before
    try:
        yield
    finally:
        _wanted.on = before


def shares_wanted() -> bool:
    return getattr(_wanted, "on", False)


def owner_meshes(world_size: int) -> list[DeviceMesh]:
    """One mesh per global rank, holding that rank alone (gloo groups: the moments are host memory
    whatever the training backend). A collective: every rank, in the same order."""
    from torch.distributed.device_mesh import DeviceMesh

    return [DeviceMesh("cpu", [rank], backend_override=(("gloo", None),)) for rank in range(world_size)]


def placed(local: torch.Tensor | None, shape: torch.Size, mesh: DeviceMesh) -> DTensor:
    """An fp32 ``DTensor`` of ``shape`` held whole by the one rank of ``mesh``: ``local`` is its data
    there (viewed, not copied), ``None`` elsewhere."""
    from torch.distributed.tensor import DTensor, Replicate

    data = torch.empty(0) if local is None else local
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(data, mesh, [Replicate()], run_check=False, shape=torch.Size(shape), stride=stride)
