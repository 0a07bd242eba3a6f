"""Files under test: the run folder, removal, fsync, page-cache dropping."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator

from lightning_ckpt import _fs

DEFAULT_DIR = os.path.join("bench-results", "tmp")


def files(path: str) -> list[str]:
    """Every file of ``path`` (a file or a folder, walked)."""
    if os.path.isdir(path):
        return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    return [path] if os.path.exists(path) else []


def path_bytes(path: str) -> int:
    return sum(os.path.getsize(name) for name in files(path))


def drop_page_cache(path: str) -> None:
    """``POSIX_FADV_DONTNEED`` on every file of ``path`` (clean pages only; all of ours are fsynced)."""
    for name in files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            _fs.drop_page_cache(fd)
        finally:
            os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


@contextlib.contextmanager
def run_directory(directory: str) -> Iterator[str]:
    """A fresh ``run-*`` folder under ``directory``; removed afterwards with every folder this made."""
    created = []  # folders this run made, innermost first; removed again if left empty
    directory = os.path.abspath(directory)  # a relative one would climb to "" and never exist
    folder = directory
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(directory, exist_ok=True)
    run_dir = os.path.join(directory, f"run-{os.getpid()}-{secrets.token_hex(3)}")
    os.makedirs(run_dir)
    try:
        yield run_dir
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        for folder in created:
            try:
                os.rmdir(folder)
            except OSError:
                break
