"""Which checkpoint a resume loads (``ckpt_path="last"``): the newest committed and intact one
in a folder, and the older ones a load falls back on when it finds damage the cheap check cannot.

Nothing here imports Lightning or communicates: every rank reads the same folder and the checks
are functions of its bytes, so every rank picks the same checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lightning_ckpt import remote
from lightning_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format import reader
from lightning_ckpt.format.kind import is_dcp_checkpoint


@dataclass(frozen=True)
class LastGood:
    """The checkpoint to resume from, the damaged newer ones skipped, and what to fall back on."""

    path: str
    skipped: list[tuple[str, CheckpointError]]
    fallbacks: list[str]  # older committed checkpoints of the folder, newest first


def listing(dirpath: Any, depth: int, options: remote.RemoteOptions | None = None) -> list[str]:
    """Paths under ``dirpath`` down to ``depth`` folders below it (checkpoint directories are
    entries, not descended into). A URL is listed through fsspec with ``options``."""
    if dirpath is not None and remote.is_remote(dirpath):
        urls = remote.listing(os.fspath(dirpath), depth, options or remote.RemoteOptions())
        return [os.path.normpath(url) for url in urls]
    if dirpath is None or not os.path.isdir(dirpath):
        return []
    found: list[str] = []
    folders = [os.path.normpath(os.fspath(dirpath))]
    for level in range(depth + 1):
        below = []
        for folder in folders:
            try:
                entries = list(os.scandir(folder))
            except OSError:  # removed or unreadable meanwhile: nothing of it is a known checkpoint
                continue
            for entry in entries:
                found.append(os.path.normpath(entry.path))
                if level < depth and entry.is_dir() and not os.path.exists(os.path.join(entry.path, fmt.MANIFEST_FILE)):
                    below.append(entry.path)
        folders = below
    return sorted(found)


def newest_first(last: set[str], committed: list[str]) -> list[str]:
    """Checkpoint paths, newest commit first (the manifest's time; a path without one, its own),
    each checkpoint once (a ``last.ckpt`` link and its target are one, named as linked); on equal
    times a ``last`` checkpoint first."""

    def committed_at(path: str) -> int:
        for probe in (os.path.join(path, fmt.MANIFEST_FILE), path):
            try:
                return os.stat(probe).st_mtime_ns
            except OSError:
                continue
        return 0

    seen: set[str] = set()
    unique = []
    for path in sorted(last) + committed:
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            unique.append(path)
    return sorted(unique, key=lambda p: (committed_at(p), p in last), reverse=True)


def last_good(last: set[str], depth: int) -> LastGood | None:
    """Among the ``last`` checkpoints Lightning found in a local folder and every committed
    checkpoint of that folder (``depth`` folders deep), newest commit first, the first that passes
    the cheap check (manifest, every file present with its size, the metadata's digest: stats and
    two small reads). ``None`` when every one is damaged (the load of the newest then raises,
    naming its damage).

    A file, or Lightning's own DCP directory, ends the search as it is: nothing to check, as
    Lightning would. Hashing every byte here would read the whole checkpoint a second time on
    every rank; the load hashes what it reads anyway, and falls back on ``fallbacks`` when a
    byte changed in place. A newer format (``UnsupportedFormatError``) is not skipped: the load
    says to upgrade.
    """

    ours = [p for p in listing(os.path.dirname(min(last)), depth) if reader.is_committed(p)]
    candidates = newest_first(last, ours)
    skipped: list[tuple[str, CheckpointError]] = []
    for index, path in enumerate(candidates):
        if os.path.isfile(path) or is_dcp_checkpoint(path):
            break
        try:
            reader.check(path)
        except (CorruptCheckpointError, CheckpointNotFoundError) as err:
            skipped.append((path, err))
            continue
        break
    else:
        return None
    return LastGood(path, skipped, [p for p in candidates[index + 1 :] if p in ours])
