"""Memory stats and explicit, measured release after a save (gc, CUDA cache, glibc heap).

Nothing here imports Lightning. Never touches the async staging pool (it is not garbage: it is
reused by the next save).

The CUDA cache is emptied only when it helps. Free bytes the caching allocator keeps reserved are
not waste: in a training loop they are the next step's activations, and giving them back costs
that step a ``cudaMalloc`` (and a device synchronisation) per block. ``torch.cuda.empty_cache()``
cannot fix fragmentation either: free bytes stranded inside partly used segments
(``inactive_split_bytes``) stay where they are. What it can do is return wholly free segments
before the allocator runs out of room for a request, instead of the allocator doing it in the
middle of a step (``num_alloc_retries``: free everything cached, synchronise, retry) or failing
(``num_ooms``). So ``"on_pressure"`` empties the cache only when retries or OOMs were counted
since the previous save; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` is the allocator's own
remedy for fragmentation (see ``docs/callback.md``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

EmptyCudaCache = Literal["on_pressure", "always", "never"]
EMPTY_CUDA_CACHE_MODES: tuple[EmptyCudaCache, ...] = ("on_pressure", "always", "never")


@dataclass(frozen=True, slots=True)
class MemoryStats:
    host_rss: int  # bytes resident (VmRSS)
    host_anon: int  # anonymous resident bytes (RssAnon): what an OOM is made of
    cuda_allocated: int = 0
    cuda_reserved: int = 0
    cuda_inactive_split: int = 0  # free bytes inside partly used segments: not releasable
    cuda_alloc_retries: int = 0  # cumulative: allocations that had to free the cache and retry
    cuda_ooms: int = 0  # cumulative

    @property
    def cuda_fragmentation(self) -> float:
        """Share of reserved CUDA memory that is free but stranded in partly used segments."""
        return 0.0 if not self.cuda_reserved else self.cuda_inactive_split / self.cuda_reserved

    @property
    def cuda_releasable(self) -> int:
        """Reserved bytes in wholly free segments: what ``empty_cache`` would give back."""
        return max(0, self.cuda_reserved - self.cuda_allocated - self.cuda_inactive_split)


def memory_stats() -> MemoryStats:
    rss = anon = 0
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1]) * 1024
    except OSError:  # not Linux: host figures unavailable
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        return MemoryStats(
            rss,
            anon,
            stats.get("allocated_bytes.all.current", 0),
            stats.get("reserved_bytes.all.current", 0),
            stats.get("inactive_split_bytes.all.current", 0),
            stats.get("num_alloc_retries", 0),
            stats.get("num_ooms", 0),
        )
    return MemoryStats(rss, anon)


def under_pressure(now: MemoryStats, since: MemoryStats | None) -> bool:
    """Did the CUDA caching allocator retry an allocation, or fail one, since ``since``?"""
    retries, ooms = (since.cuda_alloc_retries, since.cuda_ooms) if since is not None else (0, 0)
    return now.cuda_alloc_retries > retries or now.cuda_ooms > ooms


@dataclass(frozen=True, slots=True)
class ReleaseReport:
    before: MemoryStats
    after: MemoryStats
    seconds: float
    cuda_cache_emptied: bool
    heap_trimmed: bool


_libc: Any = None


def _malloc_trim() -> bool:
    """Return freed glibc heap pages to the OS (no-op where glibc is absent)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is None:
        return False
    trim(0)
    return True


def release_memory(empty_cuda_cache: EmptyCudaCache = "on_pressure", since: MemoryStats | None = None) -> ReleaseReport:
    """Release what a save freed: ``gc.collect()``, the CUDA cache (``"on_pressure"``: only if the
    allocator retried or failed an allocation since ``since``, see the module docstring), and
    ``malloc_trim(0)``."""
    if empty_cuda_cache not in EMPTY_CUDA_CACHE_MODES:
        raise ValueError(f"`empty_cuda_cache={empty_cuda_cache!r}` must be one of {EMPTY_CUDA_CACHE_MODES}.")
    before = memory_stats()
    start = time.perf_counter()
    gc.collect()
    emptied = False
    if before.cuda_reserved and (
        empty_cuda_cache == "always" or (empty_cuda_cache == "on_pressure" and under_pressure(before, since))
    ):
        torch.cuda.empty_cache()
        emptied = True
    trimmed = _malloc_trim()
    seconds = time.perf_counter() - start
    return ReleaseReport(before, memory_stats(), seconds, emptied, trimmed)
