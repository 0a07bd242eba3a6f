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

The host heap is trimmed only when it helps, too (:class:`SaveRelease`, ``release_memory="auto"``).
A save that stages into the reused pool (async) leaves nothing behind; releasing after it was pure
cost: ``gc.collect()`` walks every Python object (0.15-0.3 s in a process that imported Lightning)
and ``malloc_trim(0)`` hands back pages the next steps fault in again. A save that builds a large
dict of host copies and frees it leaves that much free heap resident, which glibc returns by
itself only from the top of the heap. So the policy measures what the save left behind, the
growth of resident anonymous memory across the save call capped by the heap's free bytes
(:func:`heap_left`), and trims only when that reaches a threshold, or when the host is short of
memory (:func:`host_under_pressure`). The trim runs on a background thread: ctypes releases the
GIL around the call, and glibc takes each arena's lock while trimming it (an allocation in that
arena waits; ``fork`` takes every arena lock first, so a child never inherits a half-trimmed
arena). A full ``gc.collect()`` runs only in ``"always"`` mode, or before the CUDA cache is
emptied (so blocks held by garbage cycles go back with it); Python's own collector frees cycles
on its schedule.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

EmptyCudaCache = Literal["on_pressure", "always", "never"]
EMPTY_CUDA_CACHE_MODES: tuple[EmptyCudaCache, ...] = ("on_pressure", "always", "never")
ReleaseMode = Literal["auto", "always", "never"]
RELEASE_MODES: tuple[ReleaseMode, ...] = ("auto", "always", "never")

MB = 10**6
# "auto" trims the heap when a save left at least this much of it behind (see the module docstring).
DEFAULT_RELEASE_THRESHOLD_MB = 256.0
# Under memory pressure the heap is trimmed when it holds this much free (below it: page noise).
PRESSURE_MIN_BYTES = 16 * MB
# The host is under memory pressure when less than this share of its memory (or of the cgroup's
# limit) is available.
PRESSURE_AVAILABLE_SHARE = 0.10


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


def _cuda_cache_due(mode: EmptyCudaCache, now: MemoryStats, since: MemoryStats | None) -> bool:
    """Should the CUDA cache be emptied now, per ``empty_cuda_cache=mode``?"""
    if not now.cuda_reserved:
        return False
    return mode == "always" or (mode == "on_pressure" and under_pressure(now, since))


# ---------------------------------------------------------------------------------- host heap

_libc: Any = None


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _libc_function(name: str) -> Any:
    """A function of the C library already loaded into this process; ``None`` where it has none."""
    global _libc
    if _libc is None:
        try:  # the loaded libc: ``ctypes.util.find_library`` would spawn ``ldconfig``
            _libc = ctypes.CDLL(None)
        except OSError:
            _libc = False
    return getattr(_libc, name, None) if _libc else None


def _malloc_trim() -> bool:
    """Return freed glibc heap pages to the OS (no-op where glibc is absent).

    A ``ctypes.CDLL`` call releases the GIL: other Python threads run while it trims.
    """
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def heap_free_bytes() -> int | None:
    """Free bytes glibc's allocator holds in its heaps, every arena (``mallinfo2().fordblks``);
    ``None`` without glibc 2.33+. Free chunks trimmed earlier count though they are no longer
    resident: an upper bound on what a trim can give back."""
    mallinfo2 = _libc_function("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def heap_left(before: MemoryStats, after: MemoryStats) -> int:
    """The freed heap a save left resident: the growth of resident anonymous memory across the
    save call, capped by the heap's free bytes (growth that is live data, or memory outside the
    heap such as a page-locked pool, is not the save's garbage). 0 when nothing grew."""
    growth = after.host_anon - before.host_anon
    if growth <= 0:
        return 0
    free = heap_free_bytes()
    return growth if free is None else min(growth, free)


def _kb_fields(path: str) -> dict[str, int]:
    """``Name: N kB`` / ``name N`` lines of a /proc or cgroup file, in bytes (kB) or as given."""
    fields: dict[str, int] = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                parts = line.replace(b":", b" ").split()
                if len(parts) >= 2 and parts[1].isdigit():
                    fields[parts[0].decode()] = int(parts[1]) * (1024 if parts[-1] == b"kB" else 1)
    except OSError:
        pass
    return fields


@functools.cache
def _cgroup_dir() -> str | None:
    """This process's cgroup v2 folder under /sys/fs/cgroup, where there is one."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    folder = "/sys/fs/cgroup" + line[3:].strip().rstrip("/")
                    return folder if os.path.isdir(folder) else None
    except OSError:
        pass
    return None


def host_under_pressure(share: float = PRESSURE_AVAILABLE_SHARE) -> bool:
    """Is less than ``share`` of the host's memory available (``MemAvailable`` / ``MemTotal``), or
    of this process's cgroup v2 limit (the limit less what is charged, page cache counted as
    available as the kernel would reclaim it)? ``False`` where neither can be read."""
    info = _kb_fields("/proc/meminfo")
    total, available = info.get("MemTotal"), info.get("MemAvailable")
    if total and available is not None and available < share * total:
        return True
    folder = _cgroup_dir()
    if folder is None:
        return False
    try:
        with open(os.path.join(folder, "memory.max")) as f:
            limit_text = f.read().strip()
        with open(os.path.join(folder, "memory.current")) as f:
            current = int(f.read().strip())
    except (OSError, ValueError):
        return False
    if not limit_text.isdigit():  # "max": no limit
        return False
    limit = int(limit_text)
    reclaimable = _kb_fields(os.path.join(folder, "memory.stat")).get("file", 0)
    return limit - current + reclaimable < share * limit


class HeapTrim:
    """One ``malloc_trim(0)`` on a background thread (from :meth:`start`), and what it gave back.

    ``released`` is the drop of this process's resident anonymous memory across the trim: the
    training thread allocating meanwhile blurs it (it can read low, never high by more than what
    was freed concurrently).
    """

    def __init__(self) -> None:
        self.trimmed = False  # False where there is no glibc
        self.seconds: float | None = None  # set, with ``released``, before the thread ends
        self.released: int | None = None
        self._thread = threading.Thread(target=self._run, name="lightning_ckpt-malloc-trim", daemon=True)

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def _run(self) -> None:
        before = memory_stats().host_anon
        start = time.perf_counter()
        self.trimmed = _malloc_trim()
        self.seconds = time.perf_counter() - start
        self.released = max(0, before - memory_stats().host_anon)

    def done(self) -> bool:
        """Started and finished."""
        return self._thread.ident is not None and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the trim if it was started (at most ``timeout`` seconds); whether it is done."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return self.done()


# ------------------------------------------------------------------------------ release reports


@dataclass(frozen=True, slots=True)
class ReleaseReport:
    before: MemoryStats
    after: MemoryStats
    seconds: float
    cuda_cache_emptied: bool
    heap_trimmed: bool


def release_memory(empty_cuda_cache: EmptyCudaCache = "on_pressure", since: MemoryStats | None = None) -> ReleaseReport:
    """Release everything now, on this thread: ``gc.collect()``, the CUDA cache
    (``"on_pressure"``: only if the allocator retried or failed an allocation since ``since``,
    see the module docstring), and ``malloc_trim(0)``. ``release_memory="always"``'s release."""
    if empty_cuda_cache not in EMPTY_CUDA_CACHE_MODES:
        raise ValueError(f"`empty_cuda_cache={empty_cuda_cache!r}` must be one of {EMPTY_CUDA_CACHE_MODES}.")
    before = memory_stats()
    start = time.perf_counter()
    gc.collect()
    emptied = _cuda_cache_due(empty_cuda_cache, before, since)
    if emptied:
        torch.cuda.empty_cache()
    trimmed = _malloc_trim()
    seconds = time.perf_counter() - start
    return ReleaseReport(before, memory_stats(), seconds, emptied, trimmed)


@dataclass(frozen=True, slots=True)
class SaveRelease:
    """What the release after one save did.

    ``seconds`` is the time spent on the calling (training) thread: the measurement, any
    synchronous release, and any wait for the previous trim before the save (see
    :class:`MemoryReleaser`). A background trim reports its own time and bytes through ``trim``
    once done.
    """

    mode: ReleaseMode
    after: MemoryStats  # after the calling thread's part of the release
    seconds: float
    heap_left: int  # see :func:`heap_left`
    skipped: bool  # the host heap was not trimmed
    reason: str  # why it was trimmed or skipped
    cuda_cache_emptied: bool = False
    released: int | None = None  # host bytes given back on the calling thread ("always")
    trim: HeapTrim | None = None  # the background trim ("auto") that covers this save, if any


class MemoryReleaser:
    """The release policy of one ``ShardedModelCheckpoint``: decides after each save what to
    release, and runs the heap trims ``"auto"`` decides on a background thread.

    Call order, on the training thread: :meth:`before_save` just before each save call;
    :meth:`after_save` right after it, with the memory stats taken just before and just after the
    call; :meth:`start_pending` once the step's saves are done (``save_last`` adds a second save
    in the same step: trimming between the two would only make the second fault the pages in
    again); :meth:`wait` before reading the last trim's figures (end of fit). Every rank runs its
    own (each process has its own heap).

    Invariants: at most one trim is pending or running, and none runs during a save
    (:meth:`before_save` waits for it, and that wait counts as release time), so a trim never
    contends with a save's allocations and each save's :func:`heap_left` is its own.
    """

    def __init__(
        self,
        mode: ReleaseMode = "auto",
        empty_cuda_cache: EmptyCudaCache = "on_pressure",
        threshold_mb: float = DEFAULT_RELEASE_THRESHOLD_MB,
    ) -> None:
        if mode not in RELEASE_MODES:
            raise ValueError(f"`release_memory={mode!r}` must be one of {RELEASE_MODES}.")
        if empty_cuda_cache not in EMPTY_CUDA_CACHE_MODES:
            raise ValueError(f"`empty_cuda_cache={empty_cuda_cache!r}` must be one of {EMPTY_CUDA_CACHE_MODES}.")
        if isinstance(threshold_mb, bool) or not isinstance(threshold_mb, (int, float)) or not threshold_mb >= 0:
            raise ValueError(
                f"`release_threshold_mb={threshold_mb!r}` must be a number of MB >= 0 (the freed heap a save must"
                f" leave behind before it is trimmed; default {DEFAULT_RELEASE_THRESHOLD_MB:g})."
            )
        self.mode: ReleaseMode = mode
        self.empty_cuda_cache: EmptyCudaCache = empty_cuda_cache
        self.threshold = int(threshold_mb * MB)
        self._trim: HeapTrim | None = None  # the latest trim: pending (not started) or started
        self._waited = 0.0  # seconds :meth:`before_save` waited, reported with that save

    def __eq__(self, other: object) -> bool:
        # By value, so the callback holding it compares equal to its pickled copy, as
        # ``ModelCheckpoint`` does (Lightning's ``test_pickling``).
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # type: ignore[assignment]  # mutable: equal by value, so not hashable

    def before_save(self) -> None:
        """Wait for a trim still running (tens of milliseconds per 100 MB at most: this waits only
        when saves come closer together than that)."""
        start = time.perf_counter()
        if self._trim is not None:
            self._trim.start()  # a pending one too (a save outside a save step)
            self._trim.wait()
        self._waited = time.perf_counter() - start

    def after_save(self, before: MemoryStats, after: MemoryStats, since: MemoryStats | None = None) -> SaveRelease:
        """Measure what the save left behind and release per the mode. ``since``: the stats after
        the previous save's release (for the CUDA cache's ``"on_pressure"``)."""
        start = time.perf_counter() - self._waited
        self._waited = 0.0
        left = heap_left(before, after)
        if self.mode == "never":
            return SaveRelease("never", after, time.perf_counter() - start, left, True, "release_memory='never'")
        if self.mode == "always":
            report = release_memory(self.empty_cuda_cache, since)
            released = max(0, report.before.host_anon - report.after.host_anon)
            return SaveRelease(
                "always", report.after, time.perf_counter() - start, left, False, "release_memory='always'",
                report.cuda_cache_emptied, released,
            )  # fmt: skip
        emptied = _cuda_cache_due(self.empty_cuda_cache, after, since)
        if emptied:
            gc.collect()  # blocks held only by garbage cycles go back with the cache
            torch.cuda.empty_cache()
        skipped, reason = self._decide(left)
        trim = None
        if not skipped:
            if self._trim is None or self._trim.done():
                self._trim = HeapTrim()  # started by :meth:`start_pending`
            else:
                reason += "; trimmed with the step's earlier save"
            trim = self._trim
        now = memory_stats() if emptied else after
        return SaveRelease("auto", now, time.perf_counter() - start, left, skipped, reason, emptied, trim=trim)

    def _decide(self, left: int) -> tuple[bool, str]:
        """(skip the trim?, why) for a save that left ``left`` bytes of freed heap."""
        amount, threshold = f"{left / MB:.0f} MB", f"{self.threshold / MB:g} MB"
        if left > 0 and left >= self.threshold:
            return False, f"the save left {amount} of freed heap, threshold {threshold}"
        # Short of memory: any free heap, whoever left it (an earlier save whose growth a large
        # concurrent free hid, say; trimming chunks that are no longer resident costs little).
        # The free heap first: one call, where the pressure check reads several files.
        free = heap_free_bytes() or 0
        if free >= PRESSURE_MIN_BYTES and host_under_pressure():
            return False, f"host memory is short; the heap holds {free / MB:.0f} MB free, this save left {amount}"
        return True, f"the save left {amount} of freed heap, below the {threshold} threshold"

    def start_pending(self) -> None:
        """Start the trim decided for the saves since the last call, if any (on its own thread)."""
        if self._trim is not None:
            self._trim.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the background trim in flight, if any."""
        if self._trim is not None:
            self._trim.wait(timeout)


def release_mode(value: object) -> ReleaseMode:
    """The mode of ``ShardedModelCheckpoint(release_memory=value)``: ``True`` is ``"auto"`` (release
    what a save leaves behind, where it helps), ``False`` is ``"never"``."""
    if value is True:
        return "auto"
    if value is False:
        return "never"
    if isinstance(value, str) and value in RELEASE_MODES:
        return value  # type: ignore[return-value]
    raise ValueError(
        f"`release_memory={value!r}` must be one of {RELEASE_MODES} or a bool: 'auto' (the default, also True)"
        " trims the host heap off the training thread when a save left at least `release_threshold_mb` of it"
        " behind; 'always' collects garbage and trims after every save, on the training thread; 'never'"
        " (also False) releases nothing."
    )
