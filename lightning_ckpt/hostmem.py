"""Host memory that devices copy from: shared-memory buffers faulted in, and page-locked for CUDA,
by a background thread (:class:`Preparer`), and what a buffer's owner must give back
(:class:`Owned`); :class:`SharedBuffer`, such a buffer; and :class:`DeferredSource`, host memory
that copies itself into a staging buffer. Used by the staging pool of async saves (``save``) and
by the host chunks of the memory engines (``offload``), which import nothing of each other.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

PIN_CHUNK = 256 * 2**20  # bytes page-locked per cudaHostRegister call (a multiple of the page size)
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch pins
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in, writable, without touching them
_POPULATE_THREADS = min(4, max(2, (os.cpu_count() or 2) // 2))
_FAULT_THREADS = "lightning_ckpt-fault"  # the page-faulting threads' name prefix


def new_shared_fd(nbytes: int) -> int:
    """A new shared-memory file of ``nbytes`` (zeros), with no name in the filesystem."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("lightning_ckpt-staging", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, name = tempfile.mkstemp(prefix="lightning_ckpt-staging-", dir=folder)
        os.unlink(name)
    os.ftruncate(fd, nbytes)
    return fd


_libc: ctypes.CDLL | None = None


def _populate(view: torch.Tensor, address: int, nbytes: int) -> None:
    """Fault ``nbytes`` of the pool in (kernel-side, no byte is written where the kernel can), so
    neither ``cudaHostRegister`` nor the first copy pays for page faults. Releases the GIL."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_POPULATE_WRITE) != 0:
        view.zero_()  # an older kernel: writing every page faults it in as well


def pin_pieces(ends: Sequence[int], nbytes: int, page: int = mmap.PAGESIZE) -> list[int]:
    """Registration pieces (their end offsets) for a pool whose owner copies whole ranges ending at
    ``ends`` (ascending): each piece ends at one of them, so no copy spans two registrations, and
    holds up to ``PIN_CHUNK`` bytes (a longer range is one piece of its own). Only ends on a
    ``page`` boundary end pieces (two registrations may not share a page: on 64 KiB-page hosts a
    4096-aligned end may be inside one); the others' ranges share a piece with the next."""
    ends = [end for end in ends if end < nbytes and end % page == 0] + [nbytes]
    pieces: list[int] = []
    start = 0
    for end, following in zip(ends, [*ends[1:], None]):
        if following is None or following - start > PIN_CHUNK:
            pieces.append(end)
            start = end
    return pieces


class Preparer:
    """Faults a pool's pages in and, for device copies, page-locks them: a background thread, in
    ``PIN_CHUNK`` steps from offset 0, registering each piece (``pieces``: their end offsets;
    default every ``PIN_CHUNK``) once faulted in. ``[0, ready)`` is done; ``wait_for`` blocks
    until a range is.

    Invariant: a piece is registered with CUDA at most once and unregistered only by ``close``.
    """

    def __init__(
        self, view: torch.Tensor, address: int, nbytes: int, pin: bool, pieces: Sequence[int] | None = None
    ) -> None:
        self.ready = 0
        self.pin = pin
        self._pieces = list(range(PIN_CHUNK, nbytes, PIN_CHUNK)) + [nbytes] if pieces is None else list(pieces)
        self.registered = 0  # bytes page-locked so far
        # The caller's device (Lightning has set the rank's): a new thread's is device 0, and
        # registering from there would open a context on GPU 0 for every rank of the node.
        self._device = torch.cuda.current_device() if pin else None
        self.failed = False  # a registration failed: the rest runs unpinned (slower, still correct)
        self._chunks: list[int] = []  # addresses registered
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, args=(view, address, nbytes), name="lightning_ckpt-pin", daemon=True
        )
        self._thread.start()

    def _run(self, view: torch.Tensor, address: int, nbytes: int) -> None:
        # Faulting pages in is the slow part and scales with threads (1.7 -> 3.2 GB/s with 2 on a
        # 2-vCPU VM); registration follows in order, so ``ready`` is always a prefix.
        starts = deque(range(0, nbytes, PIN_CHUNK))
        populating: deque[Future[None]] = deque()
        pieces = deque(self._pieces)
        offset = piece_start = 0
        if self._device is not None:
            torch.cuda.set_device(self._device)
        executor = ThreadPoolExecutor(_POPULATE_THREADS, thread_name_prefix=_FAULT_THREADS)
        try:
            while offset < nbytes and not self._stop:
                while starts and len(populating) < 2 * _POPULATE_THREADS:
                    start = starts.popleft()
                    size = min(PIN_CHUNK, nbytes - start)
                    populating.append(executor.submit(_populate, view[start : start + size], address + start, size))
                populating.popleft().result()
                offset += min(PIN_CHUNK, nbytes - offset)  # faulted in up to here
                while pieces and pieces[0] <= offset:  # every piece faulted in whole: page-lock it
                    end = pieces.popleft()
                    if self.pin and not self.failed and end > piece_start:
                        n = end - piece_start
                        if int(torch.cuda.cudart().cudaHostRegister(address + piece_start, n, _HOST_REGISTER_PORTABLE)) == 0:
                            self._chunks.append(address + piece_start)
                            self.registered += n
                        else:
                            self.failed = True
                    piece_start = end
                ready = offset if not self.pin or self.failed else piece_start
                with self._cond:
                    self.ready = ready
                    self._cond.notify_all()
        finally:
            executor.shutdown(wait=True, cancel_futures=True)  # no thread writes after this
            with self._cond:
                self.ready = nbytes  # done, stopped or failed: nobody waits any longer
                self._cond.notify_all()

    def wait_for(self, end: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.ready >= end)

    def on_its_threads(self) -> bool:
        """Is the caller this preparer's thread, or a page-faulting one (whose pool may be this)?"""
        current = threading.current_thread()
        return current is self._thread or current.name.startswith(_FAULT_THREADS)

    def close(self) -> None:
        """Stop, join, unregister. Not from ``on_its_threads`` (it would wait for itself)."""
        self._stop = True
        self._thread.join()
        if self._chunks:
            assert self._device is not None
            with torch.cuda.device(self._device):  # not device 0's context from another thread
                for address in self._chunks:
                    torch.cuda.cudart().cudaHostUnregister(address)
        self._chunks.clear()


class Owned:
    """What a pool must give back: its background thread with the page-locked ranges, its
    ``torch.frombuffer`` view, its descriptor (which keeps the shared memory alive after every
    mapping is gone) and its mapping. ``StagingPool.close`` releases it, and so does a finalizer if
    a pool is collected unclosed.

    Invariant: the last reference to a ``frombuffer`` storage is never dropped on a thread that may
    outlive the interpreter's exit (a daemon thread): torch's deleter for it lets go of the GIL and
    takes it back, and a daemon thread taking the GIL during the exit is ended by a forced unwind
    that aborts the process inside the deleter ("terminate called without an active exception").
    So the pool's thread is joined before the view goes (it holds a view of its own), and only the
    plain mapping (its unmap is C code) may be dropped in the background."""

    __slots__ = ("fd", "preparer", "view", "mapping")

    def __init__(self) -> None:
        self.fd: int | None = None
        self.preparer: Preparer | None = None
        self.view: torch.Tensor | None = None
        self.mapping: mmap.mmap | None = None

    def release(self, unmap_in_background: bool = False) -> None:
        """Give everything back; ``unmap_in_background``: the unmap (0.4 s at 3 GB, where this is
        the mapping's last reference) on a thread of its own."""
        preparer = self.preparer
        if preparer is not None and preparer.on_its_threads():
            # A garbage collection on the pool's own threads ran the finalizer: joining them here
            # would wait for ourselves. Released from a thread of its own instead.
            threading.Thread(target=self.release, name="lightning_ckpt-release", daemon=True).start()
            return
        if preparer is not None:
            preparer.close()
            self.preparer = None
        self.view = None  # not the storage's last reference: ``mapping`` still holds the memory
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        held: list[mmap.mmap | None] = [self.mapping]  # the only reference here: cleared where it is dropped
        self.mapping = None
        if held[0] is not None and unmap_in_background:
            threading.Thread(target=held.clear, name="lightning_ckpt-free-pool", daemon=True).start()
        else:
            held.clear()


ALIGN = 4096


def aligned(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to ``align`` (default ALIGN: the pool bytes a file image of ``n`` bytes occupies)."""
    return -(-n // align) * align


class SharedBuffer:
    """A reusable shared-memory buffer (``memfd``), faulted in, and page-locked on CUDA, by a
    background thread (``Preparer``); grown when asked for more, never shrunk. The checkpoint
    staging pool (``save.staging.StagingPool``) and ``ChunkedAdamW``'s / ``ChunkedOffloadStrategy``'s
    host chunks are such buffers.

    Args:
        max_bytes: refuse to grow beyond this (``None``: no cap).
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.generation = 0  # bumped whenever a new buffer replaces the old one
        self._owned = Owned()
        # Not at exit: a save in flight may still use the buffer then, and the process frees it all.
        weakref.finalize(self, self._owned.release).atexit = False

    def reserve(self, nbytes: int, pin: bool = False, pieces: Sequence[int] | None = None) -> None:
        """Make the pool at least ``nbytes`` large (a new buffer only when it must grow) and start
        faulting it in, and page-locking it if ``pin`` (and CUDA is there), in the background;
        ``pieces``: the end offsets of its registrations (see :func:`lightning_ckpt.hostmem.pin_pieces`),
        for an owner whose copies must not span two (default: every ``PIN_CHUNK``, which ``stage``
        splits at)."""
        pin = pin and torch.cuda.is_available()
        if nbytes > self.nbytes or self._owned.mapping is None:
            if self.max_bytes is not None and nbytes > self.max_bytes:
                raise ValueError(
                    f"this checkpoint needs {nbytes} bytes of staging memory, above `staging_pool_size`"
                    f" ({self.max_bytes}). Raise `staging_pool_size` or save with `async_save=False`."
                )
            self.close()
            self._owned.fd = new_shared_fd(nbytes)
            self._owned.mapping = mmap.mmap(self._owned.fd, nbytes)
            self._owned.view = torch.frombuffer(self._owned.mapping, dtype=torch.uint8)
            self.nbytes = nbytes
            self.generation += 1
        if self.preparer is None or (pin and not self.preparer.pin):
            if self.preparer is not None:  # faulted in for host copies before: page-lock it now
                self.preparer.close()
            assert self.view is not None and self._owned.mapping is not None
            address = ctypes.addressof(ctypes.c_char.from_buffer(self._owned.mapping))
            self._owned.preparer = Preparer(self.view, address, self.nbytes, pin, pieces)

    @property
    def fd(self) -> int | None:
        """The shared memory's descriptor (the writer process maps the pool through it)."""
        return self._owned.fd

    @property
    def preparer(self) -> Preparer | None:
        """The background thread faulting the buffer in (and page-locking it); ``None`` before ``reserve``."""
        return self._owned.preparer

    @property
    def view(self) -> torch.Tensor | None:
        """The whole buffer as bytes (``None`` before ``reserve``)."""
        return self._owned.view

    @property
    def buffer(self) -> mmap.mmap:
        assert self._owned.mapping is not None, "reserve() first"
        return self._owned.mapping

    @property
    def pins(self) -> bool:
        """Is the pool page-locked, or being page-locked in the background?"""
        return self.preparer is not None and self.preparer.pin

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked so far (0 without CUDA or before the first device save)."""
        p = self.preparer
        return 0 if p is None else p.registered

    def wait_writable(self, end: int) -> None:
        """Wait until ``[0, end)`` is faulted in: the background thread must be past a chunk before
        anything is written to it (its fallback zero-fills)."""
        assert self.preparer is not None
        self.preparer.wait_for(min(end, self.nbytes))

    def close(self, unmap_in_background: bool = False) -> None:
        """Release the buffer (the writer process drops its own mapping when told of a new one);
        ``unmap_in_background``: unmapping it (0.4 s at 3 GB) on a thread of its own. The map is
        dropped, never ``close()``d: tensors made with ``torch.frombuffer`` hold a reference to it
        but no buffer export, so closing it would unmap memory they still view (a state dict kept
        after its optimizer is gone). The last reference unmaps it."""
        self._owned.release(unmap_in_background)
        self.nbytes = 0


class DeferredSource(Protocol):
    """Host memory that copies itself into the pool (see the module docstring).

    ``claim`` runs on the staging caller's thread; ``flush`` on whichever thread waits for the
    save's copies (the hand-off thread, or the caller blocking); the owner's own writer thread
    copies a claimed region just before it changes it. Invariant: a claimed region's bytes reach
    ``destination`` as they were at ``claim``, before the owner writes that region again.
    """

    def claim(self, source: torch.Tensor, destination: torch.Tensor) -> bool:
        """Copy ``source`` (contiguous host tensor) into ``destination`` later; ``False``: not
        this source's memory, copy it now."""
        ...

    def settled(self) -> bool:
        """Every claimed copy has been made."""
        ...

    def flush(self) -> None:
        """Make every claimed copy not made yet, now, in the calling thread."""
        ...


_deferred_sources: weakref.WeakSet[DeferredSource] = weakref.WeakSet()  # type: ignore[type-var]


def register_deferred_source(source: DeferredSource) -> None:
    """Let async saves leave ``source``'s memory to ``source`` (held weakly)."""
    _deferred_sources.add(source)


def claim_deferred(blob_source: torch.Tensor, destination: torch.Tensor) -> DeferredSource | None:
    """The registered source that takes the copy of ``blob_source`` into ``destination`` upon
    itself, or ``None``: copy it now."""
    if not blob_source.is_contiguous():
        return None
    for source in list(_deferred_sources):
        if source.claim(blob_source, destination):
            return source
    return None
