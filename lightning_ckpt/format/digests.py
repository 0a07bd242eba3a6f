"""Hashing a checkpoint's files as they are read, and the error when a digest is not the manifest's.

Two ways, one per reader: ``file_digest`` streams a file through two reused buffers (``verify``:
nothing stays in the page cache), ``mapped_digest`` hashes a mapping while the kernel reads
ahead of it (a load: the pages stay for the tensors made from it). Nothing here imports Lightning.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Callable

from lightning_ckpt._fs import drop_page_cache
from lightning_ckpt.errors import CorruptCheckpointError
from lightning_ckpt.format import manifest as fmt

CHUNK = 16 * 2**20  # bytes hashed (and read) at a time
_READ_AHEAD = 4  # chunks the kernel is asked to read ahead of the hash of a mapped file


def check_digest(path: str, name: str, algorithm: str, expected: str, found: str) -> None:
    """Raise ``CorruptCheckpointError`` naming file ``name`` when its digest is not the manifest's."""
    if found == expected:
        return
    raise CorruptCheckpointError(
        f"{path!r}: checksum mismatch in {name!r} ({algorithm}: expected {expected}, found {found}); the file is"
        " corrupt, so the checkpoint is damaged. Resume from another checkpoint (an earlier one of the run),"
        " or, to load these bytes anyway, pass `verify=False` to `load_checkpoint` or use"
        " `ShardedCheckpointIO(verify_on_load=\"structure\")`.",
        path,
        name,
    )


def file_digest(
    fd: int, buffers: list[mmap.mmap], algorithm: str, hashed: Callable[[int], None] | None = None
) -> str:
    """Digest of the file open as ``fd`` (closed here): a thread reads into one aligned buffer
    while this one hashes the other. Opened with ``O_DIRECT`` (where the filesystem allows it),
    verifying a checkpoint neither evicts the training data from the page cache nor pays for
    filling it. ``hashed(n)`` is told each piece's bytes once they are hashed (a progress bar).
    """
    ready: queue.Queue[tuple[int, int] | BaseException | None] = queue.Queue()
    free: queue.Queue[int] = queue.Queue()
    for i in range(len(buffers)):
        free.put(i)
    stop = threading.Event()

    def read() -> None:
        try:
            while not stop.is_set():
                index = free.get()
                n = os.readv(fd, [buffers[index]])
                if n == 0:
                    break
                ready.put((index, n))
            ready.put(None)
        except BaseException as err:
            ready.put(err)

    thread = threading.Thread(target=read, name="lightning_ckpt-verify", daemon=True)
    thread.start()
    running = fmt.hasher(algorithm)
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            index, n = item
            running.update(memoryview(buffers[index])[:n])
            free.put(index)
            if hashed is not None:
                hashed(n)
    finally:
        stop.set()
        free.put(0)
        thread.join()
        drop_page_cache(fd)
        os.close(fd)
    return running.hexdigest()


def mapped_digest(mapped: mmap.mmap, algorithm: str) -> str:
    """Digest of a whole mapped file, asking the kernel to read ahead of the hash.

    The pages read stay mapped and cached, so the tensors made from this mapping afterwards (and
    the copy into the model) read memory, not the disk: verification adds the hashing only.
    """
    running = fmt.hasher(algorithm)
    size = len(mapped)
    advise = getattr(mmap, "MADV_WILLNEED", None)
    view = memoryview(mapped)
    try:
        for start in range(0, size, CHUNK):
            if advise is not None:  # pages already cached or in flight are skipped by the kernel
                end = min(size, start + (_READ_AHEAD + 1) * CHUNK)
                mapped.madvise(advise, start, end - start)  # start is chunk-, so page-aligned
            running.update(view[start : start + CHUNK])
    finally:
        view.release()
    return running.hexdigest()
