"""Typed errors. Every message names the checkpoint path (and file or key) and says how to fix it."""

from __future__ import annotations

import os
from typing import Union

_PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(Exception):
    """Base class of every error raised by lightning_ckpt.

    ``path`` is the checkpoint (directory or file) the error is about.
    """

    def __init__(self, message: str, path: _PathLike | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist, or a directory there is not a committed checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated, has the wrong size or fails its checksum.

    ``file`` is the damaged file inside the checkpoint (``None`` when the damage is not tied to one).
    """

    def __init__(self, message: str, path: _PathLike | None = None, file: str | None = None) -> None:
        super().__init__(message, path)
        self.file = file


class UnsupportedFormatError(CheckpointError):
    """The path is in no format this release of lightning_ckpt reads: a newer format version, or a
    file that is not a checkpoint at all (neither ``torch.save``'s nor ours)."""


class UnsafeCheckpointError(CheckpointError):
    """Loading a value would run arbitrary code (pickle) and ``weights_only`` loading refused it.

    ``key`` is the location of the refused value inside the checkpoint dict.
    """

    def __init__(self, message: str, path: _PathLike | None = None, key: str | None = None) -> None:
        super().__init__(message, path)
        self.key = key


class CheckpointWriteError(CheckpointError):
    """A save failed. The target path was left as it was before the save (old checkpoint intact)."""


class MissingDependencyError(CheckpointError, ImportError):
    """A checkpoint URL needs an optional package that is not installed (the message names the extra)."""


def skipped_damaged_message(skipped: list[tuple[str, CheckpointError]], used: str) -> str:
    """The warning of a ``ckpt_path="last"`` resume that skipped damaged checkpoints: each one with
    its damaged file and the reason, then the checkpoint resumed from instead."""
    parts = []
    for path, err in skipped:
        file = getattr(err, "file", None)
        reason = str(err).removeprefix(f"{path!r}: ").split(". ")[0].rstrip(".")
        where = os.path.join(path, file) if file else path
        parts.append(f"{where!r}: {reason}")
    return (
        f'ckpt_path="last": skipped {len(skipped)} damaged checkpoint{"s" if len(skipped) > 1 else ""}'
        f" ({'; '.join(parts)}); resuming from {used!r}, the newest checkpoint found intact."
    )
