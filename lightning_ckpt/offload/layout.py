"""Where each parameter of ``ChunkedOffloadStrategy`` lives in host memory.

The parameters, in the order given (first use, after the warm-up), are packed into chunks of at
most ``chunk_bytes`` (:func:`lightning_ckpt.offload.chunks.plan_chunks`; here each element is a
byte, every parameter padded to its alignment). The host memory is one buffer of the staging
pool's kind, page-locked on CUDA with ``cudaHostRegister`` (torch's pinned allocator would round
each chunk up to a power of two): the chunks, then the gradient buffers of the chunks that get
gradients. Regions start at page boundaries and the pool is page-locked in pieces that end at
region ends, so no copy of a region spans two registrations.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from lightning_ckpt.hostmem import SharedBuffer, aligned, pin_pieces
from lightning_ckpt.offload.chunks import ChunkSpec, plan_chunks

# Bytes; every slot and parameter offset is a multiple, so any dtype views it. On CUDA a
# parameter's address is as aligned as the caching allocator's (cuBLAS picks kernels by pointer
# alignment: a less aligned view could run another kernel than the same tensor resident, with
# other last bits).
ALIGN = 64
CUDA_ALIGN = 256


@dataclass
class HostLayout:
    """The chunks of ``params`` and their host memory (``pool``: the caller closes it)."""

    params: list[torch.nn.Parameter]
    specs: list[ChunkSpec]
    chunk_nbytes: list[int]
    places: list[tuple[int, int]]  # per parameter: (its chunk, its byte offset in the chunk)
    host: list[torch.Tensor]  # per chunk: its bytes in the pool
    grad_buffers: dict[int, torch.Tensor]  # per chunk with gradients: their bytes in the pool
    pool: SharedBuffer

    def __post_init__(self) -> None:
        self._place_of = {id(p): place for p, place in zip(self.params, self.places)}
        self._offsets = [[slot.offset for slot in spec.slots] for spec in self.specs]

    def holds(self, t: torch.Tensor) -> bool:
        """Is ``t`` one of the parameters laid out here (the object, not a view of it)?"""
        return id(t) in self._place_of

    def place_of(self, p: torch.Tensor) -> tuple[int, int]:
        """``p``'s chunk and byte offset in it."""
        return self._place_of[id(p)]

    def param_at(self, chunk: int, at: int) -> tuple[torch.nn.Parameter, int]:
        """The parameter holding byte ``at`` of ``chunk`` and the byte's offset in it."""
        k = bisect.bisect_right(self._offsets[chunk], at) - 1
        slot = self.specs[chunk].slots[k]
        return self.params[slot.param], at - slot.offset

    @staticmethod
    def view(buffer: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
        """``p``'s place (bytes from ``offset`` of a chunk's ``buffer``) as ``p``'s dtype and shape."""
        n = p.numel() * p.element_size()
        return buffer[offset : offset + n].view(p.dtype).view(p.shape)


def host_layout(params: list[torch.nn.Parameter], chunk_bytes: int, device: torch.device) -> HostLayout:
    """Chunks of ``params`` in their order and their host memory, faulted in (page-locked for a
    CUDA ``device``); the parameters themselves are not touched."""
    align = CUDA_ALIGN if device.type == "cuda" else ALIGN
    entries = [(0, aligned(p.numel() * p.element_size(), align), p.dtype) for p in params]
    specs = plan_chunks(entries, chunk_bytes).chunks
    chunk_nbytes = [spec.numel for spec in specs]
    places = [(0, 0)] * len(params)
    for spec in specs:
        for slot in spec.slots:
            places[slot.param] = (spec.index, slot.offset)
    graded = sorted({c for p, (c, _) in zip(params, places) if p.requires_grad})
    sizes = [*chunk_nbytes, *(chunk_nbytes[c] for c in graded)]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + aligned(n))  # page-aligned regions
    pool = SharedBuffer()
    nbytes = max(starts[-1], ALIGN)
    pool.reserve(nbytes, pin=device.type == "cuda", pieces=pin_pieces(starts[1:], nbytes))
    pool.wait_writable(starts[-1])
    memory = torch.frombuffer(pool.buffer, dtype=torch.uint8)
    regions = [memory[start : start + n] for start, n in zip(starts, sizes)]
    return HostLayout(
        params, specs, chunk_nbytes, places, regions[: len(specs)], dict(zip(graded, regions[len(specs) :])), pool
    )
