"""Where optimizer state lives: the chunk layout (pure) and the host arena holding it.

Parameters are packed per param group and dtype, in registration order (the order of the
``params`` given to the optimizer), into chunks of at most ``chunk_numel`` elements. A parameter
larger than a chunk gets a chunk of its own (it is never split, so its gradient stays one view of
one buffer). The host arena holds, per chunk, the fp32 master weights, ``exp_avg`` and
``exp_avg_sq`` as three flat tensors; it is one shared-memory buffer of the staging pool's kind
(:class:`lightning_ckpt.staging.StagingPool`): allocated once, faulted in (and page-locked when the
parameters are on CUDA) by a background thread, never reallocated.
Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from lightning_ckpt.staging import StagingPool, aligned

MASTER_DTYPE = torch.float32
_ITEM = 4  # bytes per element of the master weights and both moments


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter's place in its chunk: elements ``[offset, offset + numel)``."""

    param: int  # index into the optimizer's flat list of packed parameters
    offset: int
    numel: int


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One chunk: parameters of one group and dtype, laid out back to back."""

    index: int
    group: int
    dtype: torch.dtype  # the parameters' (and their gradients') dtype
    slots: tuple[Slot, ...]
    numel: int
    host_offset: int  # byte offset of this chunk's master weights in the arena

    def state_offsets(self) -> tuple[int, int, int]:
        """Byte offsets of (master, exp_avg, exp_avg_sq) in the arena."""
        step = aligned(self.numel * _ITEM)
        return self.host_offset, self.host_offset + step, self.host_offset + 2 * step

    @property
    def host_end(self) -> int:
        return self.host_offset + 3 * aligned(self.numel * _ITEM)


@dataclass(frozen=True, slots=True)
class Layout:
    chunks: tuple[ChunkSpec, ...]
    nbytes: int  # arena bytes: 12 per element, each tensor padded to the staging alignment


def plan_chunks(params: Sequence[tuple[int, int, torch.dtype]], chunk_numel: int) -> Layout:
    """Pure: pack ``(group, numel, dtype)`` per parameter, in the given order, into chunks.

    Chunks of one (group, dtype) fill in order; a parameter opens a new chunk of its (group,
    dtype) when it does not fit the open one.
    """
    if chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
    open_chunks: dict[tuple[int, torch.dtype], list[Slot]] = {}
    open_numel: dict[tuple[int, torch.dtype], int] = {}
    closed: list[tuple[int, torch.dtype, list[Slot], int]] = []
    order: list[tuple[int, torch.dtype]] = []  # chunk keys in the order they were opened

    def close(key: tuple[int, torch.dtype]) -> None:
        closed.append((key[0], key[1], open_chunks.pop(key), open_numel.pop(key)))

    for index, (group, numel, dtype) in enumerate(params):
        key = (group, dtype)
        if key in open_chunks and open_numel[key] + numel > chunk_numel:
            close(key)
        if key not in open_chunks:
            open_chunks[key], open_numel[key] = [], 0
            order.append(key)
        open_chunks[key].append(Slot(index, open_numel[key], numel))
        open_numel[key] += numel
    for key in list(open_chunks):
        close(key)
    # Chunks in the order their first parameter was registered.
    closed.sort(key=lambda c: c[2][0].param)
    chunks = []
    offset = 0
    for i, (group, dtype, slots, numel) in enumerate(closed):
        spec = ChunkSpec(i, group, dtype, tuple(slots), numel, offset)
        chunks.append(spec)
        offset = spec.host_end
    return Layout(tuple(chunks), offset)


def assign_owners(layout: Layout, world_size: int) -> tuple[int, ...]:
    """Pure: the rank owning each chunk (in layout order, each to the least-loaded rank by
    elements, ties to the lowest rank). Every rank computes the same answer from the same layout."""
    load = [0] * world_size
    owners = []
    for spec in layout.chunks:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners.append(rank)
        load[rank] += spec.numel
    return tuple(owners)


def restrict(layout: Layout, keep: set[int]) -> Layout:
    """Pure: ``layout`` with host memory for the chunks in ``keep`` only (the others get
    ``host_offset=-1``): a rank's arena holds the state of the chunks it owns."""
    offset = 0
    chunks = []
    for spec in layout.chunks:
        if spec.index in keep:
            spec = replace(spec, host_offset=offset)
            offset = spec.host_end
        else:
            spec = replace(spec, host_offset=-1)
        chunks.append(spec)
    return Layout(tuple(chunks), offset)


class HostArena:
    """The host memory of a :class:`Layout`: one staging-pool buffer, never reallocated.

    Fresh pages read as zero, so both moments start at zero without a write. Writers call
    ``writable(spec)`` first: the background thread must be past a chunk before it is written
    (on kernels without ``MADV_POPULATE_WRITE`` it zero-fills as it goes).
    """

    def __init__(self, layout: Layout, pin: bool) -> None:
        self._pool = StagingPool()
        self._pool.reserve(max(layout.nbytes, 1), pin=pin)
        self._bytes = torch.frombuffer(self._pool.buffer, dtype=torch.uint8)
        self.nbytes = layout.nbytes

    def tensors(self, spec: ChunkSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat fp32 (master, exp_avg, exp_avg_sq) of a chunk, viewing the arena."""
        n = spec.numel * _ITEM
        return tuple(  # type: ignore[return-value]
            self._bytes[o : o + n].view(MASTER_DTYPE) for o in spec.state_offsets()
        )

    def writable(self, spec: ChunkSpec) -> None:
        self._pool.wait_writable(spec.host_end)  # the pool's own wait for its background thread

    @property
    def pinned_bytes(self) -> int:
        return self._pool.pinned_bytes

    def close(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)
        self._pool.close()
