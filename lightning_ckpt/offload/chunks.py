"""Where optimizer state lives: the chunk layout (pure) and the host arena holding it.

Parameters are packed per param group and dtype, in registration order (the order of the
``params`` given to the optimizer), into chunks of at most ``chunk_numel`` elements. A parameter
larger than a chunk gets a chunk of its own (it is never split, so its gradient stays one view of
one buffer). The host arena holds, per chunk, the fp32 master weights, ``exp_avg`` and
``exp_avg_sq`` as three flat tensors (the moments alone for a chunk whose parameters are their own
master weights: :mod:`lightning_ckpt.offload.inplace`); it is one shared-memory buffer of the
staging pool's kind (:class:`lightning_ckpt.hostmem.SharedBuffer`): allocated once, faulted in (and
page-locked when the parameters are on CUDA) by a background thread, never reallocated.

An async save does not copy the arena on the training thread: the arena is a
:class:`lightning_ckpt.hostmem.DeferredSource`, so the staging pool leaves the optimizer state
views of a checkpoint to it; each claimed chunk is copied into the pool by the save's hand-off
thread (in reverse layout order) or, when the next step reaches the chunk first, by that step just
before it writes the chunk (copy-on-write). Either way the pool receives the chunk as it was when
the save was staged, and each byte once.
Nothing here imports Lightning.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from lightning_ckpt.hostmem import (
    SharedBuffer,
    aligned,
    pin_pieces,
    register_deferred_source,
)

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
    host_offset: int  # byte offset of this chunk's state (its master weights first) in the arena
    # False: the parameters are the master weights (stepped in place: see
    # :mod:`lightning_ckpt.offload.inplace`); the arena holds the two moments only.
    master: bool = True

    def state_offsets(self) -> tuple[int, int, int]:
        """Byte offsets of (master, exp_avg, exp_avg_sq) in the arena (master -1: none)."""
        step = aligned(self.numel * _ITEM)
        avg = self.host_offset + step if self.master else self.host_offset
        return self.host_offset if self.master else -1, avg, avg + step

    @property
    def host_end(self) -> int:
        return self.host_offset + (3 if self.master else 2) * aligned(self.numel * _ITEM)


@dataclass(frozen=True, slots=True)
class Layout:
    chunks: tuple[ChunkSpec, ...]
    nbytes: int  # arena bytes: 12 per element (8 without master), each tensor padded to the staging alignment


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


def restrict(layout: Layout, keep: set[int], masterless: frozenset[int] = frozenset()) -> Layout:
    """Pure: ``layout`` with host memory for the chunks in ``keep`` only (the others get
    ``host_offset=-1``): a rank's arena holds the state of the chunks it owns. The chunks in
    ``masterless`` get no master weights (their parameters are stepped in place)."""
    offset = 0
    chunks = []
    for spec in layout.chunks:
        if spec.index in keep:
            spec = replace(spec, host_offset=offset, master=spec.index not in masterless)
            offset = spec.host_end
        else:
            spec = replace(spec, host_offset=-1)
        chunks.append(spec)
    return Layout(tuple(chunks), offset)


class HostArena:
    """The host memory of a :class:`Layout`: one staging-pool buffer, never reallocated.

    Fresh pages read as zero, so both moments start at zero without a write. Writers call
    ``writable(spec)`` first: the background thread must be past a chunk before it is written
    (on kernels without ``MADV_POPULATE_WRITE`` it zero-fills as it goes), and a save's claimed
    copies of the chunk are made there, before the write (see the module docstring).
    """

    def __init__(self, layout: Layout, pin: bool) -> None:
        held = [spec for spec in layout.chunks if spec.host_offset >= 0]
        self._pool = SharedBuffer()
        # Page-locked in pieces that end at chunk ends: a chunk's copies never span two.
        nbytes = max(layout.nbytes, 1)
        self._pool.reserve(nbytes, pin=pin, pieces=pin_pieces(sorted(spec.host_end for spec in held), nbytes))
        self._bytes = torch.frombuffer(self._pool.buffer, dtype=torch.uint8)
        self.nbytes = layout.nbytes
        self._starts = [spec.host_offset for spec in held]  # ascending: chunks are laid out in order
        self._specs = held
        # Save copies not made yet, per chunk index: (arena source, pool destination). Guarded by
        # ``_lock``, which is held while a chunk's copies are made, so a writer of the chunk
        # (``writable``) waits for a copy in progress rather than overtaking it.
        self._claims: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # Reentrant: the optimizer's finalizer (``close`` -> ``flush``) may run from a garbage
        # collection on a thread that is copying claims already.
        self._lock = threading.RLock()
        self.snapshot_bytes = 0  # bytes copied into staging pools for saves, ever
        self.copied_on_write = 0  # of those, bytes copied by a writer of the chunk (``writable``)
        register_deferred_source(self)

    def tensors(self, spec: ChunkSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat fp32 (master, exp_avg, exp_avg_sq) of a chunk, viewing the arena (master empty
        for a chunk without one)."""
        n = spec.numel * _ITEM
        return tuple(  # type: ignore[return-value]
            self._bytes[o : o + n].view(MASTER_DTYPE) if o >= 0 else torch.empty(0, dtype=MASTER_DTYPE)
            for o in spec.state_offsets()
        )

    def writable(self, spec: ChunkSpec) -> None:
        """Call before writing ``spec``'s chunk (any thread): it is faulted in, and a save's claimed
        copies of it have been made."""
        self._pool.wait_writable(spec.host_end)  # the pool's own wait for its background thread
        if self._claims:  # unlocked peek: claims are added on the training thread, between steps
            self._copy_claims(spec.index, on_write=True)

    def own_storage(self, view: torch.Tensor) -> torch.Tensor:
        """``view`` (contiguous, in this arena) as a tensor with a storage of its own over the same
        bytes: what a parameter aliasing its master weights gets, so that ``torch.save`` or
        safetensors of that parameter write its bytes, not the whole arena."""
        offset = view.data_ptr() - self._bytes.data_ptr()
        assert view.is_contiguous() and 0 <= offset and offset + view.numel() * view.element_size() <= self.nbytes
        own = torch.frombuffer(self._pool.buffer, dtype=view.dtype, count=view.numel(), offset=offset)
        return own.view(view.shape)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Does ``tensor``'s data lie in this arena?"""
        start = self._bytes.data_ptr()
        return self._bytes.numel() > 0 and start <= tensor.data_ptr() < start + self.nbytes

    # -- DeferredSource: the staging pool leaves the arena's bytes of a save to it -------------

    def claim(self, source: torch.Tensor, destination: torch.Tensor) -> bool:
        """Take over copying ``source`` (a view of this arena) into ``destination`` (staging pool)."""
        if self._bytes.numel() == 0 or source.device.type != "cpu":
            return False
        offset = source.data_ptr() - self._bytes.data_ptr()
        nbytes = source.numel() * source.element_size()
        i = bisect.bisect_right(self._starts, offset) - 1
        if offset < 0 or offset + nbytes > self.nbytes or i < 0 or offset + nbytes > self._specs[i].host_end:
            return False
        if offset < self._specs[i].state_offsets()[1]:
            # Master weights (the parameters themselves where they alias them): written by more
            # than ``writable``'s callers (a user's ``load_state_dict`` into the model), so copied now.
            # A chunk without master weights starts at its ``exp_avg``: all of it is claimed.
            return False
        with self._lock:
            self._claims.setdefault(self._specs[i].index, []).append((source, destination))
        return True

    def settled(self) -> bool:
        return not self._claims

    def flush(self) -> None:
        """Copy every claimed chunk not copied yet, last chunk first: the next step writes them
        first to last, so the two meet in the middle and neither waits for the other."""
        with self._lock:
            order = sorted(self._claims, reverse=True)
        for index in order:  # the lock is let go between chunks: a step may take its own first
            self._copy_claims(index, on_write=False)

    def _copy_claims(self, index: int, on_write: bool) -> None:
        with self._lock:
            claims = self._claims.get(index)
            if not claims:
                return
            for source, destination in claims:
                destination.copy_(source)
                nbytes = source.numel() * source.element_size()
                self.snapshot_bytes += nbytes
                if on_write:
                    self.copied_on_write += nbytes
            del self._claims[index]

    @property
    def pinned_bytes(self) -> int:
        return self._pool.pinned_bytes

    def close(self) -> None:
        self.flush()  # a save still waiting for its copies gets them before the memory goes
        self._bytes = torch.empty(0, dtype=torch.uint8)
        self._pool.close()
