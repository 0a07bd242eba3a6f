"""Reading: manifest -> structural check -> memory-mapped tensors -> the checkpoint dict.

* ``read_manifest`` parses and validates the manifest (the commit marker: no manifest, no checkpoint).
* ``check_structure`` is the cheap check run on every load: every listed file present with its size;
  ``check`` runs it alone, with the manifest's and the metadata's digests (``ckpt_path="last"``
  picks the newest intact checkpoint with it).
* ``verify`` recomputes every file's digest (and the manifest's own) without loading anything.
* ``load`` maps each shard privately (copy-on-write), so tensors are views of the page cache until
  written. By default it hashes every mapped shard before handing out a tensor of it (reading
  ahead of the hash with ``MADV_WILLNEED``): the one pass from disk both verifies the bytes and
  leaves them in the page cache for the copy that follows (``load_state_dict``), so verifying
  costs the hashing, not a second read. Legacy single-file ``.ckpt`` files go through
  ``torch.load`` as Lightning's ``TorchCheckpointIO`` would.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import json
import mmap
import os
import pickle
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, Union

import torch

from lightning_ckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from lightning_ckpt.format import digests
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.plan import contiguous_strides, decode_tree, format_key_path

MapLocation = Union[None, str, torch.device, dict[str, str], Callable[..., Any]]
_HASH_THREADS = 4  # shards hashed at once on load (bounded by the CPU count and the shard count)
_T = TypeVar("_T")


_ATTEMPTS = 20  # reads retried when the path was replaced (atomically) while being read: each retry means a newer complete checkpoint is there


class OpenedDir:
    """A checkpoint directory opened once. Every file is opened relative to it, so replacing the
    path meanwhile (the atomic exchange that saves ``last.ckpt``) can never mix two checkpoints:
    the read sees the old one whole, or fails and is retried on the new one (``replaced``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise CheckpointNotFoundError(not_found_message(path), path) from None

    def open(self, name: str, flags: int = os.O_RDONLY) -> int:
        return os.open(name, flags, dir_fd=self.fd)

    def open_direct(self, name: str) -> tuple[int, bool]:
        """``name`` opened for reading with ``O_DIRECT`` where the filesystem takes it (tmpfs does
        not: then buffered, read ahead sequentially); (fd, whether ``O_DIRECT``)."""
        direct = getattr(os, "O_DIRECT", 0)
        if direct:
            try:
                return self.open(name, os.O_RDONLY | direct), True
            except FileNotFoundError:
                raise
            except OSError:
                pass
        fd = self.open(name)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd, False

    def read(self, name: str) -> bytes:
        with os.fdopen(self.open(name), "rb") as f:
            return f.read()

    def replaced(self) -> bool:
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        own = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (own.st_dev, own.st_ino)

    def __enter__(self) -> OpenedDir:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def not_found_message(path: str, resume_hint: bool = True) -> str:
    """Lightning's ``TorchCheckpointIO`` wording first (code may match on it), then our hint:
    the checkpoints beside ``path`` when its folder has any, and with ``resume_hint`` (a load for
    a Trainer) how to let the run pick its newest one."""
    nearby = checkpoints_in(os.path.dirname(os.path.abspath(path)))
    message = (
        f"Checkpoint file not found: {path}. Nothing exists at that path: check it (lightning_ckpt checkpoints are"
        " directories such as 'epoch=0-step=500.ckpt/')"
    )
    if nearby:
        message += f"; its folder holds {_some([os.path.basename(p) for p in nearby])}"
    if resume_hint:
        return message + ", or resume with `ckpt_path=\"last\"` to pick the newest checkpoint of the run."
    return message + "."


def checkpoints_in(folder: str) -> list[str]:
    """The committed lightning_ckpt checkpoints directly in ``folder`` (sorted paths; none if unreadable)."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return []
    return [e.path for e in entries if is_committed(e.path)]


def is_committed(path: str) -> bool:
    """Is ``path`` a committed lightning_ckpt checkpoint by its name and manifest (nothing verified)?
    Hidden entries are saves in progress or crashed ones (temporary and part folders, a checkpoint
    moved aside): never committed, even with a manifest inside."""
    return not os.path.basename(path).startswith(".") and os.path.isfile(os.path.join(path, fmt.MANIFEST_FILE))


def _some(names: list[str], limit: int = 5) -> str:
    """``'a', 'b', ...``: the first ``limit`` names, quoted."""
    return ", ".join(map(repr, names[:limit])) + (", ..." if len(names) > limit else "")


def read_consistently(path: str, read: Callable[[OpenedDir], _T]) -> _T:
    """``read`` the checkpoint directory ``path`` as one checkpoint: retried on the new one when
    the path was replaced during the read (also ``remote``'s way to open a committed directory)."""
    for attempt in range(_ATTEMPTS):
        with OpenedDir(path) as directory:
            try:
                return read(directory)
            except (CorruptCheckpointError, CheckpointNotFoundError, FileNotFoundError):
                if attempt + 1 < _ATTEMPTS and directory.replaced():
                    continue  # a newer checkpoint took this path while we read: read that one
                raise
    raise AssertionError("unreachable")


def read_manifest(path: str | os.PathLike[str]) -> fmt.Manifest:
    return read_consistently(os.fspath(path), manifest_in)


def manifest_in(directory: OpenedDir) -> fmt.Manifest:
    """The parsed manifest of an opened checkpoint directory; a clear error when there is none."""
    path = directory.path
    try:
        data = directory.read(fmt.MANIFEST_FILE)
    except FileNotFoundError:
        raise CheckpointNotFoundError(_no_manifest_message(directory), path) from None
    try:
        return fmt.Manifest.from_bytes(data, where=path)
    except CorruptCheckpointError as err:
        err.path = path
        raise


def _no_manifest_message(directory: OpenedDir) -> str:
    """Why a folder without a manifest is not a checkpoint: an interrupted save or copy leaves
    checkpoint files behind; anything else (a logs folder, the checkpoint folder itself) is a
    wrong path."""
    path = directory.path
    try:
        names = sorted(os.listdir(directory.fd))
    except OSError:
        names = []
    ours = [n for n in names if n == fmt.METADATA_FILE or n.endswith((".safetensors", ".distcp"))]
    if ours:
        return (
            f"{path!r} has no {fmt.MANIFEST_FILE} but holds checkpoint files ({_some(ours, 3)}): it"
            " is an incomplete copy or an interrupted save, never committed. Resume from an earlier checkpoint, or"
            " copy the whole checkpoint folder again."
        )
    nearby = checkpoints_in(path)
    if nearby:
        hint = f"It is a folder of checkpoints: pass one of them ({_some([os.path.basename(p) for p in nearby])})."
    else:
        hint = f"It holds {_some(names) if names else 'nothing'}. Check the path: a checkpoint is a folder such as"
        hint += " 'epoch=0-step=500.ckpt/'."
    return f"{path!r} is not a lightning_ckpt checkpoint (it has no {fmt.MANIFEST_FILE}). {hint}"


def check_structure(directory: OpenedDir, manifest: fmt.Manifest) -> None:
    """Every file the manifest lists exists, is a regular file inside the directory, has its size."""
    path = directory.path
    for name, record in manifest.files.items():
        try:
            st = os.stat(name, dir_fd=directory.fd, follow_symlinks=False)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{path!r}: file {name!r} listed in the manifest is missing; the checkpoint is incomplete.", path, name
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{path!r}: {name!r} is not a regular file; refusing to read it.", path, name)
        if st.st_size != record.size:
            raise CorruptCheckpointError(
                f"{path!r}: file {name!r} is {st.st_size} bytes, the manifest says {record.size};"
                " it is truncated or was modified.",
                path,
                name,
            )


def check(path: str | os.PathLike[str]) -> fmt.Manifest:
    """The cheap check every load starts with, alone: a committed manifest of a readable format
    version, every listed file present with its size, the metadata's digest. Reads the manifest
    and the metadata (small) and stats the shards; catches interrupted saves, missing and
    truncated files, not bytes changed in place (``verify`` does)."""
    return read_consistently(os.fspath(path), _check)


def _check(directory: OpenedDir) -> fmt.Manifest:
    return _checked(directory)[0]


def _checked(directory: OpenedDir) -> tuple[fmt.Manifest, Any]:
    """The cheap check (see :func:`check`): the manifest and the metadata's verified JSON tree."""
    manifest = manifest_in(directory)
    check_structure(directory, manifest)
    return manifest, _read_tree(directory, manifest)


def verify(path: str | os.PathLike[str], progress: Callable[[int, int], None] | None = None) -> fmt.Manifest:
    """Full verification: structure plus every file's digest. Raises on the first damaged file.
    ``progress(done, total)``: the bytes hashed so far and the files' total, as each piece is hashed."""
    return read_consistently(os.fspath(path), functools.partial(_verify, progress=progress))


def _running_total(progress: Callable[[int, int], None], total: int) -> Callable[[int], None]:
    """``add(n)``: adds ``n`` bytes to a running count and reports ``progress(count, total)``."""
    done = 0

    def add(n: int) -> None:
        nonlocal done
        done += n
        progress(done, total)

    return add


def _verify(directory: OpenedDir, progress: Callable[[int, int], None] | None) -> fmt.Manifest:
    path = directory.path
    manifest = manifest_in(directory)
    check_structure(directory, manifest)
    buffers = [mmap.mmap(-1, digests.CHUNK) for _ in range(2)]
    hashed = None if progress is None else _running_total(progress, sum(r.size for r in manifest.files.values()))
    try:
        for name, record in manifest.files.items():
            fd, _ = directory.open_direct(name)
            found = digests.file_digest(fd, buffers, manifest.checksum, hashed)
            digests.check_digest(path, name, manifest.checksum, record.digest, found)
    finally:
        for buffer in buffers:
            buffer.close()
    return manifest


@dataclass
class Shard:
    mapped: mmap.mmap  # the whole file: a private (copy-on-write) mapping, or its bytes read into memory
    data_start: int
    entries: dict[str, fmt.HeaderEntry]

    def blob(self, entry: fmt.HeaderEntry) -> torch.Tensor:
        """The blob's bytes with a storage of their own: saving one tensor never drags the file."""
        n = entry.end - entry.begin
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.mapped, dtype=torch.uint8, count=n, offset=self.data_start + entry.begin)


def _open_shard(directory: OpenedDir, name: str, expected: tuple[str, str] | None = None) -> Shard:
    """Map shard ``name`` and validate its header; with ``expected`` = (algorithm, digest), first
    hash the whole mapped file and raise ``CorruptCheckpointError`` on a mismatch."""
    path = directory.path
    with os.fdopen(directory.open(name), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        # MAP_PRIVATE: writes (e.g. an optimizer step on a restored state) copy the page, never the file.
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None
    if mapped is None:  # an empty file: no header, refused naming the file
        shard_of(directory, name, b"", 0)
        raise AssertionError("unreachable: parse_header refuses a file too short for a header")
    try:
        if expected is not None:
            algorithm, digest = expected
            digests.check_digest(path, name, algorithm, digest, digests.mapped_digest(mapped, algorithm))
        return shard_of(directory, name, mapped, size)
    except BaseException:
        mapped.close()
        raise


def shard_of(directory: OpenedDir, name: str, data: Any, size: int) -> Shard:
    """Shard file ``name`` whose ``size`` bytes are the start of ``data`` (a map of the file, or
    its bytes read into memory), its header parsed and checked."""
    path = directory.path
    prefix = data[: min(8, size)]
    if len(prefix) == 8:
        length = int.from_bytes(prefix, "little")
        if length <= fmt.MAX_HEADER_BYTES and 8 + length <= size:
            prefix = data[: 8 + length]
    try:
        data_start, entries = fmt.parse_header(prefix, size, where=f"{path}/{name}")
    except CorruptCheckpointError as err:
        err.path, err.file = path, name
        raise
    return Shard(data, data_start, entries)


def shard_names(manifest: fmt.Manifest) -> set[str]:
    """The manifest's shard files (tensor data), as against the small ones (metadata, model index)."""
    return {name for files in manifest.components.values() for name in files}


def checked_tree(directory: OpenedDir, verify: bool) -> tuple[fmt.Manifest, Any, int]:
    """The cheap check, the metadata's tree and, with ``verify``, every small file's digest (the
    shards are hashed as they are read); (manifest, tree, bytes of the small files read)."""
    manifest, tree = _checked(directory)
    shards = shard_names(manifest)
    small = [name for name in manifest.files if name not in shards]
    if verify:
        for name in small:
            if name != manifest.metadata_file:  # the metadata's digest is checked in every mode
                record = manifest.files[name]
                digests.check_digest(directory.path, name, manifest.checksum, record.digest, fmt.digest(directory.read(name), manifest.checksum))
    return manifest, tree, sum(manifest.files[name].size for name in small)


def _open_verified(directory: OpenedDir, manifest: fmt.Manifest) -> dict[str, Shard]:
    """Hash every listed file before any tensor exists; map the shards (returned, by name).

    Shards are hashed on a few threads at once (the digests release the GIL), so a checkpoint of
    several shards is verified at several times one core's hashing speed. A damaged file raises
    ``CorruptCheckpointError`` naming it (the first in manifest order when several are damaged).
    """
    algorithm = manifest.checksum
    shard_files = shard_names(manifest)
    names = [name for name in manifest.files if name in shard_files]
    return opened_all(
        names,
        lambda name: _open_shard(directory, name, (algorithm, manifest.files[name].digest)),
        lambda shard: shard.mapped.close(),
        _HASH_THREADS,
        "lightning_ckpt-verify",
    )


def opened_all(
    names: list[str], open_one: Callable[[str], _T], close: Callable[[_T], None], threads: int, thread_name: str
) -> dict[str, _T]:
    """``open_one(name)`` of every name (by name), on up to ``threads`` threads at once: all of
    them, or none: when one raises, every one that opened is closed and the first failure in the
    order of ``names`` is raised."""
    workers = max(1, min(len(names), os.cpu_count() or 1, threads))
    opened: dict[str, _T] = {}
    failure: BaseException | None = None
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=thread_name) as pool:
        futures = {name: pool.submit(open_one, name) for name in names}
        for name in names:  # every future is collected, so nothing opened is left behind
            try:
                opened[name] = futures[name].result()
            except BaseException as err:
                failure = failure or err
    if failure is not None:
        for value in opened.values():
            close(value)
        raise failure
    return opened


def device_for(location: str, map_location: MapLocation) -> torch.device:
    """Where a tensor saved on ``location`` goes. ``None`` means CPU, as Lightning's CheckpointIO does."""
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(location, location))
    if callable(map_location):
        # torch.load semantics: fn(storage, location) -> storage or None (None: the saved location).
        moved = map_location(torch.UntypedStorage(0), location)
        return torch.device(location) if moved is None else moved.device
    raise TypeError(f"`map_location` must be None, a str, a torch.device, a dict or a callable, got {map_location!r}")


def load(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    weights_only: bool | None = None,
    verify_checksums: bool = False,
) -> dict[Any, Any]:
    """Load a directory checkpoint written by lightning_ckpt (see ``lightning_ckpt.load_checkpoint``)."""
    return read_consistently(os.fspath(path), lambda d: _load(d, map_location, weights_only, verify_checksums))


def _load(directory: OpenedDir, map_location: MapLocation, weights_only: bool | None, verify_checksums: bool) -> dict[Any, Any]:
    manifest, tree, _ = checked_tree(directory, verify_checksums)
    shards = _open_verified(directory, manifest) if verify_checksums else {}
    tensors = Tensors(directory, manifest, map_location, shards, verify_each=False)
    return decode(directory, manifest, tree, tensors.tensor, map_location, weights_only)


def _read_tree(directory: OpenedDir, manifest: fmt.Manifest) -> Any:
    """The metadata's JSON tree. It is small and decides what is read: its digest is checked in every mode."""
    path = directory.path
    metadata = directory.read(manifest.metadata_file)
    record = manifest.files[manifest.metadata_file]
    digests.check_digest(path, manifest.metadata_file, manifest.checksum, record.digest, fmt.digest(metadata, manifest.checksum))
    try:
        return json.loads(metadata)
    except ValueError as err:
        raise CorruptCheckpointError(f"{path!r}: {manifest.metadata_file!r} is not valid JSON ({err}).", path) from err


def decode(
    directory: OpenedDir,
    manifest: fmt.Manifest,
    tree: Any,
    tensor: Callable[[int], torch.Tensor],
    map_location: MapLocation,
    weights_only: bool | None,
) -> dict[Any, Any]:
    path = directory.path

    def checked(index: int) -> torch.Tensor:
        if not isinstance(index, int) or not 0 <= index < len(manifest.tensors):
            raise CorruptCheckpointError(f"{path!r}: metadata references unknown tensor {index!r}.", path)
        return tensor(index)

    def unpickle(data: bytes, at: tuple[Any, ...]) -> Any:
        return _unpickle(data, at, path, map_location, weights_only)

    try:
        return decode_tree(tree, checked, unpickle)  # type: ignore[no-any-return]
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, IndexError) as err:
        # RuntimeError includes RecursionError (absurd nesting) and torch's errors on bad views.
        raise CorruptCheckpointError(f"{path!r}: {manifest.metadata_file!r} is malformed ({err}).", path) from err


class Tensors:
    """The tensors of one opened checkpoint, as views of its privately mapped shards.

    ``shards`` holds shards already mapped (and verified); others are mapped on first use, and
    with ``verify_each`` hashed first, so a reader of a few pieces verifies only their files.
    """

    def __init__(
        self,
        directory: OpenedDir,
        manifest: fmt.Manifest,
        map_location: MapLocation,
        shards: dict[str, Shard],
        verify_each: bool,
    ) -> None:
        self.directory, self.manifest, self.map_location = directory, manifest, map_location
        self.shards, self.verify_each = shards, verify_each
        self.blobs: dict[tuple[str, str, str], torch.Tensor] = {}  # (file, blob, device) -> uint8 tensor

    def _blob_bytes(self, file: str, name: str, device: torch.device) -> torch.Tensor:
        key = (file, name, str(device))
        if key not in self.blobs:
            if file not in self.shards:
                expected = (self.manifest.checksum, self.manifest.files[file].digest) if self.verify_each else None
                self.shards[file] = _open_shard(self.directory, file, expected)
            shard = self.shards[file]
            entry = shard.entries.get(name)
            if entry is None:
                raise CorruptCheckpointError(f"{self.directory.path!r}: tensor {name!r} is missing from {file!r}.", self.directory.path, file)
            data = shard.blob(entry)
            self.blobs[key] = data if device.type == "cpu" else data.to(device)
        return self.blobs[key]

    def _view(self, t: fmt.TensorRecord, piece: dict[str, Any] | None, device: torch.device) -> torch.Tensor:
        """Tensor record ``t`` (or its ``piece``) as a view of its blob's bytes on ``device``."""
        file, blob = (t.file, t.blob) if piece is None else (piece["file"], piece["blob"])
        shape = t.shape if piece is None else piece["shape"]
        offset = (t.byte_offset if piece is None else piece.get("byte_offset")) or 0
        stride_list = t.stride if piece is None else piece.get("stride")
        dtype = getattr(torch, t.dtype)
        raw = self._blob_bytes(file, blob, device)
        item = torch.empty((), dtype=dtype).element_size()
        stride = tuple(stride_list) if stride_list is not None else contiguous_strides(shape)
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
        if offset < 0 or offset % item or offset + span * item > raw.numel():
            raise CorruptCheckpointError(
                f"{self.directory.path!r}: tensor {format_key_path(t.path)} does not fit its data in {file!r}.",
                self.directory.path,
                file,
            )
        usable = raw[: raw.numel() - raw.numel() % item]
        try:
            typed = usable.view(dtype)
        except RuntimeError:  # misaligned in a file not written by us: copy to aligned memory
            typed = usable.clone().view(dtype)
        return typed.as_strided(shape, stride, typed.storage_offset() + offset // item)

    def piece(self, index: int, piece: dict[str, Any] | None) -> torch.Tensor:
        """Piece ``piece`` of tensor ``index`` (``None``: the whole stored tensor), on the CPU."""
        return self._view(self.manifest.tensors[index], piece, torch.device("cpu"))

    def tensor(self, index: int) -> torch.Tensor:
        t = self.manifest.tensors[index]
        device = device_for(t.device, self.map_location)
        if t.chunks is None:
            result = self._view(t, None, device)
        else:  # a sharded save: the whole tensor, assembled from its pieces
            result = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
            for piece in t.chunks:
                region = result
                for dim, (start, length) in enumerate(zip(piece["offsets"], piece["shape"])):
                    region = region.narrow(dim, start, length)
                # From the mapped bytes (a synchronous copy): a device copy of each piece would be
                # cached beside the assembled tensor, twice the state on the GPU at the peak.
                region.copy_(self.piece(index, piece))
        if t.parameter:
            result = torch.nn.Parameter(result, requires_grad=t.requires_grad)
        elif t.requires_grad:
            result.requires_grad_(True)
        return result


class ShardFiles:
    """An opened checkpoint directory for readers of pieces (``distributed.ShardedStorageReader``):
    the manifest, pieces as CPU views, and the dict with chosen tensors supplied by the caller."""

    def __init__(self, path: str, verify: bool) -> None:
        self.directory = OpenedDir(path)
        self.manifest = manifest_in(self.directory)
        check_structure(self.directory, self.manifest)
        self._tensors = Tensors(self.directory, self.manifest, None, {}, verify_each=verify)

    def close(self) -> None:
        """Close the directory; tensors already handed out stay valid (they map the files)."""
        self.directory.__exit__()

    def piece(self, index: int, piece: dict[str, Any] | None) -> torch.Tensor:
        return self._tensors.piece(index, piece)

    def load_tree(self, weights_only: bool | None, supplied: Callable[[int], torch.Tensor | None]) -> dict[Any, Any]:
        """The checkpoint dict; tensor ``i`` is ``supplied(i)`` unless that is ``None`` (then read whole)."""
        tree = _read_tree(self.directory, self.manifest)

        def tensor(index: int) -> torch.Tensor:
            given = supplied(index)
            return self._tensors.tensor(index) if given is None else given

        return decode(self.directory, self.manifest, tree, tensor, None, weights_only)


def _unpickle(data: bytes, at: tuple[Any, ...], path: str, map_location: MapLocation, weights_only: bool | None) -> Any:
    safe = weights_only is None or weights_only
    # torch.load's own map_location semantics (a dict remaps each saved device); None: the CPU.
    location = torch.device("cpu") if map_location is None else map_location
    try:
        return torch.load(io.BytesIO(data), map_location=location, weights_only=safe)
    except pickle.UnpicklingError as err:
        if not safe:
            raise
        key = format_key_path(at)
        raise UnsafeCheckpointError(
            f"{path!r}: loading {key} needs to unpickle an object that weights-only loading refuses"
            f" ({str(err).splitlines()[0] if str(err) else type(err).__name__})."
            " If you trust this checkpoint, load it with `weights_only=False` (e.g."
            " `lightning_ckpt.load_checkpoint(path, weights_only=False)` or"
            " `trainer.fit(model, ckpt_path=path, weights_only=False)`), or allow the type with"
            " `torch.serialization.add_safe_globals([...])`.",
            path,
            key,
        ) from err


# How the files ``torch.load`` reads begin: a zip archive (``torch.save``'s format since torch 1.6,
# TorchScript archives too), a pickle of protocol 2 or more (``_use_new_zipfile_serialization=False``:
# torch's magic number pickled first) or, at offset 257, a tar archive (torch before 0.4).
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = b"\x80"
_TAR_MAGIC, _TAR_AT = b"ustar", 257


def check_torch_file(path: str) -> None:
    """Raise ``UnsupportedFormatError`` when the file ``path`` cannot be a ``torch.save`` file.

    Without this, ``torch.load`` of a text or random file reports an unpickling detail
    ("Weights only load failed ... Unsupported operand 103"). A file that begins as torch's
    formats do is left to ``torch.load``, whose errors (a weights-only refusal, a truncated
    archive) then say what is wrong with that real file.
    """
    with open(path, "rb") as f:
        head = f.read(_TAR_AT + len(_TAR_MAGIC))
    if head.startswith((_ZIP_MAGIC, _PICKLE_PROTO)) or head[_TAR_AT:] == _TAR_MAGIC:
        return
    what = "an empty file" if not head else f"a file beginning with {head[:16]!r}"
    raise UnsupportedFormatError(
        f"{path!r} is not a checkpoint: {what}, not a file written by torch.save. lightning_ckpt reads a"
        f" checkpoint directory written by lightning_ckpt (with its {fmt.MANIFEST_FILE}), a single file"
        " written by torch.save (Lightning's default .ckpt) and a torch.distributed.checkpoint (DCP)"
        " folder. Check the path you passed (e.g. `ckpt_path`).",
        path,
    )


def load_legacy(path: str, map_location: MapLocation, weights_only: bool | None) -> Any:
    """A single-file checkpoint, loaded as Lightning's ``TorchCheckpointIO`` does; a file that is
    none of torch's formats raises ``UnsupportedFormatError`` (``check_torch_file``)."""
    check_torch_file(path)
    location: Any = (lambda storage, loc: storage) if map_location is None else map_location
    with open(path, "rb") as f:
        return torch.load(f, map_location=location, weights_only=weights_only)
