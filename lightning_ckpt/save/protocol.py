"""The writer process's protocol: every message between the training process
(``worker.WriterProcess``) and the writer process (``worker.main``), as frozen dataclasses.

Messages are pickled into length-prefixed frames on a Unix socket pair; the staging pool's file
descriptor travels alongside (``SCM_RIGHTS``) with the first request after the pool is replaced.

Parent -> child: ``WriterConfig`` once, then ``SaveRequest`` and ``RemoveRequest`` in the order
they must run, ``Images`` (more shard images for a save in flight, when the pool is smaller than
the state) and ``Stop``. Child -> parent: ``ShardWritten`` (a chunked save's progress, so the
parent can stage the next shard in the freed space) and one ``Reply`` per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from lightning_ckpt.remote import RemoteOptions
from lightning_ckpt.save.job import SaveJob
from lightning_ckpt.store.commit import WriteResult

# filename -> (offset in the staging pool, file size) of each staged shard image
ImageOffsets = dict[str, tuple[int, int]]


@dataclass(frozen=True, slots=True, kw_only=True)
class WriterConfig:
    """How the writer process writes: the shard writer's buffers, ``O_DIRECT``, rate cap, and the
    object storage options of remote saves."""

    chunk_bytes: int
    direct_io: bool
    max_write_rate: int | None
    remote: RemoteOptions


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveRequest:
    """Write and commit ``job`` (no tensor data: its shard images are in the staging pool)."""

    id: int
    path: str
    job: SaveJob
    images: ImageOffsets
    chunked: bool = False  # the pool holds part of the state: report each shard written
    # Its shard files hold the very bytes of save ``same_as``'s files of the same names (a second
    # save of the same staged tensors, e.g. ``last.ckpt`` after a top-k file in one step): taken
    # from that checkpoint if it committed (``reuse``: linked, or copied), else written from the
    # images, staged for both.
    same_as: int | None = None
    copy_same: bool = False  # those files copied, not linked (``incremental="copy"``)


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoveRequest:
    """Remove the checkpoint at ``path`` once save ``after`` committed (kept if it failed)."""

    id: int
    path: str
    after: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Images:
    """More staged shard images of save ``id``."""

    id: int
    images: ImageOffsets


@dataclass(frozen=True, slots=True)
class Stop:
    """Finish and exit (every earlier request has replied)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardWritten:
    """Save ``id`` wrote ``filename``: its image's pool space is free again."""

    id: int
    filename: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Written:
    """What a save request committed: the write's result, how long the write took, and the wall
    clock time at which the checkpoint was durable."""

    result: WriteResult
    write_seconds: float
    durable_at: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """The end of request ``id``: ``ok`` (a save's ``written``), ``kept`` (a removal skipped because
    the save replacing it failed) or ``error`` (``explained``: the message says what was kept)."""

    id: int
    path: str
    status: Literal["ok", "kept", "error"]
    written: Written | None = None
    error: str = ""
    explained: bool = False


Request = Union[WriterConfig, SaveRequest, RemoveRequest, Images, Stop]
Response = Union[ShardWritten, Reply]

__all__ = [
    "ImageOffsets",
    "Images",
    "RemoveRequest",
    "Reply",
    "Request",
    "Response",
    "SaveRequest",
    "ShardWritten",
    "Stop",
    "Written",
    "WriterConfig",
]
