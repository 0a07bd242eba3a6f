"""Small OS helpers shared by the writer and the reader."""

from __future__ import annotations

import os


def drop_page_cache(fd: int) -> None:
    """Ask the kernel to drop ``fd``'s pages from the page cache (no-op where unsupported).

    Called once a file is durable (writer) or fully read (verification), so checkpoint bytes do
    not evict the training data from the cache.
    """
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
