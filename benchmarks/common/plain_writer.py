"""Plain sequential writes: the floor the research modes hold a checkpoint's writes against (the
``plain_write`` rows of ``--mode save``, the disk rows of ``--mode distributed``), and the
``disk_floor`` contender's helper process (``contenders.PlainWrite``), the cheapest writer of a
checkpoint's bytes. Run by path with ``python -I``; imports only the standard library, so it
starts in milliseconds and takes no memory or CPU beyond the writing itself.

Reads ``<path>\\t<nbytes>`` lines from stdin. For each, writes ``nbytes`` (rounded up to 4 KiB)
sequentially into a new file from one reused ``DIRECT_CHUNK`` buffer, with ``O_DIRECT`` where the filesystem
accepts it, fsyncs the file, and answers ``done\\t<path>\\t<time.perf_counter()>`` (Linux: the
system-wide monotonic clock, comparable across processes) or ``error\\t<path>\\t<message>``.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import time

ALIGN = 4096  # O_DIRECT alignment of buffer address, offset and length
DIRECT_CHUNK = 16 * 2**20  # the O_DIRECT writes' size
BUFFERED_CHUNK = 64 * 2**20  # the buffered writes' size


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def direct_buffer(nbytes: int) -> memoryview:
    """A page-aligned buffer of random bytes for ``O_DIRECT`` writes of ``nbytes``: one
    ``DIRECT_CHUNK`` at most, reused for every write."""
    raw = mmap.mmap(-1, min(DIRECT_CHUNK, aligned(nbytes)))  # anonymous maps are page-aligned
    raw[:] = os.urandom(len(raw))
    return memoryview(raw)


def write_and_fsync(path: str, flags: int, buffer: memoryview, nbytes: int) -> None:
    """Write ``nbytes`` to a new file at ``path`` by repeating ``buffer``, then fsync it."""
    fd = os.open(path, flags, 0o644)
    try:
        left = nbytes
        while left:
            left -= os.write(fd, buffer[: min(left, len(buffer))])
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: str, nbytes: int, buffer: memoryview) -> None:
    """``nbytes`` rounded up to ``ALIGN`` from the page-aligned ``buffer``: ``O_DIRECT`` where the
    filesystem accepts it, else buffered; fsynced either way."""
    total = aligned(nbytes)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        write_and_fsync(path, flags | getattr(os, "O_DIRECT", 0), buffer, total)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        # no O_DIRECT on this filesystem; the refused open may have created the file already
        write_and_fsync(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, buffer, total)


def main() -> None:
    buffer = direct_buffer(DIRECT_CHUNK)
    for line in sys.stdin:
        path, nbytes = line.rstrip("\n").split("\t")
        try:
            write(path, int(nbytes), buffer)
        except OSError as err:
            print(f"error\t{path}\t{type(err).__name__}: {err}", flush=True)
        else:
            print(f"done\t{path}\t{time.perf_counter()!r}", flush=True)


if __name__ == "__main__":
    main()
