"""Where a save goes and what one save is: a ``Destination`` and a ``SaveJob``, both frozen.

A ``Destination`` is resolved once from the path and the remote options: a local directory, a
remote URL committed through a private temporary folder (a spool), or a remote URL committed in
the local tier. It owns the local directory a save is committed in, what follows the commit
(publish), removal and the local copy a load reads.

A ``SaveJob`` is one save without tensor data of its own (the plan's tensors, or the staged
images the writer process maps), its metadata, step and epoch, destination and multi-rank part.
The functional API and the synchronous plugin run it in the caller's process; the async plugin
pickles it to the writer process, which runs it there. ``SaveJob.run`` is the one place that
writes, commits, then publishes.

Imports ``plan``, ``parts``, ``writer`` and ``remote``; never Lightning, ``io`` or the savers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import Any

import torch

from lightning_ckpt import remote
from lightning_ckpt._version import __version__
from lightning_ckpt.format.plan import Plan, Stable, make_plan
from lightning_ckpt.remote.server_copy import ServerCopies
from lightning_ckpt.store import commit as writer
from lightning_ckpt.store import parts
from lightning_ckpt.store.commit import ImageSource, WriteResult, write_checkpoint
from lightning_ckpt.store.reuse import Reused
from lightning_ckpt.store.shards import ShardWriter


@dataclass(frozen=True)
class Destination:
    """Where a save lands. ``path`` is where it counts (a local directory or a URL); ``commit_dir``
    the local directory it is committed in (``path`` itself when local); ``spool`` the temporary
    folder holding ``commit_dir`` (a remote save without a local tier), removed once published or
    failed; ``options`` the remote options (``None``: local)."""

    path: str
    commit_dir: str
    spool: str | None = None
    options: remote.RemoteOptions | None = None

    @classmethod
    def resolve(cls, path: str, options: remote.RemoteOptions) -> Destination:
        """``path`` (already normalised) with ``options``. A URL without a local tier gets a new
        spool folder here: resolve it just before the write, not for a save that may be skipped."""
        if not remote.is_remote(path):
            return cls(path, path)
        if options.local_dir is not None:
            return cls(path, options.local_path(path), None, options)
        commit_dir, spool = remote.spool_target()
        return cls(path, commit_dir, spool, options)

    @property
    def is_remote(self) -> bool:
        return self.options is not None

    @property
    def tiered(self) -> bool:
        """A remote save committed in the local tier (kept there after it is published)."""
        return self.options is not None and self.spool is None

    def publish(self, reuse: dict[str, Reused] | None = None) -> remote.Published:
        """Upload the committed ``commit_dir`` to ``path``; the spool is removed, a local-tier copy
        marked published and its folder pruned (see ``remote.tier.publish_committed``). Files in
        ``reuse`` are copied on the server from the earlier checkpoints (``server_copy``)."""
        assert self.options is not None, "only a remote destination is published"
        copies = ServerCopies.of(reuse, self.options)
        return remote.publish_committed(self.commit_dir, self.path, self.options, self.spool, copies)


def commit_dir_of(path: str, options: remote.RemoteOptions) -> str:
    """The local directory a save of ``path`` is committed in, when that is not a spool (a local
    path, or a URL with a local tier): what every rank of a multi-rank save must agree on."""
    return options.local_path(path) if remote.is_remote(path) else path


def remove(path: str, options: remote.RemoteOptions) -> None:
    """Remove the checkpoint at ``path`` (absolute, or a URL): a local one with
    ``writer.remove_checkpoint``; a remote one and its local-tier copy. Every removal of the
    package (functional API, plugin, writer process) goes through here."""
    if remote.is_remote(path):
        remote.remove_everywhere(path, options)
    else:
        writer.remove_checkpoint(path)


@contextlib.contextmanager
def local_copy(url: str, options: remote.RemoteOptions) -> Iterator[str]:
    """A committed local directory holding ``url``'s checkpoint for the block (the local-tier copy
    when current, else a download; a temporary download is removed after the block)."""
    local, done = remote.local_copy_for_load(url, options)
    try:
        yield local
    finally:
        done()


@functools.lru_cache(maxsize=1)  # constant for the process; the package metadata lookups are not free
def created_by() -> dict[str, str]:
    """The versions recorded in every manifest's ``created_by``."""

    versions = {"lightning_ckpt": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    for package in ("lightning", "pytorch-lightning"):
        try:
            versions[package] = importlib_metadata.version(package)
        except importlib_metadata.PackageNotFoundError:
            pass
    return versions


@dataclass(frozen=True)
class Prepared:
    """A checkpoint dict planned for a save, before it has a destination: the plan (holding the
    tensors), the metadata tree as JSON, step, epoch and this rank's part of a multi-rank save."""

    plan: Plan
    metadata: bytes
    global_step: int | None
    epoch: int | None
    part: parts.Part | None = None

    def job(self, destination: Destination, with_data: bool = True, reuse: dict[str, Reused] | None = None) -> SaveJob:
        """This save to ``destination``; ``with_data=False`` drops the tensors (for the writer
        process, which reads staged images instead); ``reuse``: shard files taken from earlier
        checkpoints (see ``incremental``)."""
        plan = self.plan if with_data else self.plan.without_data()
        return SaveJob(
            plan, self.metadata, self.global_step, self.epoch, destination, self.part, created_by(), reuse or None
        )


def prepare(checkpoint: dict[str, Any], max_shard_size: int, stable: Stable | None = None) -> Prepared:
    """Plan ``checkpoint``; ``stable`` picks the tensors kept in shards of their own (see ``plan``)."""
    plan = make_plan(checkpoint, max_shard_size, stable)
    return prepared(checkpoint, plan, plan.tree)


def prepared(checkpoint: dict[str, Any], plan: Plan, tree: Any, part: parts.Part | None = None) -> Prepared:
    """A ``Prepared`` of ``checkpoint`` planned as ``plan`` with metadata ``tree``."""
    metadata = json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()
    step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
    return Prepared(plan, metadata, step if type(step) is int else None, epoch if type(epoch) is int else None, part)


@dataclass(frozen=True)
class SaveJob:
    """One save, picklable: what crosses to the writer process (then without tensor data)."""

    plan: Plan
    metadata: bytes
    global_step: int | None
    epoch: int | None
    destination: Destination
    part: parts.Part | None
    created_by: dict[str, str]
    reuse: dict[str, Reused] | None = None  # shard filename -> the earlier file it is taken from

    @property
    def publishes(self) -> bool:
        """Whether this process publishes the save once committed: a remote destination, and not
        a part of a multi-rank save other than rank 0's (rank 0 commits the whole)."""
        return self.destination.is_remote and (self.part is None or self.part.rank == 0)

    def run(
        self,
        shard_writer: ShardWriter,
        images: ImageSource | None = None,
        upload: Callable[[Callable[[], remote.Published]], None] | None = None,
    ) -> WriteResult:
        """Write and commit the checkpoint in ``destination.commit_dir``, then publish it (when
        ``publishes``): here, or, for a local-tier destination given ``upload``, by handing the
        publication to it (the caller's background uploader). Shard bytes come from the plan's
        tensors, or from ``images``. The result names ``destination.path``; its ``nbytes`` are the
        published bytes when published here."""
        destination = self.destination
        with remote.spool_removed_on_failure(destination.spool):
            if self.part is None:
                result = write_checkpoint(
                    self.plan, destination.commit_dir, shard_writer, metadata=self.metadata,
                    created_by=self.created_by, global_step=self.global_step, epoch=self.epoch, images=images,
                    reuse=self.reuse,
                )
            else:  # this rank's part; rank 0 then commits the whole
                result = parts.write_part(
                    self.plan, destination.commit_dir, shard_writer, self.part, metadata=self.metadata,
                    created_by=self.created_by, global_step=self.global_step, epoch=self.epoch, images=images,
                    reuse=self.reuse,
                )
        if not self.publishes:
            return result
        if upload is not None and destination.tiered:
            upload(functools.partial(destination.publish, self.reuse))
            return dataclasses.replace(result, path=destination.path)
        published = destination.publish(self.reuse)
        return WriteResult(
            path=destination.path,
            nbytes=published.nbytes,
            seconds=result.seconds + published.seconds,
            files=result.files,
            direct_io=result.direct_io,
            reused_bytes=published.copied_bytes,  # reused: not uploaded (copied on the server)
            stored=result.stored,
        )


def fingerprint(plan: Plan) -> tuple[Any, ...] | None:
    """Identity and version of every tensor a plan writes: equal fingerprints mean equal bytes.

    ``_version`` is bumped by every in-place change (optimizer steps included) and shared with
    ``detach()``-ed views such as state-dict entries. ``None`` for plans with shared-storage spans
    (their blob tensors are fresh views whose version does not follow the originals).
    """
    entries = []
    for shard in plan.shards:
        for blob in shard.blobs:
            if blob.source is None or blob.name.endswith(".__span__"):
                return None
            source = blob.source
            entries.append(
                (shard.filename, blob.name, blob.dtype, blob.shape, source.device, source.data_ptr(), source._version)
            )
    return tuple(entries)


def local_path(path: Any) -> str:
    """``path`` as a local path (``file://`` dropped); a clear error for a remote URL."""
    path = os.fspath(path)
    if remote.is_remote(path):
        raise ValueError(
            f"`path={path!r}` is a remote URL, which this function does not take. Checkpoints on object"
            " storage are saved, loaded and removed through ShardedCheckpointIO or the functions that take"
            " `storage_options`."
        )
    return path.removeprefix("file://")
