"""How the bytes of one file land: shard files streamed through reused page-aligned buffers,
their digests computed on the way, ``O_DIRECT`` where the filesystem takes it, fsync and the
page cache released. What makes a directory of such files a checkpoint (the temporary directory,
the manifest, the atomic commit) is ``writer``'s. Nothing here imports Lightning.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import secrets
import threading
import time
from collections.abc import Iterator

import torch

from lightning_ckpt._fs import drop_page_cache
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.plan import Blob

_ALIGN = 4096  # O_DIRECT alignment for buffer address, file offset and length
DEFAULT_CHUNK_BYTES = 16 * 2**20
_RING = 4  # buffers in flight: filling, hashing, writing, and one spare to absorb jitter


class ShardWriter:
    """Streams blobs into safetensors files through a ring of reused page-aligned buffers.

    Host memory used is ``4 * chunk_bytes`` whatever the checkpoint size; the buffers live as long
    as the writer so repeated saves do not fault fresh pages in. Writes use ``O_DIRECT`` when the
    filesystem takes it. Not thread-safe: one save at a time.
    """

    def __init__(
        self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, direct_io: bool | None = None, max_rate: float | None = None
    ) -> None:
        self.chunk_bytes = max(_ALIGN, chunk_bytes // _ALIGN * _ALIGN)
        self.direct_io = direct_io  # None: probe per directory
        self.max_rate = max_rate  # bytes/s cap for write_image (async path); None: as fast as possible
        self._buffers: list[mmap.mmap] = []
        self._direct_ok: dict[str, bool] = {}

    def _buffer_ring(self) -> list[mmap.mmap]:
        if not self._buffers:
            self._buffers = [mmap.mmap(-1, self.chunk_bytes) for _ in range(_RING)]
        return self._buffers

    def close(self) -> None:
        buffers, self._buffers = self._buffers, []
        for raw in buffers:
            try:
                raw.close()
            except BufferError:  # a view still exported; the mapping goes with the last reference
                pass

    def use_direct(self, directory: str) -> bool:
        if self.direct_io is not None:
            return self.direct_io and hasattr(os, "O_DIRECT")
        if directory not in self._direct_ok:
            self._direct_ok[directory] = _probe_direct(directory, self._buffer_ring()[0])
        return self._direct_ok[directory]

    def write_shard(self, path: str, header: bytes, blobs: tuple[Blob, ...], direct: bool) -> fmt.FileRecord:
        """Write header + blob bytes to ``path``, fsync, drop from page cache; return size and digest.

        Three stages run concurrently over the reused buffers: a *filler* thread copies bytes in,
        a *hasher* thread updates the digest (``fmt.CHECKSUM_ALGORITHM``), and the calling thread
        writes (all release the GIL). Buffers go round in order, so the digest is of the file's
        bytes in file order.
        """
        total = len(header) + sum(b.nbytes for b in blobs)
        buffers = self._buffer_ring()
        free: queue.Queue[int] = queue.Queue()
        filled: queue.Queue[tuple[int, int] | BaseException | None] = queue.Queue()
        hashed: queue.Queue[tuple[int, int] | BaseException | None] = queue.Queue()
        for i in range(len(buffers)):
            free.put(i)
        addresses = [ctypes.addressof(ctypes.c_char.from_buffer(raw)) for raw in buffers]
        running = fmt.hasher()
        stop = threading.Event()

        def fill() -> None:
            try:
                index, used = free.get(), 0
                for piece in _byte_pieces(header, blobs, self.chunk_bytes):
                    while piece.numel():
                        if stop.is_set():
                            filled.put(None)  # end the stream, so the hasher (and join) finish
                            return
                        n = min(piece.numel(), self.chunk_bytes - used)
                        # Host bytes: one single-threaded memmove (GIL released). torch's copy_
                        # would wake its OpenMP pool, whose spinning starves the hasher thread.
                        ctypes.memmove(addresses[index] + used, piece.data_ptr(), n)
                        used += n
                        piece = piece[n:]
                        if used == self.chunk_bytes:
                            filled.put((index, used))
                            index, used = free.get(), 0
                if used:
                    filled.put((index, used))
                filled.put(None)
            except BaseException as err:  # surfaced in the writing thread
                filled.put(err)

        def hash_() -> None:
            while True:
                item = filled.get()
                if isinstance(item, tuple):
                    index, used = item
                    running.update(memoryview(buffers[index])[:used])
                hashed.put(item)
                if not isinstance(item, tuple):
                    return

        threads = [
            threading.Thread(target=fill, name="lightning_ckpt-fill", daemon=True),
            threading.Thread(target=hash_, name="lightning_ckpt-hash", daemon=True),
        ]
        fd = _open_for_write(path, direct)
        try:
            for thread in threads:
                thread.start()
            written = 0
            while (item := hashed.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                index, used = item
                raw = buffers[index]
                if direct and used % _ALIGN:
                    # Last chunk: pad to the alignment, write, then cut the file to its true size.
                    padded = -(-used // _ALIGN) * _ALIGN
                    raw[used:padded] = bytes(padded - used)
                    _write_all(fd, memoryview(raw)[:padded])
                else:
                    _write_all(fd, memoryview(raw)[:used])
                written += used
                free.put(index)
            if direct:
                os.ftruncate(fd, written)
            os.fsync(fd)
            drop_page_cache(fd)
        except BaseException:
            stop.set()
            for i in range(len(buffers)):
                free.put(i)  # unblock the filler if it waits for a buffer
            raise
        finally:
            os.close(fd)
            for thread in threads:
                if thread.is_alive() or thread.ident is not None:
                    thread.join()
        if written != total:
            raise OSError(errno.EIO, f"wrote {written} of {total} bytes", path)
        return fmt.FileRecord(size=total, digest=running.hexdigest())

    def write_image(self, path: str, buffer: mmap.mmap, offset: int, size: int, direct: bool) -> fmt.FileRecord:
        """Write ``buffer[offset:offset+size]`` (a staged file image) to ``path`` without copying it.

        ``offset`` is 4096-aligned and the buffer extends to the next multiple of 4096 after the
        image, so ``O_DIRECT`` writes go straight from the buffer. The digest is computed by a
        ``_BackgroundDigest`` at idle CPU priority while this thread writes (the writer process's
        path: training wins the CPU; the disk, not the hash, sets the pace).
        """
        image = memoryview(buffer)[offset : offset + size]
        # Rate-capped: hash chunk by chunk inside the paced loop, so the hashing is spread out too.
        digest = None if self.max_rate else _BackgroundDigest(image)
        running = fmt.hasher()
        try:
            fd = _open_for_write(path, direct)
            try:
                data = memoryview(buffer)[offset : offset + -(-size // _ALIGN) * _ALIGN] if direct else image
                began = time.perf_counter()
                for start in range(0, len(data), self.chunk_bytes):
                    _write_all(fd, data[start : start + self.chunk_bytes])
                    if self.max_rate:
                        running.update(image[start : start + self.chunk_bytes])
                        ahead = (start + self.chunk_bytes) / self.max_rate - (time.perf_counter() - began)
                        if ahead > 0:
                            time.sleep(ahead)
                if direct:
                    os.ftruncate(fd, size)
                if digest is not None:
                    digest.hurry()  # a lagging hash catches up while fsync waits for the disk
                os.fsync(fd)
                drop_page_cache(fd)
            finally:
                os.close(fd)
            hexdigest = running.hexdigest() if digest is None else digest.finish()
        finally:
            if digest is not None:
                digest.cancel()
        return fmt.FileRecord(size=size, digest=hexdigest)


class _BackgroundDigest:
    """The digest of a file image, computed by a thread at idle CPU priority while the caller writes.

    The writer process runs beside training on the same cores. Hashing is its only real CPU work
    (the ``O_DIRECT`` writes are DMA), and the disk is slower than the hash, so the hash has the
    whole write to finish in: ``SCHED_IDLE`` lets it use only CPU time nothing else wants. If it
    lags (every core busy), ``hurry`` (once the bytes are written, before the fsync) hands the
    rest to a thread at the writer's own priority, which hashes while the fsync waits for the
    disk; ``finish`` does it in the caller if nobody did. Durability never waits on a starved
    thread for more than one piece.

    The image is hashed in order, one ``_PIECE`` at a time under a lock (xxhash releases the GIL),
    so whichever thread holds the lock continues where the other stopped.
    """

    _PIECE = 2**20  # the longest a hand-over waits for the idle thread's current update

    def __init__(self, image: memoryview) -> None:
        self._image = image
        self._running = fmt.hasher()
        self._done = 0  # bytes hashed so far
        self._idle_stop = False  # the idle thread stops at its next piece
        self._cancelled = False
        self._lock = threading.Lock()
        self._helper: threading.Thread | None = None
        self._thread = threading.Thread(target=self._run_idle, name="lightning_ckpt-hash", daemon=True)
        self._thread.start()

    def _run_idle(self) -> None:
        _lower_thread_priority()
        size = len(self._image)
        while True:
            with self._lock:
                if self._idle_stop or self._cancelled or self._done >= size:
                    return
                end = min(self._done + self._PIECE, size)
                self._running.update(self._image[self._done : end])
                self._done = end

    def _take_over(self) -> None:
        self._idle_stop = True
        with self._lock:
            size = len(self._image)
            while self._done < size and not self._cancelled:
                end = min(self._done + 64 * self._PIECE, size)
                self._running.update(self._image[self._done : end])
                self._done = end

    def hurry(self) -> None:
        """Hash what the idle thread has not reached in a thread at the caller's priority."""
        if self._helper is None and self._done < len(self._image):
            self._helper = threading.Thread(target=self._take_over, name="lightning_ckpt-hash-rest", daemon=True)
            self._helper.start()

    def finish(self) -> str:
        """The image's hex digest, once every byte is hashed."""
        if self._helper is not None:
            self._helper.join()
        self._take_over()  # whatever is left (nothing after a helper), here
        self._thread.join()
        return self._running.hexdigest()

    def cancel(self) -> None:
        """Stop the threads (a failed write); no-op after ``finish``."""
        self._cancelled = True
        for thread in (self._thread, self._helper):
            if thread is not None:
                thread.join()


def _lower_thread_priority() -> None:
    """Put the calling thread in ``SCHED_IDLE`` (Linux: per thread); elsewhere leave it as it is."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def _byte_pieces(header: bytes, blobs: tuple[Blob, ...], chunk: int) -> Iterator[torch.Tensor]:
    """The file's bytes as flat uint8 tensors, on their own device (copied to host by the filler)."""
    yield torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for blob in blobs:
        if blob.nbytes == 0:
            continue
        assert blob.source is not None, "a plan without data is written from staged images"
        source = blob.source.detach()
        if not source.is_contiguous():
            source = source.contiguous()  # at most one tensor's worth of extra memory
        flat = source.reshape(-1).view(torch.uint8)
        if flat.device.type != "cpu":
            # Bring device tensors over one chunk at a time: host memory stays bounded.
            for start in range(0, flat.numel(), chunk):
                yield flat[start : start + chunk].to("cpu")
        else:
            yield flat


def write_small(path: str, data: bytes) -> fmt.FileRecord:
    """Write a small file, fsync it and drop it from the page cache."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, memoryview(data))
        os.fsync(fd)
        drop_page_cache(fd)
    finally:
        os.close(fd)
    return fmt.FileRecord(size=len(data), digest=fmt.digest(data))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _open_for_write(path: str, direct: bool) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)


def _probe_direct(directory: str, aligned: mmap.mmap) -> bool:
    """Does this filesystem accept O_DIRECT writes from an aligned buffer? (tmpfs does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, f".lckpt-direct-probe-{secrets.token_hex(4)}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, memoryview(aligned)[:_ALIGN])
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
