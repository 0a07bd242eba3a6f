"""Each rank's own share of a sharded ``ChunkedAdamW``'s state, for saves where every rank writes.

Under DDP a sharded ``ChunkedAdamW`` holds the moments of the chunks it owns only. Its plain
``state_dict()`` gathers the rest from their owners (a broadcast per chunk), so that
``torch.save`` of it is torch's full AdamW format. A multi-rank save (every rank writes its part,
``ShardedCheckpointIO.save_sharded``) needs no gather: inside :func:`own_shares`, ``state_dict()``
returns each moment as a ``ShardedTensor`` of one shard placed on its owner rank (a view of the
owner's arena; no local shard elsewhere). The multi-rank planner (``distributed.plan_part``) has a
ShardedTensor's shards written by the rank that holds them, so each rank writes its own chunks;
a load assembles whole tensors (torch's format again), on any number of ranks.

No collective runs here. Called on the main thread, every rank alike.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

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


def placed(local: torch.Tensor | None, shape: torch.Size, owner: int) -> ShardedTensor:
    """A ``ShardedTensor`` of ``shape`` (fp32) held whole by global rank ``owner``: ``local`` is its
    data on the owner, ``None`` elsewhere. Built from metadata every rank knows: no collective."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    metadata = ShardMetadata([0] * len(shape), list(shape), f"rank:{owner}/cpu")
    whole = ShardedTensorMetadata([metadata], torch.Size(shape), TensorProperties(dtype=torch.float32))
    shards = [] if local is None else [Shard(local, metadata)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, whole)
