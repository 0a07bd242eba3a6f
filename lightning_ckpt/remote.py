"""Checkpoints on object storage and every other fsspec filesystem (``s3://``, ``gs://``, ``memory://`` ...).

A save is committed on the local disk first (the ordinary atomic directory of ``writer.py``), then
published. Object stores have no rename, so a remote checkpoint is a folder of immutable
*generations* and one small pointer object, ``CURRENT``, that names the committed one::

    s3://bucket/run/epoch=0-step=500.ckpt/
        CURRENT                         # {"format", "version", "generation", "manifest": {size, digest}}
        gen-1795412345678-1a2b3c4d/     # a complete checkpoint directory, exactly as on local disk
            manifest.json
            metadata.json
            model-00001-of-00001.safetensors
            ...

Publishing uploads every file of a new generation (in parallel, each streamed in parts of
``part_size`` and its digest recomputed on the way and checked against the manifest), then the
generation's manifest, then ``CURRENT``. That one PUT, atomic on object stores, is the commit.
Only after it are older generations deleted. Invariants:

* ``CURRENT`` never names a generation that is not whole: a reader sees the previous checkpoint
  or the new one, never a mix, and replacing ``last.ckpt`` never leaves it unloadable.
* Every generation that ``CURRENT`` does not name is garbage. A failed upload deletes its own; one
  killed mid-way is deleted, with its unfinished multipart uploads, by the next save into the
  same folder from a later process (``clean_orphans``).
* One process publishes into a folder at a time (the writer of the run), as for local saves.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import io
import json
import os
import queue
import re
import secrets
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import fsspec
from fsspec.spec import AbstractFileSystem

from lightning_ckpt import manifest as fmt
from lightning_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    MissingDependencyError,
)

CURRENT_FILE = "CURRENT"
POINTER_FORMAT = "lightning_ckpt.pointer"
POINTER_VERSION = 1
_GENERATION = re.compile(r"gen-(\d{13})-[0-9a-f]{8}")
DEFAULT_PART_SIZE = 64 * 2**20  # S3 allows 5 MiB to 5 GiB per part and 10,000 parts per object
DEFAULT_CONCURRENCY = 8  # objects uploaded or downloaded at once
_ATTEMPTS = 4  # per object, on top of the client's own retries; backoff 0.5, 1, 2 s
_LOCAL_PROTOCOLS = ("file", "local")
# The extra of this package that installs each protocol's fsspec implementation.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
_PROCESS_STARTED_MS = int(time.time() * 1000)
_T = TypeVar("_T")
ENCODINGS = {"zstd": ".zst"}  # how a file may be stored remotely -> the suffix of its object
_PIECE = 4 * 2**20  # bytes read (and compressed, decompressed) at a time
# Client errors that no retry fixes (botocore's names; matched by name, botocore being optional).
_NOT_TRANSIENT = {"NoCredentialsError", "PartialCredentialsError", "NoRegionError", "ParamValidationError", "InvalidConfigError"}
_cleaned: set[tuple[Any, str]] = set()  # (protocol, folder) already rid of orphans by this process
if TYPE_CHECKING:
    from lightning_ckpt.server_copy import ServerCopies


def is_remote(path: Any) -> bool:
    """Whether ``path`` is an fsspec URL of a non-local filesystem (``file://`` is local)."""
    text = path if isinstance(path, str) else os.fspath(path) if isinstance(path, os.PathLike) else None
    return text is not None and "://" in text and fsspec.utils.get_protocol(text) not in _LOCAL_PROTOCOLS


def url_key(url: Any) -> str:
    """``url`` in one spelling for comparisons: the protocol lowercased, empty and ``.`` path
    segments and trailing slashes dropped (``s3://b//run/./a.ckpt/`` -> ``s3://b/run/a.ckpt``)."""
    protocol, _, rest = os.fspath(url).partition("://")
    return f"{protocol.lower()}://" + "/".join(p for p in rest.split("/") if p not in ("", "."))


@dataclass(frozen=True)
class RemoteOptions:
    """How remote checkpoints are written and read (picklable: the writer process gets a copy).

    ``local_dir``: the local tier (each save is committed there first and kept, up to
    ``local_keep`` published checkpoints); ``None`` spools each save through a temporary folder.
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    part_size: int = DEFAULT_PART_SIZE
    concurrency: int = DEFAULT_CONCURRENCY
    local_dir: str | None = None
    local_keep: int = 1
    compression: Mapping[str, str] = field(default_factory=dict)  # component (or "*") -> encoding
    compression_level: int = 3

    def encoding_of(self, component: str) -> str | None:
        return self.compression.get(component, self.compression.get("*"))

    def filesystem(self, url: str) -> tuple[AbstractFileSystem, str]:
        """The fsspec filesystem of ``url`` and the path inside it; a clear error naming the
        package (and this package's extra) when the protocol's implementation is missing."""
        try:
            return fsspec.core.url_to_fs(url, **dict(self.storage_options))
        except ImportError as err:
            protocol = fsspec.utils.get_protocol(url)
            extra = _EXTRAS.get(protocol)
            how = f"pip install 'lightning-ckpt[{extra}]'" if extra else "install its fsspec implementation"
            raise MissingDependencyError(
                f"Checkpoint path {url!r} uses the {protocol!r} protocol, whose fsspec implementation is not"
                f" installed ({err}). Fix: {how}.",
                url,
            ) from err
        except ValueError as err:
            raise CheckpointError(f"Checkpoint path {url!r} is not a URL fsspec can open: {err}.", url) from err

    def local_path(self, url: str) -> str:
        """Where ``url``'s checkpoint lives in the local tier: ``<local_dir>/<protocol>/<bucket>/<path>``."""
        assert self.local_dir is not None
        protocol = fsspec.utils.get_protocol(url)
        parts = [p for p in url.split("://", 1)[1].split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise ValueError(f"Checkpoint URL {url!r} has no usable path (or '.'/'..' in it); name a folder and a checkpoint.")
        return os.path.join(os.path.abspath(self.local_dir), protocol, *parts)


def new_generation() -> str:
    """A generation name that sorts by creation time: ``gen-<unix ms>-<random>``."""
    return f"gen-{int(time.time() * 1000):013d}-{secrets.token_hex(4)}"


# ----------------------------------------------------------------------------------------------
# Streaming one object up or down, its digest computed on the way.


def _discard(stream: Any) -> None:
    """Drop an unfinished upload: the object is never created (a multipart upload is aborted)."""
    try:
        if hasattr(stream, "discard"):
            stream.discard()
        stream.closed = True  # closing would commit what was written so far
    except Exception:
        pass  # best effort: an upload left behind is aborted by ``clean_orphans``


class _Codec(Protocol):
    def __call__(self, data: Any, /) -> bytes: ...


def zstd_module() -> Any:
    """The ``zstandard`` module, or a ``MissingDependencyError`` naming the extra that installs it."""
    try:
        import zstandard
    except ImportError as err:
        raise MissingDependencyError(
            f"Compressed checkpoints need the zstandard package ({err}). Fix: pip install 'lightning-ckpt[zstd]'."
        ) from err
    return zstandard


def _encoder(encoding: str | None, level: int) -> tuple[_Codec, Callable[[], bytes]]:
    """(feed, finish) of a streaming encoder: identity, or one zstd frame with its content checksum."""
    if encoding is None:
        return bytes, lambda: b""
    compressor = zstd_module().ZstdCompressor(level=level, write_checksum=True).compressobj()
    return compressor.compress, compressor.flush


def _decoded(source: Any, encoding: str | None, part_size: int) -> Iterator[bytes]:
    """The bytes of an object read from the file object ``source``, decompressed with
    ``encoding``: read a part at a time, and decompressed a piece at a time, so a highly
    compressible part never expands in memory whole."""
    stream = source if encoding is None else zstd_module().ZstdDecompressor().stream_reader(source, read_size=part_size)
    step = part_size if encoding is None else _PIECE
    while data := stream.read(step):
        yield data


def _check_read(local_file: str, read: int, found: str, record: fmt.FileRecord, algorithm: str) -> None:
    """Refuse to complete an upload whose local file is not what its manifest says."""
    if read != record.size or found != record.digest:
        raise CorruptCheckpointError(
            f"{local_file!r} changed on local disk after it was written (size {read} against {record.size},"
            f" {algorithm} {found} against {record.digest}); refusing to upload it.",
            local_file,
        )


def _upload(
    fs: AbstractFileSystem, fd: int, local_file: str, remote_file: str, record: fmt.FileRecord, algorithm: str,
    part_size: int, encoding: str | None, level: int, parts_pool: concurrent.futures.Executor,
) -> int:
    """Stream the local file open as ``fd`` to ``remote_file`` (``encoding``: compressed on the
    way); the object appears whole when the file's digest matched the manifest's, or not at all.
    Returns the object's size. S3: one part in memory at a time (``_upload_s3``); other
    filesystems: through their buffered file object."""
    if hasattr(fs, "call_s3"):
        return _upload_s3(fs, fd, local_file, remote_file, record, algorithm, part_size, encoding, level, parts_pool)
    digest = fmt.hasher(algorithm)
    buffer = bytearray(max(1, min(part_size, _PIECE, record.size)))
    view = memoryview(buffer)
    feed, finish = _encoder(encoding, level)
    read = stored = 0
    stream = fs.open(remote_file, "wb", block_size=part_size)
    try:
        while n := os.preadv(fd, [buffer], read):
            digest.update(view[:n])
            out = view[:n] if encoding is None else feed(view[:n])
            stream.write(out)
            read, stored = read + n, stored + len(out)
        tail = finish()
        stream.write(tail)
        stored += len(tail)
        _check_read(local_file, read, digest.hexdigest(), record, algorithm)
        stream.close()  # completes the upload
    except BaseException:
        _discard(stream)
        raise
    return stored


class _PartBody(io.RawIOBase):
    """A seekable stream over one part: ``size`` bytes served by ``read_at(offset, n)``. The client
    reads it in pieces (for its checksum, the request and any retry), where a ``bytes`` body gets
    copied whole once more on its way to the socket."""

    def __init__(self, size: int, read_at: Callable[[int, int], Any]) -> None:
        super().__init__()
        self._size, self._read_at, self._position = size, read_at, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._size - self._position)
        if n <= 0:
            return 0
        data = self._read_at(self._position, n)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = min(max(base + offset, 0), self._size)
        return self._position

    def tell(self) -> int:
        return self._position


def _upload_s3(
    fs: Any, fd: int, local_file: str, remote_file: str, record: fmt.FileRecord, algorithm: str,
    part_size: int, encoding: str | None, level: int, parts_pool: concurrent.futures.Executor,
) -> int:
    """``_upload`` on S3, driving the multipart upload itself. A plain file's parts are sent as
    streams over the file's range, on ``parts_pool`` (shared by every file of a save, so the parts
    of a few large files fill the connections), while this thread hashes the file in order; the
    upload is completed only if the digest matched. An upload holds a few MiB, not a part
    (s3fs's file object buffers a part, copies it out and lets its buffer grow: ~4 parts
    measured). Compressed, parts go one after the other, one part of compressed bytes held. A
    file that fits one part is one PUT."""
    bucket, key, _ = fs.split_path(remote_file)
    digest = fmt.hasher(algorithm)
    feed, finish = _encoder(encoding, level)
    upload_id: str | None = None
    parts: list[dict[str, Any]] = []
    read = stored = 0
    pending = bytearray()  # encoded bytes not sent yet (compressed uploads only)

    def send(body: _PartBody, size: int, last: bool) -> None:
        nonlocal upload_id, stored
        stored += size
        if upload_id is None and last:
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body)
            return
        if upload_id is None:
            upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        number = len(parts) + 1
        etag = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)["ETag"]
        parts.append({"PartNumber": number, "ETag": etag})

    def file_range(start: int, size: int) -> _PartBody:
        return _PartBody(size, lambda offset, n: os.pread(fd, n, start + offset))

    def buffered(data: bytes | bytearray) -> _PartBody:
        view = memoryview(data)
        return _PartBody(len(data), lambda offset, n: view[offset : offset + n])

    try:
        if encoding is None:
            multipart = record.size > part_size
            futures: list[concurrent.futures.Future[dict[str, Any]]] = []
            if multipart:
                upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]

                def upload_part(number: int, start: int) -> dict[str, Any]:
                    body = file_range(start, min(part_size, record.size - start))
                    etag = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)["ETag"]
                    return {"PartNumber": number, "ETag": etag}

                futures = [
                    parts_pool.submit(_retried, functools.partial(upload_part, number, start), f"Uploading part {number} of {local_file!r}")
                    for number, start in enumerate(range(0, record.size, part_size), 1)
                ]
            try:
                while data := os.pread(fd, _PIECE, read):  # to the end: a longer file is caught too
                    digest.update(data)
                    read += len(data)
                parts = [future.result() for future in futures]
            except BaseException:
                for future in futures:
                    future.cancel()
                concurrent.futures.wait(futures)  # no part still sending when the upload is aborted
                raise
            if not multipart:  # one PUT, once the file proved to be the manifest's
                _check_read(local_file, read, digest.hexdigest(), record, algorithm)
                fs.call_s3("put_object", Bucket=bucket, Key=key, Body=file_range(0, read))
            stored = read
        else:
            while True:
                data = os.pread(fd, _PIECE, read)
                read += len(data)
                digest.update(data)
                pending += feed(data) if data else finish()
                while len(pending) >= part_size:
                    with memoryview(pending) as view:
                        part = bytes(view[:part_size])
                    send(buffered(part), part_size, False)
                    del pending[:part_size]
                if not data:
                    if pending or upload_id is None:  # no empty last part after a full one
                        send(buffered(pending), len(pending), True)
                    break
        _check_read(local_file, read, digest.hexdigest(), record, algorithm)
        if upload_id is not None:
            fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})
    except BaseException:
        if upload_id is not None:
            try:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            except Exception:
                pass  # ``clean_orphans`` aborts it later
        raise
    return stored


def _download(
    fs: AbstractFileSystem, remote_file: str, local_file: str | None, record: fmt.FileRecord, algorithm: str,
    part_size: int, url: str, name: str, encoding: str | None = None,
) -> None:
    """Stream ``remote_file`` (decompressing it, with ``encoding``) into ``local_file`` (``None``:
    only hash it) and check it against the manifest; ``CorruptCheckpointError`` naming the object
    when it differs."""
    digest = fmt.hasher(algorithm)
    size = 0
    sink = open(local_file, "wb") if local_file is not None else None
    try:
        with fs.open(remote_file, "rb", block_size=part_size, cache_type="none") as source:
            pieces = _decoded(source, encoding, part_size)
            while True:
                try:
                    data = next(pieces, b"")
                except Exception as err:
                    if encoding is None or isinstance(err, OSError):
                        raise
                    raise CorruptCheckpointError(  # zstd: a damaged frame or its checksum
                        f"{url!r}: object {name!r} (stored as {remote_file!r}) does not decompress ({err}); the remote"
                        " checkpoint is damaged. Resume from another checkpoint.",
                        url,
                        name,
                    ) from err
                if not data:
                    break
                digest.update(data)
                if sink is not None:
                    sink.write(data)
                size += len(data)
    finally:
        if sink is not None:
            sink.close()
    _check_object(url, name, remote_file, size, digest.hexdigest(), record, algorithm)


def _check_object(url: str, name: str, remote_file: str, size: int, found: str, record: fmt.FileRecord, algorithm: str) -> None:
    """``CorruptCheckpointError`` naming the object when what it held is not the manifest's file."""
    if size != record.size:
        raise CorruptCheckpointError(
            f"{url!r}: object {name!r} (stored as {remote_file!r}) holds {size} bytes, the manifest says {record.size}; the remote checkpoint is"
            " damaged. Resume from another checkpoint.",
            url,
            name,
        )
    if found != record.digest:
        raise CorruptCheckpointError(
            f"{url!r}: checksum mismatch in object {name!r} (stored as {remote_file!r}; {algorithm}: expected"
            f" {record.digest}, found {found});"
            " the remote checkpoint is damaged. Resume from another checkpoint.",
            url,
            name,
        )


def _retried(action: Callable[[], _T], what: str) -> _T:
    """What ``action`` returns; transient failures (network, 5xx) retried with backoff. Not
    retried: damaged data, missing buckets or objects, refused permissions."""
    for attempt in range(_ATTEMPTS):
        try:
            return action()
        except (CheckpointError, FileNotFoundError, PermissionError, KeyboardInterrupt):
            raise
        except Exception as err:
            if type(err).__name__ in _NOT_TRANSIENT:
                raise
            if attempt + 1 == _ATTEMPTS:
                raise OSError(f"{what} failed {_ATTEMPTS} times; last error: {type(err).__name__}: {err}") from err
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def _parallel(jobs: list[Callable[[], None]], concurrency: int) -> None:
    """Run ``jobs`` on up to ``concurrency`` threads; the first failure cancels the rest and is raised."""
    if not jobs:
        return
    with concurrent.futures.ThreadPoolExecutor(min(concurrency, len(jobs)), thread_name_prefix="lightning_ckpt-io") as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


# ----------------------------------------------------------------------------------------------
# The pointer: the commit of a remote checkpoint.


def _pointer_bytes(generation: str, manifest_bytes: bytes, objects: dict[str, dict[str, Any]]) -> bytes:
    """``objects``: the files stored encoded, ``{file: {"encoding": "zstd", "size": object bytes}}``
    (the object is named ``<file>.zst``); every other file is stored as it is, under its own name."""
    body = {
        "format": POINTER_FORMAT,
        "version": POINTER_VERSION,
        "generation": generation,
        "manifest": {"size": len(manifest_bytes), "digest": fmt.digest(manifest_bytes)},
        "objects": objects,
    }
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def read_pointer(fs: AbstractFileSystem, root: str, url: str) -> dict[str, Any] | None:
    """``CURRENT`` of the remote checkpoint at ``root``, validated; ``None`` when there is none."""
    try:
        data = fs.cat_file(f"{root}/{CURRENT_FILE}")
    except FileNotFoundError:
        return None
    try:
        body = json.loads(data)
        ok = (
            body.get("format") == POINTER_FORMAT
            and isinstance(body.get("version"), int)
            and _GENERATION.fullmatch(body.get("generation", "")) is not None
            and isinstance(body["manifest"]["size"], int)
            and isinstance(body["manifest"]["digest"], str)
            and isinstance(body.get("objects", {}), dict)
            and all(o.get("encoding") in ENCODINGS and isinstance(o.get("size"), int) for o in body.get("objects", {}).values())
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        ok = False
    if not ok:
        raise CorruptCheckpointError(f"{url!r}: {CURRENT_FILE} is not a lightning_ckpt pointer; the remote checkpoint is damaged.", url, CURRENT_FILE)
    if body["version"] > POINTER_VERSION:
        raise CheckpointError(f"{url!r}: pointer version {body['version']} is newer than this lightning_ckpt reads. Upgrade it.", url)
    return body


def _not_found(url: str) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"Checkpoint file not found: {url}. There is no committed lightning_ckpt checkpoint at that URL (no"
        f" {CURRENT_FILE} object): check the URL, or resume from another checkpoint of the run.",
        url,
    )


@dataclass(frozen=True)
class Committed:
    """The committed generation of a remote checkpoint, as ``CURRENT`` and its manifest describe it."""

    manifest: fmt.Manifest
    manifest_bytes: bytes
    folder: str  # the generation's path inside the filesystem
    generation: str
    objects: dict[str, dict[str, Any]]  # encoded files: {"encoding", "size"} (see ``_pointer_bytes``)

    def object_of(self, name: str) -> tuple[str, str | None]:
        """(path of the object holding file ``name``, its encoding or ``None``)."""
        encoding = self.objects.get(name, {}).get("encoding")
        return f"{self.folder}/{name}{ENCODINGS[encoding] if encoding else ''}", encoding

    def stored_bytes(self) -> int:
        """Bytes the generation's objects take (encoded files at their encoded size)."""
        return _stored_bytes(self.manifest, self.manifest_bytes, self.objects)


def _stored_bytes(manifest: fmt.Manifest, manifest_bytes: bytes, objects: dict[str, dict[str, Any]]) -> int:
    return sum(objects[n]["size"] if n in objects else r.size for n, r in manifest.files.items()) + len(manifest_bytes)


def read_committed(url: str, options: RemoteOptions) -> Committed:
    """What ``CURRENT`` of the remote checkpoint at ``url`` names, its manifest checked against it."""
    fs, root = options.filesystem(url)
    for attempt in range(_ATTEMPTS):
        pointer = read_pointer(fs, root, url)
        if pointer is None:
            raise _not_found(url)
        folder = f"{root}/{pointer['generation']}"
        try:
            data = fs.cat_file(f"{folder}/{fmt.MANIFEST_FILE}")
        except FileNotFoundError:
            if attempt + 1 < _ATTEMPTS and read_pointer(fs, root, url) != pointer:
                continue  # replaced by a newer save while we read: read that one
            raise CorruptCheckpointError(f"{url!r}: {CURRENT_FILE} names {pointer['generation']!r}, which has no manifest; the remote checkpoint is damaged.", url, fmt.MANIFEST_FILE) from None
        if len(data) != pointer["manifest"]["size"] or fmt.digest(data) != pointer["manifest"]["digest"]:
            raise CorruptCheckpointError(f"{url!r}: the manifest of {pointer['generation']!r} does not match {CURRENT_FILE}; the remote checkpoint is damaged.", url, fmt.MANIFEST_FILE)
        manifest = fmt.Manifest.from_bytes(data, where=url)
        return Committed(manifest, data, folder, pointer["generation"], pointer.get("objects", {}))
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------------------
# Publishing, fetching, verifying, removing.


@dataclass(frozen=True)
class Published:
    url: str
    generation: str
    nbytes: int
    seconds: float
    files: int
    manifest_digest: str
    copied_bytes: int = 0  # of ``nbytes``, copied on the server from earlier checkpoints, not uploaded


def publish(local: str, url: str, options: RemoteOptions, copies: ServerCopies | None = None) -> Published:
    """Upload the committed local checkpoint ``local`` as the new generation of ``url`` and commit it.

    Raises ``CheckpointWriteError`` when anything fails: nothing is committed, and the checkpoint
    previously at ``url`` (if any) is unchanged.
    """
    start = time.perf_counter()
    fs, root = options.filesystem(url)
    # Every file is opened before the upload begins: a save replacing ``local`` meanwhile (the
    # local tier's next ``last.ckpt``) cannot mix two checkpoints; this one stays readable.
    manifest_bytes, manifest, fds = _open_committed(local, frozenset() if copies is None else copies.absent)
    generation = new_generation()
    folder = f"{root}/{generation}"
    parent = root.rsplit("/", 1)[0] if "/" in root else root
    committing = False
    try:
        if (fs.protocol, parent) not in _cleaned:  # orphans come from earlier processes: once per process
            clean_orphans(fs, parent)
            _cleaned.add((fs.protocol, parent))
        fs.makedirs(folder, exist_ok=True)  # a no-op on object stores
        encodings = {
            name: encoding
            for component, names in manifest.components.items()
            if (encoding := options.encoding_of(component)) is not None
            for name in names
        }
        objects: dict[str, dict[str, Any]] = {}

        def upload(name: str, record: fmt.FileRecord) -> None:
            encoding = encodings.get(name)
            target = f"{folder}/{name}{ENCODINGS[encoding] if encoding else ''}"
            copied = None if copies is None else copies.copy(fs, name, record, encoding, target)  # incremental
            if copied is None and name not in fds:
                raise FileNotFoundError(f"{name!r}, unchanged since an earlier checkpoint, could not be copied from it")
            size = copied if copied is not None else _upload(
                fs, fds[name], os.path.join(local, name), target, record, manifest.checksum, options.part_size, encoding,
                options.compression_level, parts_pool,
            )
            if encoding is not None:
                objects[name] = {"encoding": encoding, "size": size}

        jobs = [
            _job(upload, name, record, what=f"Uploading {name!r}")
            for name, record in sorted(manifest.files.items(), key=lambda item: -item[1].size)  # largest first
        ]
        # The parts of multipart uploads (S3), all files' on one pool: `concurrency` parts in flight.
        with concurrent.futures.ThreadPoolExecutor(options.concurrency, thread_name_prefix="lightning_ckpt-part") as parts_pool:
            _parallel(jobs, options.concurrency)
        pointer = _pointer_bytes(generation, manifest_bytes, dict(sorted(objects.items())))
        _retried(lambda: fs.pipe_file(f"{folder}/{fmt.MANIFEST_FILE}", manifest_bytes), "Uploading the manifest")
        committing = True
        _retried(lambda: fs.pipe_file(f"{root}/{CURRENT_FILE}", pointer), f"Writing {CURRENT_FILE}")
    except BaseException as err:
        if committing and _points_at(fs, root, url, generation):
            # The PUT of CURRENT took effect though its reply was lost: committed. Its generation
            # must stay; fall through to the clean-up of a committed save.
            pass
        else:
            _fail(fs, folder, parent, url, err)
    finally:
        for fd in fds.values():
            os.close(fd)
    # Committed. Older generations are garbage now; failing to delete them does not fail the save
    # (the next save of this URL, or of its folder from a later process, removes them).
    _remove_other_generations(fs, root, keep=generation)
    stored = _stored_bytes(manifest, manifest_bytes, objects)
    copied = 0 if copies is None else sum(copies.copied.values())
    return Published(url, generation, stored, time.perf_counter() - start, len(manifest.files) + 1, fmt.digest(manifest_bytes), copied)


def _points_at(fs: AbstractFileSystem, root: str, url: str, generation: str) -> bool:
    """Whether ``CURRENT`` of ``root`` names ``generation`` (``False`` when it cannot be read)."""
    try:
        fs.invalidate_cache(root)
        pointer = read_pointer(fs, root, url)
    except Exception:
        return False
    return pointer is not None and pointer["generation"] == generation


def _fail(fs: AbstractFileSystem, folder: str, parent: str, url: str, err: BaseException) -> None:
    """A publish that did not commit: remove its generation and raise what failed."""
    _remove_quietly(fs, folder)
    _cleaned.discard((fs.protocol, parent))  # what this save could not remove, the next one does
    if isinstance(err, Exception):  # the client's own errors too (no credentials, ...)
        raise CheckpointWriteError(
            f"Uploading checkpoint {url!r} failed: {type(err).__name__}: {str(err).rstrip('.')}. Nothing was"
            " committed; the checkpoint previously at that URL (if any) is unchanged.",
            url,
        ) from err
    raise err


def _job(function: Callable[..., None], *args: Any, what: str) -> Callable[[], None]:
    return lambda: _retried(lambda: function(*args), what)


def _open_committed(local: str, absent: frozenset[str]) -> tuple[bytes, fmt.Manifest, dict[str, int]]:
    """The manifest (bytes, parsed) of the committed local checkpoint ``local`` and an open fd of
    each file it lists, all read through one directory fd: one checkpoint, whatever replaces it
    once they are open. Replaced (and removed) while being opened: the newer one is opened."""
    from lightning_ckpt.reader import OpenedDir, manifest_in, read_consistently

    def open_all(directory: OpenedDir) -> tuple[bytes, fmt.Manifest, dict[str, int]]:
        fds: dict[str, int] = {}
        try:
            manifest = manifest_in(directory)
            data = directory.read(fmt.MANIFEST_FILE)
            for name in manifest.files.keys() - absent:  # ``absent``: stayed on the server (incremental)
                fds[name] = directory.open(name)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return data, manifest, fds

    return read_consistently(local, open_all)


def _listing(fs: AbstractFileSystem, path: str) -> list[str]:
    fs.invalidate_cache(path)  # another process may have written since this one listed
    try:
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def _remove_quietly(fs: AbstractFileSystem, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as err:
        warnings.warn(f"lightning_ckpt: could not remove {path!r} ({err}); the next save into its folder removes it.", stacklevel=2)


def _remove_other_generations(fs: AbstractFileSystem, root: str, keep: str) -> None:
    for name in _listing(fs, root):
        if _GENERATION.fullmatch(name) and name != keep:
            _remove_quietly(fs, f"{root}/{name}")


def _holds_only_ours(children: list[str]) -> bool:
    """Whether a folder holding ``children`` is a remote checkpoint of ours: a pointer and generations only."""
    return all(c == CURRENT_FILE or _GENERATION.fullmatch(c) for c in children)


def clean_orphans(fs: AbstractFileSystem, folder: str) -> list[str]:
    """Delete what interrupted saves into ``folder`` left: generations no ``CURRENT`` names and
    unfinished multipart uploads of generations. Only those begun before this process started,
    so a save still running in this process is never touched. Returns what was removed."""
    removed: list[str] = []
    for name in _listing(fs, folder):
        root = f"{folder}/{name}"
        children = _listing(fs, root)
        generations = [c for c in children if _GENERATION.fullmatch(c)]
        if not generations or not _holds_only_ours(children):
            continue  # not a remote checkpoint of ours
        committed = None
        if CURRENT_FILE in children:
            try:
                pointer = read_pointer(fs, root, root)
                committed = pointer["generation"] if pointer else None
            except CheckpointError:
                continue  # damaged: leave it for a person to look at
        for generation in generations:
            born = int(_GENERATION.fullmatch(generation).group(1))  # type: ignore[union-attr]
            if generation != committed and born < _PROCESS_STARTED_MS:
                _remove_quietly(fs, f"{root}/{generation}")
                removed.append(f"{root}/{generation}")
    removed.extend(_abort_multipart_uploads(fs, folder))
    return removed


def _abort_multipart_uploads(fs: AbstractFileSystem, folder: str) -> list[str]:
    """S3: abort unfinished multipart uploads of generations under ``folder`` begun before this
    process started (their parts are billed but invisible to listings). Other stores: nothing."""
    if not hasattr(fs, "call_s3") or "/" not in folder.strip("/"):
        return []
    bucket, prefix = folder.strip("/").split("/", 1)
    aborted = []
    try:
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
        for upload in uploads:
            key, initiated = upload["Key"], upload.get("Initiated")
            begun_ms = initiated.timestamp() * 1000 if initiated is not None else 0
            if any(_GENERATION.fullmatch(part) for part in key.split("/")) and begun_ms < _PROCESS_STARTED_MS:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"])
                aborted.append(f"{bucket}/{key}")
    except Exception as err:
        warnings.warn(f"lightning_ckpt: could not list or abort unfinished uploads under {folder!r} ({err}).", stacklevel=2)
    return aborted


def fetch(url: str, options: RemoteOptions, dest: str) -> str:
    """Download the committed checkpoint at ``url`` into the local directory ``dest``, verifying
    every object on the way; ``dest`` appears atomically (a complete checkpoint or nothing)."""
    from lightning_ckpt import writer

    fs, root = options.filesystem(url)
    for attempt in range(_ATTEMPTS):
        committed = read_committed(url, options)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = writer.TempDir(dest)
        try:
            ranged = _ranged_download_jobs(fs, committed, options, url, tmp.path)
            _parallel([job for jobs, _ in ranged.values() for job in jobs], options.concurrency)  # by ranges
            checks = [check for _, check in ranged.values()]
            _parallel(checks + _download_jobs(fs, committed, options, url, tmp.path, skip=set(ranged)), options.concurrency)
            with open(os.path.join(tmp.path, fmt.MANIFEST_FILE), "wb") as f:
                f.write(committed.manifest_bytes)
            writer.commit(tmp.path, dest)
        except FileNotFoundError:
            tmp.release(remove=True)
            pointer = read_pointer(fs, root, url)
            if attempt + 1 < _ATTEMPTS and pointer is not None and pointer["generation"] != committed.generation:
                continue  # the generation was replaced while we read: fetch the new one
            raise CorruptCheckpointError(f"{url!r}: an object the manifest lists is missing; the remote checkpoint is damaged.", url) from None
        except BaseException:
            tmp.release(remove=True)
            raise
        tmp.release(remove=False)
        return dest
    raise AssertionError("unreachable")


def verify(url: str, options: RemoteOptions) -> fmt.Manifest:
    """Hash every object of the committed checkpoint at ``url`` against its manifest (nothing is
    stored locally); raise ``CorruptCheckpointError`` naming a damaged object."""
    fs, root = options.filesystem(url)
    for attempt in range(_ATTEMPTS):
        committed = read_committed(url, options)
        try:
            _parallel(_download_jobs(fs, committed, options, url, None), options.concurrency)
        except FileNotFoundError as err:
            pointer = read_pointer(fs, root, url)
            if attempt + 1 < _ATTEMPTS and pointer is not None and pointer["generation"] != committed.generation:
                continue  # replaced by a newer save while we read: check that one
            raise CorruptCheckpointError(
                f"{url!r}: an object of {committed.generation!r} that the manifest lists is missing ({err}); the remote"
                " checkpoint is damaged.",
                url,
            ) from err
        return committed.manifest
    raise AssertionError("unreachable")


def _download_jobs(
    fs: AbstractFileSystem, committed: Committed, options: RemoteOptions, url: str, into: str | None, skip: set[str] = frozenset()  # type: ignore[assignment]
) -> list[Callable[[], None]]:
    """A job per file of ``committed`` (but ``skip``): stream its object into folder ``into``
    (``None``: only check it)."""
    jobs = []
    for name, record in committed.manifest.files.items():
        if name in skip:
            continue
        path, encoding = committed.object_of(name)
        local = None if into is None else os.path.join(into, name)
        jobs.append(_job(_download, fs, path, local, record, committed.manifest.checksum, options.part_size, url, name, encoding, what=f"Reading {name!r}"))
    return jobs


def _ranged_download_jobs(
    fs: AbstractFileSystem, committed: Committed, options: RemoteOptions, url: str, into: str
) -> dict[str, tuple[list[Callable[[], None]], Callable[[], None]]]:
    """S3, plain files of more than one part: {file: (range jobs, check)}. Each range job fetches
    one part-sized range and writes it at its offset (one part in memory per range in flight), so
    the ranges of all files download in parallel; ``check``, run after every range landed, hashes
    the file in order against the manifest. Compressed objects (one zstd frame) stream in order
    instead (``_download``)."""
    if not hasattr(fs, "call_s3"):
        return {}
    part = options.part_size
    found: dict[str, tuple[list[Callable[[], None]], Callable[[], None]]] = {}
    for name, record in committed.manifest.files.items():
        path, encoding = committed.object_of(name)
        if encoding is not None or record.size <= part:
            continue
        local = os.path.join(into, name)
        with open(local, "wb") as f:
            f.truncate(record.size)

        def fetch_range(path: str = path, local: str = local, start: int = 0, end: int = 0) -> None:
            data = fs.cat_file(path, start=start, end=end)
            fd = os.open(local, os.O_WRONLY)
            try:
                view, offset = memoryview(data), start
                while view:
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
            finally:
                os.close(fd)

        ranges = [
            _job(fetch_range, path, local, start, min(start + part, record.size), what=f"Reading {name!r} at {start}")
            for start in range(0, record.size, part)
        ]

        def check(local: str = local, record: fmt.FileRecord = record, name: str = name, path: str = path) -> None:
            digest = fmt.hasher(committed.manifest.checksum)
            size = 0
            with open(local, "rb", buffering=0) as f:
                while chunk := f.read(_PIECE):
                    digest.update(chunk)
                    size += len(chunk)
            _check_object(url, name, path, size, digest.hexdigest(), record, committed.manifest.checksum)

        found[name] = (ranges, check)
    return found


def listing(url: str, depth: int, options: RemoteOptions) -> list[str]:
    """URLs of the entries under the folder ``url``, down to ``depth`` folders below it (remote
    checkpoints are entries, not descended into); ``[]`` when there is no such folder."""
    fs, root = options.filesystem(url)
    protocol = url.split("://", 1)[0]
    found: list[str] = []
    folders = [root.rstrip("/")]
    for level in range(depth + 1):
        below = []
        for folder in folders:
            for name in _listing(fs, folder):
                path = f"{folder}/{name}"
                found.append(f"{protocol}://{path}")
                if level < depth and CURRENT_FILE not in (children := _listing(fs, path)) and children:
                    below.append(path)
        folders = below
    return sorted(found)


def exists(url: str, options: RemoteOptions) -> bool:
    """Whether a committed checkpoint is at ``url``."""
    fs, root = options.filesystem(url)
    return read_pointer(fs, root, url) is not None


def remove(url: str, options: RemoteOptions) -> None:
    """Remove the remote checkpoint at ``url``: ``CURRENT`` first (it stops being loadable at
    once), then its generations. Refuses a folder that is not a remote checkpoint of ours."""
    fs, root = options.filesystem(url)
    children = _listing(fs, root)
    if not children:
        return
    if not _holds_only_ours(children):
        raise CheckpointError(
            f"Refusing to remove {url!r}: it holds objects other than {CURRENT_FILE} and generations, so it is not a"
            " lightning_ckpt remote checkpoint. Remove it by hand if it should go.",
            url,
        )
    if CURRENT_FILE in children:
        fs.rm_file(f"{root}/{CURRENT_FILE}")
    fs.rm(root, recursive=True)


# ----------------------------------------------------------------------------------------------
# The local tier: a copy of each remote checkpoint on local disk.


def spool_target(root: str | None = None) -> tuple[str, str]:
    """(the local checkpoint directory, the private temporary folder holding it) that a save is
    committed in before it is uploaded, or a load downloads into, without a local tier; under
    ``root``, default the temporary folder."""
    spool = tempfile.mkdtemp(prefix=".lightning_ckpt-spool-", dir=root)
    return os.path.join(spool, "checkpoint"), spool


@contextlib.contextmanager
def spool_removed_on_failure(spool: str | None) -> Iterator[None]:
    """Remove ``spool`` (if any) when the block fails: what it held goes nowhere."""
    try:
        yield
    except BaseException:
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
        raise


_SHARED_MEMORY = "/dev/shm"


def _download_root(nbytes: int) -> str | None:
    """Where a load without a local tier downloads: shared memory when it has room for the
    checkpoint (twice over, so the download cannot starve it), so the objects land straight in
    the pages the loaded tensors map and never touch a disk; else the temporary folder."""
    try:
        free = os.statvfs(_SHARED_MEMORY)
    except OSError:
        return None
    return _SHARED_MEMORY if free.f_bavail * free.f_frsize > 2 * nbytes else None


def published_marker(local: str) -> str:
    """The file beside a local-tier checkpoint that records the remote generation it was published as."""
    folder, name = os.path.split(local)
    return os.path.join(folder, f".{name}.lckpt-published")


def mark_published(local: str, published: Published) -> None:
    """Record that ``local`` is ``published``, unless a newer save replaced it meanwhile."""
    try:
        with open(os.path.join(local, fmt.MANIFEST_FILE), "rb") as f:
            if fmt.digest(f.read()) != published.manifest_digest:
                return  # a newer checkpoint is there now, not uploaded yet
    except FileNotFoundError:
        return
    with open(published_marker(local), "w") as f:
        json.dump({"url": published.url, "generation": published.generation}, f)


def prune_local_tier(local: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` published checkpoints in ``local``'s folder; never one that is not
    published yet (it may be the only copy). Returns what was removed."""
    from lightning_ckpt import writer

    folder = os.path.dirname(local)
    published = []
    for entry in os.scandir(folder):
        if entry.is_dir() and not entry.name.startswith(".") and os.path.exists(published_marker(entry.path)):
            published.append((entry.stat().st_mtime, entry.path))
    published.sort(reverse=True)
    removed = []
    for _, path in published[keep:]:
        writer.remove_checkpoint(path)
        os.unlink(published_marker(path))
        removed.append(path)
    return removed


def publish_committed(
    local: str, url: str, options: RemoteOptions, spool: str | None, copies: ServerCopies | None = None
) -> Published:
    """Publish the locally committed checkpoint ``local`` to ``url``; then remove ``spool`` (the
    temporary folder it was committed in), or, in the local tier, mark it published and prune."""
    try:
        published = publish(local, url, options, copies)
    finally:
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
    if spool is None:
        mark_published(local, published)
        prune_local_tier(local, options.local_keep)
    return published


def remove_everywhere(url: str, options: RemoteOptions) -> None:
    """Remove the remote checkpoint at ``url`` and its local-tier copy."""
    remove(url, options)
    if options.local_dir is not None:
        remove_local_copy(options.local_path(url))


def remove_local_copy(local: str) -> None:
    from lightning_ckpt import writer

    writer.remove_checkpoint(local)
    try:
        os.unlink(published_marker(local))
    except FileNotFoundError:
        pass


def local_copy_for_load(url: str, options: RemoteOptions) -> tuple[str, Callable[[], None]]:
    """A committed local directory holding ``url``'s checkpoint, and what to call once it is loaded.

    With a local tier: its copy when it is the remote's committed generation, or newer than the
    remote (a save whose upload had not finished); else the remote one is downloaded into the
    tier. Without: the remote one is downloaded into a temporary folder, in shared memory when it
    has room, removed after loading (loaded tensors map its files; unlinking them keeps the mapped
    data valid, and the memory is freed with the tensors).
    """
    if options.local_dir is None:
        local, spool = spool_target(_download_root(read_committed(url, options).manifest.total_bytes))
        with spool_removed_on_failure(spool):
            fetch(url, options, local)
        return local, lambda: shutil.rmtree(spool, ignore_errors=True)
    local = options.local_path(url)
    if _local_copy_is_current(local, url, options):
        return local, lambda: None
    try:
        os.unlink(published_marker(local))
    except FileNotFoundError:
        pass
    fetch(url, options, local)
    return local, lambda: None


def _local_copy_is_current(local: str, url: str, options: RemoteOptions) -> bool:
    from lightning_ckpt import reader

    if not os.path.exists(os.path.join(local, fmt.MANIFEST_FILE)):
        return False
    fs, root = options.filesystem(url)
    pointer = read_pointer(fs, root, url)
    if pointer is None:
        return True  # never published (the upload was interrupted): the local copy is the newest
    try:
        with open(published_marker(local)) as f:
            if json.load(f).get("generation") == pointer["generation"]:
                return True
    except (OSError, ValueError):
        pass
    remote = read_committed(url, options).manifest
    mine = reader.read_manifest(local)
    # Not the published one: the newer of the two (a local save whose upload did not finish, or
    # a remote one written elsewhere); on a tie the remote, which is committed where it matters.
    return (mine.global_step or -1, mine.epoch or -1) > (remote.global_step or -1, remote.epoch or -1)


class Uploader:
    """Publishes (and removes) local-tier checkpoints on one background thread, in order, so a
    synchronous save returns once it is committed on local disk.

    A removal queued after a publish that failed is skipped (with a warning): the checkpoint it
    would remove may now be the newest one on the remote.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[str, Callable[[], Published | None]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._last_publish_failed = False
        self.errors: list[BaseException] = []
        self.results: list[Published] = []

    def publish(self, job: Callable[[], Published]) -> None:
        self._put("publish", job)

    def remove(self, url: str, job: Callable[[], None]) -> None:
        def remove_unless_replacement_failed() -> None:
            if self._last_publish_failed:
                warnings.warn(f"Kept {url!r}: the save that would have replaced it failed to upload.", stacklevel=1)
                return
            job()

        self._put("remove", remove_unless_replacement_failed)

    def _put(self, kind: str, job: Callable[[], Published | None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="lightning_ckpt-upload", daemon=True)
            self._thread.start()
        self._jobs.put((kind, job))

    def _run(self) -> None:
        while True:
            kind, job = self._jobs.get()
            try:
                result = job()
                if kind == "publish":
                    self._last_publish_failed = False
                    if result is not None:
                        self.results.append(result)
            except BaseException as err:  # raised in the training thread at the next save or wait
                if kind == "publish":
                    self._last_publish_failed = True
                self.errors.append(err)
            finally:
                self._jobs.task_done()

    @property
    def busy(self) -> bool:
        return self._jobs.unfinished_tasks > 0

    def wait(self) -> None:
        """Block until every queued upload and removal has ended."""
        self._jobs.join()

    def take_errors(self) -> list[BaseException]:
        errors, self.errors = self.errors, []
        return errors
