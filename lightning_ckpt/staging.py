"""When a safe copy exists: the host staging pool of async saves.

The pool is one shared-memory file (``memfd``; an unlinked file in ``/dev/shm`` where memfd is
missing), allocated on the first save and reused by every later one; it grows only when the state
grows and is never shrunk. No name of it exists in the filesystem, so a crash of both processes
leaks nothing. The writer process maps it through a file descriptor passed over a socket.

Staging lays out each shard as its exact *file image* (safetensors header + tensor bytes) at a
4096-aligned offset, so the writer process writes it with ``O_DIRECT`` straight from the pool,
without another copy. On CUDA the pool is page-locked (``cudaHostRegister``) and the copies run
``non_blocking`` on a side stream; the current stream then waits for them, so in-place updates
issued after ``save_checkpoint`` returns (forward-pass buffers, ``optimizer.step``) cannot race the
copy, while the host returns at once. Nothing here imports Lightning.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_ckpt import manifest as fmt
from lightning_ckpt.plan import Plan, Shard

ALIGN = 4096


def aligned(n: int) -> int:
    """``n`` rounded up to ALIGN: the pool bytes a file image of ``n`` bytes occupies."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """Where each shard's file image lies in the pool: filename -> (offset, file size)."""

    nbytes: int  # pool bytes needed (images padded to ALIGN, so O_DIRECT can write the tails)
    images: dict[str, tuple[int, int]]


def layout(plan: Plan) -> tuple[ImageLayout, dict[str, tuple[bytes, dict[str, fmt.HeaderEntry]]]]:
    """Pure: the pool layout of ``plan`` and each shard's header (bytes, entries)."""
    offset = 0
    images: dict[str, tuple[int, int]] = {}
    headers = {}
    for shard in plan.shards:
        header, entries = fmt.build_header([(b.name, b.dtype, b.shape, b.nbytes) for b in shard.blobs])
        size = len(header) + shard.nbytes
        images[shard.filename] = (offset, size)
        headers[shard.filename] = (header, entries)
        offset += aligned(size)
    return ImageLayout(offset, images), headers


def _new_shared_fd(nbytes: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("lightning_ckpt-staging", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, name = tempfile.mkstemp(prefix="lightning_ckpt-staging-", dir=folder)
        os.unlink(name)
    os.ftruncate(fd, nbytes)
    return fd


class StagingPool:
    """A reusable shared-memory buffer holding the file images of one checkpoint.

    Not thread-safe; the caller (``ShardedCheckpointIO``) guarantees that the writer process has
    finished reading the pool before it is staged again (one save in flight).

    Args:
        max_bytes: refuse to grow beyond this (``None``: no cap). See ``ShardedCheckpointIO``.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.fd: int | None = None
        self.nbytes = 0
        self.generation = 0  # bumped whenever a new buffer replaces the old one
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None
        self._pinned = False
        self._stream: torch.cuda.Stream | None = None
        self._copies_queued = False

    def reserve(self, nbytes: int) -> None:
        """Make the pool at least ``nbytes`` large (a new buffer only when it must grow)."""
        if nbytes <= self.nbytes and self._map is not None:
            return
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise ValueError(
                f"this checkpoint needs {nbytes} bytes of staging memory, above `staging_pool_size`"
                f" ({self.max_bytes}). Raise `staging_pool_size` or save with `async_save=False`."
            )
        self.close()
        self.fd = _new_shared_fd(nbytes)
        self._map = mmap.mmap(self.fd, nbytes)
        self._view = torch.frombuffer(self._map, dtype=torch.uint8)
        self.nbytes = nbytes
        self.generation += 1

    @property
    def buffer(self) -> mmap.mmap:
        assert self._map is not None, "reserve() first"
        return self._map

    def stage(
        self, plan: Plan, image_layout: ImageLayout, headers: dict[str, tuple[bytes, dict[str, fmt.HeaderEntry]]]
    ) -> Callable[[], None] | None:
        """Copy every blob of ``plan`` into the pool as laid out by ``layout(plan)`` (grows to fit).

        Returns ``None`` when the bytes are already in the pool (host tensors), else a callable
        that blocks until the device copies have landed.
        """
        self.reserve(max(image_layout.nbytes, ALIGN))
        for shard in plan.shards:
            self.stage_shard(shard, headers[shard.filename], image_layout.images[shard.filename][0])
        return self.copies_done()

    def stage_shard(self, shard: Shard, header: tuple[bytes, dict[str, fmt.HeaderEntry]], offset: int) -> None:
        """Copy one shard's file image to ``offset`` (device copies are queued, see ``copies_done``)."""
        view = self._view
        assert view is not None
        header_bytes, entries = header
        view[offset : offset + len(header_bytes)].copy_(torch.frombuffer(bytearray(header_bytes), dtype=torch.uint8))
        data = offset + len(header_bytes)
        for blob in shard.blobs:
            if blob.nbytes == 0:
                continue
            assert blob.source is not None
            entry = entries[blob.name]
            target = view[data + entry.begin : data + entry.end].view(blob.source.dtype).view(blob.source.shape)
            if blob.source.device.type == "cuda":
                self._pin()
                assert self._stream is not None
                if not self._copies_queued:
                    self._stream.wait_stream(torch.cuda.current_stream())
                    self._copies_queued = True
                with torch.cuda.stream(self._stream):
                    target.copy_(blob.source.detach(), non_blocking=True)
                    blob.source.record_stream(self._stream)
            else:
                target.copy_(blob.source.detach())

    def copies_done(self) -> Callable[[], None] | None:
        """``None`` if no device copy is queued, else a callable blocking until they have landed.

        Later work on the training stream (in-place updates) is made to wait for the copies; the
        host is not.
        """
        if not self._copies_queued:
            return None
        self._copies_queued = False
        done = torch.cuda.Event()
        done.record(self._stream)
        torch.cuda.current_stream().wait_event(done)
        return done.synchronize

    def _pin(self) -> None:
        if self._pinned:
            return
        assert self._map is not None
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        result = torch.cuda.cudart().cudaHostRegister(address, self.nbytes, 0)
        self._pinned = int(result) == 0  # unpinned memory still works, only slower
        if self._stream is None:
            self._stream = torch.cuda.Stream()

    def close(self) -> None:
        """Release the buffer (the writer process drops its own mapping when told of a new one)."""
        if self._map is not None:
            if self._pinned:
                address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
                torch.cuda.cudart().cudaHostUnregister(address)
                self._pinned = False
            self._view = None
            try:
                self._map.close()
            except BufferError:  # a tensor view is still alive somewhere; freed with it
                pass
            self._map = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.nbytes = 0


class Ring:
    """FIFO allocator over a pool smaller than the state: shards are written in the order they are
    staged, so regions are freed oldest first (``free_oldest``) and new ones wrap around."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._live: deque[tuple[int, int]] = deque()

    def alloc(self, size: int) -> int | None:
        """Start of a free region of ``size`` bytes, or ``None`` until older regions are freed."""
        if size > self.capacity:
            raise ValueError(f"a {size}-byte shard image cannot fit a {self.capacity}-byte pool")
        if not self._live:
            start = 0
        else:
            oldest, newest_end = self._live[0][0], self._live[-1][1]
            wrapped = self._live[-1][0] < oldest
            if not wrapped and newest_end + size <= self.capacity:
                start = newest_end
            elif not wrapped and size <= oldest:
                start = 0
            elif wrapped and newest_end + size <= oldest:
                start = newest_end
            else:
                return None
        self._live.append((start, start + size))
        return start

    def free_oldest(self) -> None:
        self._live.popleft()
