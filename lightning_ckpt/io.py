"""The CheckpointIO plugin: Lightning's contract -> plan -> write; reads through ``reader``.

Call order and ranks (Lightning 2.x): ``save_checkpoint`` and ``remove_checkpoint`` run on global
rank 0 only, so nothing here may run a collective; ``load_checkpoint`` runs on every rank;
``teardown`` runs on every rank at the end of ``fit``/``validate``/``test``/``predict``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from importlib import metadata as importlib_metadata
from typing import Any, Literal, Optional, TypeVar

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from typing_extensions import override

from lightning_ckpt import manifest as fmt
from lightning_ckpt import reader
from lightning_ckpt.errors import CheckpointError, CheckpointNotFoundError
from lightning_ckpt.plan import make_plan, parse_size
from lightning_ckpt.writer import TMP_MARKER, ShardWriter, WriteResult, clean_stale, write_checkpoint

DEFAULT_MAX_SHARD_SIZE = "2GB"
_VERIFY_MODES = ("structure", "full")
_T = TypeVar("_T")


def _created_by() -> dict[str, str]:
    from lightning_ckpt import __version__

    versions = {"lightning_ckpt": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    for package in ("lightning", "pytorch-lightning"):
        try:
            versions[package] = importlib_metadata.version(package)
        except importlib_metadata.PackageNotFoundError:
            pass
    return versions


def _check_local(path: Any, argument: str) -> str:
    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        raise ValueError(
            f"`{argument}={path!r}` is a remote URL; ShardedCheckpointIO writes to local or mounted"
            " filesystems only. Use a local path (or Lightning's TorchCheckpointIO for remote storage)."
        )
    return path.removeprefix("file://")


def save_checkpoint(
    checkpoint: dict[str, Any],
    path: str | os.PathLike[str],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    *,
    _writer: ShardWriter | None = None,
) -> WriteResult:
    """Save ``checkpoint`` as a sharded, checksummed checkpoint directory at ``path`` (atomically)."""
    limit = parse_size(max_shard_size)
    path = _check_local(path, "path")
    plan = make_plan(checkpoint, limit)
    metadata = json.dumps(plan.tree, separators=(",", ":"), allow_nan=False).encode()
    step, epoch = checkpoint.get("global_step"), checkpoint.get("epoch")
    writer = _writer or ShardWriter()
    try:
        return write_checkpoint(
            plan,
            path,
            writer,
            metadata=metadata,
            created_by=_created_by(),
            global_step=step if type(step) is int else None,
            epoch=epoch if type(epoch) is int else None,
        )
    finally:
        if _writer is None:
            writer.close()


def load_checkpoint(
    path: str | os.PathLike[str],
    map_location: reader.MapLocation = None,
    weights_only: bool | None = None,
    verify: bool = False,
) -> dict[str, Any]:
    """Load a checkpoint directory (or a legacy single-file ``.ckpt``) into the dict Lightning saved.

    Args:
        path: a checkpoint directory written by lightning_ckpt, or a file written by ``torch.save``.
        map_location: where tensors go: ``None`` (CPU), a device, a ``{saved: new}`` dict, or a
            ``torch.load``-style callable. CPU tensors are copy-on-write memory maps of the shards.
        weights_only: ``None``/``True`` refuse values that would need arbitrary unpickling (with a
            clear error naming the key); ``False`` allows them for trusted checkpoints.
        verify: also check every file's crc32 (the size/presence check always runs).
    """
    path = _check_local(path, "path")
    if os.path.isdir(path):
        return reader.load(path, map_location, weights_only, verify_checksums=verify)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"Checkpoint {path!r} does not exist.", path)
    return reader.load_legacy(path, map_location, weights_only)


def verify_checkpoint(path: str | os.PathLike[str]) -> fmt.Manifest:
    """Fully verify a checkpoint directory (manifest, sizes, every crc32); raise naming the damaged file."""
    return reader.verify(_check_local(path, "path"))


class ShardedCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves split, sharded, atomic, checksummed checkpoint directories.

    Example::

        trainer = Trainer(plugins=[ShardedCheckpointIO(max_shard_size="2GB")])

    Args:
        max_shard_size: cap on each shard file's tensor bytes (int bytes or ``"2GB"``, ``"500MiB"``).
            A single tensor larger than the cap gets a shard of its own.
        verify_on_load: ``"structure"`` (files present, sizes right; cheap) or ``"full"`` (also
            every crc32) for each ``load_checkpoint``.
        direct_io: write shard data with ``O_DIRECT`` (bypasses and so preserves the page cache).
            ``None`` probes the filesystem and falls back to buffered writes where it is refused.
        buffer_size: size of each of the four reused host buffers that bytes stream through; the
            extra host memory of a save is about four times this, whatever the checkpoint size.
    """

    def __init__(
        self,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        verify_on_load: Literal["structure", "full"] = "structure",
        direct_io: Optional[bool] = None,
        buffer_size: int | str = "16MiB",
    ) -> None:
        super().__init__()
        self.max_shard_size = parse_size(max_shard_size, "max_shard_size")
        if verify_on_load not in _VERIFY_MODES:
            raise ValueError(f"`verify_on_load={verify_on_load!r}` must be one of {_VERIFY_MODES}.")
        if direct_io not in (None, True, False):
            raise ValueError(f"`direct_io={direct_io!r}` must be None (auto), True or False.")
        self.verify_on_load = verify_on_load
        self._writer = ShardWriter(parse_size(buffer_size, "buffer_size"), direct_io)
        self._lock = threading.Lock()
        self.last_save: WriteResult | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to the directory ``path``; returns once it is durable and committed."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by ShardedCheckpointIO;"
                f" got storage_options={storage_options!r}. Remove the argument."
            )
        with self._lock:
            self.last_save = save_checkpoint(checkpoint, path, self.max_shard_size, _writer=self._writer)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load a directory checkpoint (or a legacy ``.ckpt`` file); see :func:`load_checkpoint`."""
        return load_checkpoint(path, map_location, weights_only, verify=self.verify_on_load == "full")

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint directory or legacy file. Refuses directories that are not checkpoints."""
        remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        self._writer.close()

    def __getstate__(self) -> dict[str, Any]:
        # Spawn-based strategies pickle the plugin: ship the configuration, not locks or buffers.
        state = self.__dict__.copy()
        state["_lock"] = None
        state["_writer"] = ShardWriter(self._writer.chunk_bytes, self._writer.direct_io)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Remove a checkpoint. A directory is first renamed to a hidden temporary name, so a crash
    mid-removal never leaves a half-deleted checkpoint under its real name."""
    path = os.path.abspath(_check_local(path, "path"))
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        os.remove(path)
        return
    if not os.path.exists(os.path.join(path, fmt.MANIFEST_FILE)) and os.listdir(path):
        raise CheckpointError(
            f"Refusing to remove {path!r}: it is a non-empty directory without {fmt.MANIFEST_FILE}, so not a"
            " lightning_ckpt checkpoint. Remove it by hand if it should go.",
            path,
        )
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f".{name}{TMP_MARKER}{os.getpid()}-removing")
    os.rename(path, doomed)
    clean_stale(parent)  # removes `doomed` (it has no live lock) and any other leftovers


_load_patch_lock = threading.Lock()


def load_from_checkpoint(
    cls: type[_T],
    checkpoint_path: str | os.PathLike[str],
    map_location: reader.MapLocation = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> _T:
    """``cls.load_from_checkpoint`` that also reads checkpoint directories.

    Lightning's own ``LightningModule.load_from_checkpoint`` bypasses CheckpointIO and fails on a
    directory. This runs Lightning's implementation unchanged (hyper-parameters, migration,
    ``strict``, ``**kwargs`` overrides) with the file read by :func:`load_checkpoint`::

        model = load_from_checkpoint(MyModel, "checkpoints/last.ckpt")
    """
    from lightning.pytorch.core import saving

    def _load(path: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        return load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    with _load_patch_lock:
        original = saving.pl_load
        saving.pl_load = _load
        try:
            return cls.load_from_checkpoint(  # type: ignore[attr-defined,no-any-return]
                checkpoint_path,
                map_location=map_location,
                hparams_file=hparams_file,
                strict=strict,
                weights_only=weights_only,
                **kwargs,
            )
        finally:
            saving.pl_load = original
