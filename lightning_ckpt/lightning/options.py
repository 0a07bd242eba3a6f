"""``ShardedCheckpointIO``'s options as small frozen objects, each validated once at construction
with errors that name the argument as the user typed it.

The plugin keeps its flat constructor (LightningCLI and jsonargparse read its evaluated
annotations) and builds these from it: ``SaveOptions`` (how every save is written and every load
checked), ``AsyncOptions`` (async saves: built only with ``async_save=True``) and
``remote.RemoteOptions`` (object storage, through :func:`remote_options`). ``AsyncOptions`` is
the save pipeline's (``save.background``), re-exported here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Optional

from lightning_ckpt import remote
from lightning_ckpt.format.plan import parse_size
from lightning_ckpt.save.background import AsyncOptions
from lightning_ckpt.store.parts import DEFAULT_PART_TIMEOUT

VERIFY_MODES = ("full", "structure")


def one_of(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    # ``in`` would take 1 for True and 0 for False.
    if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
        raise ValueError(f"`{name}={value!r}` must be one of {allowed}.")


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOptions:
    """How every save is written and every load checked (see ``ShardedCheckpointIO``'s arguments
    of the same names; sizes in bytes)."""

    max_shard_size: int
    verify_on_load: Literal["full", "structure"] = "full"
    direct_io: Optional[bool] = None
    buffer_bytes: int = 16 * 2**20
    on_error: Literal["raise", "warn"] = "raise"
    part_timeout: float = DEFAULT_PART_TIMEOUT
    spread_writes: Optional[bool] = None
    incremental: bool | Literal["link", "copy"] = True
    read_once: Optional[bool] = None

    def __post_init__(self) -> None:
        one_of("verify_on_load", self.verify_on_load, VERIFY_MODES)
        one_of("direct_io", self.direct_io, (None, True, False))
        one_of("on_error", self.on_error, ("raise", "warn"))
        one_of("spread_writes", self.spread_writes, (None, True, False))
        one_of("incremental", self.incremental, (True, False, "link", "copy"))
        one_of("read_once", self.read_once, (None, True, False))
        if isinstance(self.part_timeout, bool) or not isinstance(self.part_timeout, (int, float)) or not self.part_timeout > 0:
            raise ValueError(f"`part_timeout={self.part_timeout!r}` must be a positive number of seconds.")


def refuse_async_only(async_save: bool, given: dict[str, tuple[Any, Any]]) -> None:
    """Refuse options that only async saves read, set while ``async_save`` is off: silently
    ignored, they would promise what no save does (``when_busy="skip"`` skipping nothing).
    ``given`` maps each option's name to (its value, its default)."""
    if async_save:
        return
    changed = [f"{name}={value!r}" for name, (value, default) in given.items() if value != default]
    if changed:
        raise ValueError(
            f"`{', '.join(changed)}` applies to async saves only, and `async_save` is False. Pass"
            f" `ShardedCheckpointIO(async_save=True, ...)`, or drop {'it' if len(changed) == 1 else 'them'}."
        )


def remote_options(
    *,
    storage_options: Optional[dict[str, Any]],
    local_dir: Optional[str | os.PathLike[str]],
    local_keep: int,
    upload_part_size: int | str,
    upload_concurrency: int,
    compression: Optional[str | dict[str, str]],
    compression_level: int,
) -> remote.RemoteOptions:
    """The object storage options of ``ShardedCheckpointIO``'s arguments of the same names, checked
    (a missing ``zstandard`` for ``compression`` is reported now, not at the first upload)."""
    if isinstance(local_keep, bool) or not isinstance(local_keep, int) or local_keep < 1:
        raise ValueError(f"`local_keep={local_keep!r}` must be an int >= 1.")
    if isinstance(upload_concurrency, bool) or not isinstance(upload_concurrency, int) or upload_concurrency < 1:
        raise ValueError(f"`upload_concurrency={upload_concurrency!r}` must be an int >= 1.")
    part_size = parse_size(upload_part_size, "upload_part_size")
    if part_size < 5 * 2**20:
        raise ValueError(f"`upload_part_size={upload_part_size!r}` is below 5 MiB, the smallest part S3 accepts.")
    if local_dir is not None and remote.is_remote(local_dir):
        raise ValueError(f"`local_dir={local_dir!r}` must be a local folder (it is the fast tier in front of the remote).")
    codecs = {"*": compression} if isinstance(compression, str) else dict(compression or {})
    for component, encoding in codecs.items():
        if encoding not in remote.ENCODINGS:
            raise ValueError(f"`compression={compression!r}`: {encoding!r} for {component!r} is not one of {sorted(remote.ENCODINGS)}.")
    if codecs:
        remote.zstd_module()
    if isinstance(compression_level, bool) or not isinstance(compression_level, int) or not 1 <= compression_level <= 22:
        raise ValueError(f"`compression_level={compression_level!r}` must be an int from 1 to 22.")
    return remote.RemoteOptions(
        storage_options=dict(storage_options or {}),
        part_size=part_size,
        concurrency=upload_concurrency,
        local_dir=None if local_dir is None else os.path.abspath(os.fspath(local_dir)),
        local_keep=local_keep,
        compression=codecs,
        compression_level=compression_level,
    )


__all__ = ["AsyncOptions", "SaveOptions", "VERIFY_MODES", "one_of", "refuse_async_only", "remote_options"]
