"""The functional API: save, load, verify and remove a checkpoint without a Trainer.

``save_checkpoint``, ``load_checkpoint``, ``verify_checkpoint`` and ``remove_checkpoint``
(exported from ``lightning_ckpt``; ``load_from_checkpoint``, which needs Lightning, is
``lightning.loading``'s). A save runs a ``save.job.SaveJob`` in the calling process; loads read
through ``format.reader`` (``format.legacy`` for Lightning's own sharded directories).
"""

import os
from typing import Any

from lightning_ckpt import remote
from lightning_ckpt.errors import CheckpointError, CheckpointNotFoundError
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format import reader
from lightning_ckpt.format.kind import is_dcp_checkpoint
from lightning_ckpt.format.plan import parse_size
from lightning_ckpt.save import job as savejob
from lightning_ckpt.store.commit import WriteResult
from lightning_ckpt.store.shards import ShardWriter

DEFAULT_MAX_SHARD_SIZE = "2GB"


def location(path: Any) -> str:
    """A remote URL as it is; a local path made absolute (``file://`` dropped)."""
    path = os.fspath(path)
    return path if remote.is_remote(path) else os.path.abspath(path.removeprefix("file://"))


def save_checkpoint(
    checkpoint: dict[str, Any],
    path: str | os.PathLike[str],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    *,
    storage_options: dict[str, Any] | None = None,
    _writer: ShardWriter | None = None,
) -> WriteResult:
    """Save ``checkpoint`` as a sharded, checksummed checkpoint directory at ``path`` (atomically).

    ``path`` may be an fsspec URL (``s3://bucket/run/x.ckpt``; ``storage_options`` go to its
    filesystem): the checkpoint is committed in a temporary local folder, then published (see
    ``remote.commit``)."""
    prepared = savejob.prepare(checkpoint, parse_size(max_shard_size))
    target = os.fspath(path) if remote.is_remote(path) else savejob.local_path(path)
    destination = savejob.Destination.resolve(target, remote.RemoteOptions(storage_options or {}))
    shard_writer = _writer or ShardWriter()
    try:
        return prepared.job(destination).run(shard_writer)
    finally:
        if _writer is None:
            shard_writer.close()


def load_checkpoint(
    path: str | os.PathLike[str],
    map_location: reader.MapLocation = None,
    weights_only: bool | None = None,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint directory (or a legacy single-file ``.ckpt``) into the dict Lightning saved.

    Args:
        path: a checkpoint directory written by lightning_ckpt, or a file written by ``torch.save``,
            or the fsspec URL of a checkpoint published by lightning_ckpt (downloaded shard by
            shard into a temporary folder, every object verified on the way).
        map_location: where tensors go: ``None`` (CPU), a device, a ``{saved: new}`` dict, or a
            ``torch.load``-style callable. CPU tensors are copy-on-write memory maps of the shards.
        weights_only: ``None``/``True`` refuse values that would need arbitrary unpickling (with a
            clear error naming the key); ``False`` allows them for trusted checkpoints.
        verify: ``True`` (default) hashes every file before any tensor is returned and raises
            ``CorruptCheckpointError`` naming a damaged one; the pass that hashes a shard also
            brings it into the page cache for the copy that follows, so it costs the hashing only
            (see docs/benchmarks.md). ``False`` opts out: presence, sizes and the metadata's digest
            are still checked. Legacy single-file checkpoints carry no checksums.
        storage_options: for a URL, passed to its fsspec filesystem (credentials, endpoint).
    """
    if remote.is_remote(path):
        options = remote.RemoteOptions(storage_options or {})
        return load_remote(os.fspath(path), options, map_location, weights_only, verify)
    path = savejob.local_path(path)
    if os.path.isdir(path):
        if is_dcp_checkpoint(path):  # written by Lightning's own sharded strategies
            # Imported for these folders alone: DCP and DTensor cost ~0.6 s of start-up (format/kind.py).
            from lightning_ckpt.format.legacy import load_dcp_checkpoint

            return load_dcp_checkpoint(path, map_location, weights_only)
        return reader.load(path, map_location, weights_only, verify_checksums=bool(verify))
    if not os.path.exists(path):
        raise CheckpointNotFoundError(reader.not_found_message(path), path)
    return reader.load_legacy(path, map_location, weights_only)


def stored_bytes(path: str) -> int | None:
    """The bytes of the local checkpoint at ``path`` as stored: a directory's files (ours from its
    manifest), a single file's size; ``None`` when it cannot be read."""
    try:
        if os.path.isfile(os.path.join(path, fmt.MANIFEST_FILE)):
            return reader.read_manifest(path).total_bytes
        if os.path.isdir(path):
            return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
        return os.path.getsize(path)
    except (OSError, CheckpointError):
        return None


def load_remote(
    url: str, options: remote.RemoteOptions, map_location: reader.MapLocation, weights_only: bool | None, verify: bool
) -> dict[str, Any]:
    """Load the remote checkpoint ``url`` from its local copy (see ``savejob.local_copy``)."""
    with savejob.local_copy(url, options) as local:
        return reader.load(local, map_location, weights_only, verify_checksums=bool(verify))


def verify_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> fmt.Manifest:
    """Fully verify a checkpoint directory (manifest, sizes, every digest); raise naming the damaged file.

    Reads with ``O_DIRECT`` where possible: checking a checkpoint leaves the page cache as it was.
    A URL's objects are streamed and hashed, nothing stored locally."""
    if remote.is_remote(path):
        return remote.verify(os.fspath(path), remote.RemoteOptions(storage_options or {}))
    return reader.verify(savejob.local_path(path))


def remove_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
    """Remove a checkpoint directory (or legacy file, or remote checkpoint). Refuses directories that
    are not checkpoints; an interrupted removal never leaves a half-deleted checkpoint under its real name."""
    target = os.fspath(path) if remote.is_remote(path) else os.path.abspath(savejob.local_path(path))
    savejob.remove(target, remote.RemoteOptions(storage_options or {}))
