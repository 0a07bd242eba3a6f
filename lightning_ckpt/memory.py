"""Memory stats and explicit, measured release after a save (gc, CUDA cache, glibc heap).

Nothing here imports Lightning. Never touches the async staging pool (it is not garbage: it is
reused by the next save).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class MemoryStats:
    host_rss: int  # bytes resident (VmRSS)
    host_anon: int  # anonymous resident bytes (RssAnon): what an OOM is made of
    cuda_allocated: int = 0
    cuda_reserved: int = 0

    @property
    def cuda_fragmentation(self) -> float:
        """Reserved but unallocated share of the CUDA caching allocator's memory."""
        return 0.0 if not self.cuda_reserved else 1.0 - self.cuda_allocated / self.cuda_reserved


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
        return MemoryStats(rss, anon, torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    return MemoryStats(rss, anon)


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


def release_memory(cuda_fragmentation_threshold: float = 0.25) -> ReleaseReport:
    """Release what a save freed: ``gc.collect()``; the CUDA cache when more than
    ``cuda_fragmentation_threshold`` of reserved memory is unallocated; ``malloc_trim(0)``."""
    before = memory_stats()
    start = time.perf_counter()
    gc.collect()
    emptied = False
    if before.cuda_reserved and before.cuda_fragmentation > cuda_fragmentation_threshold:
        torch.cuda.empty_cache()
        emptied = True
    trimmed = _malloc_trim()
    seconds = time.perf_counter() - start
    return ReleaseReport(before, memory_stats(), seconds, emptied, trimmed)
