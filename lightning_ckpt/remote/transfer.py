"""Streaming objects up and down: the fsspec filesystem of a URL, codecs, retries.

Every object goes up (``upload``) or down (``download``) in parts of ``part_size``, its file's
digest recomputed on the way and checked against the manifest's record: an upload whose local
file is not what the manifest says is never completed, a download that differs raises
``CorruptCheckpointError`` naming the object. Transient failures are retried here (``retried``),
nothing else is. What the objects mean (generations, ``CURRENT``) is ``commit``'s.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import fsspec
from fsspec.spec import AbstractFileSystem

from lightning_ckpt.errors import (
    CheckpointError,
    CorruptCheckpointError,
    MissingDependencyError,
)
from lightning_ckpt.format import manifest as fmt

DEFAULT_PART_SIZE = 64 * 2**20  # S3 allows 5 MiB to 5 GiB per part and 10,000 parts per object
DEFAULT_CONCURRENCY = 8  # objects uploaded or downloaded at once
_ATTEMPTS = 4  # per object, on top of the client's own retries; backoff 0.5, 1, 2 s
_LOCAL_PROTOCOLS = ("file", "local")
# The extra of this package that installs each protocol's fsspec implementation.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
_T = TypeVar("_T")
ENCODINGS = {"zstd": ".zst"}  # how a file may be stored remotely -> the suffix of its object
PIECE = 4 * 2**20  # bytes read (and compressed, decompressed) at a time
# Client errors that no retry fixes (botocore's names; matched by name, botocore being optional).
_NOT_TRANSIENT = {"NoCredentialsError", "PartialCredentialsError", "NoRegionError", "ParamValidationError", "InvalidConfigError"}


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


def encoder(encoding: str | None, level: int) -> tuple[_Codec, Callable[[], bytes]]:
    """(feed, finish) of a streaming encoder: identity, or one zstd frame with its content checksum."""
    if encoding is None:
        return bytes, lambda: b""
    compressor = zstd_module().ZstdCompressor(level=level, write_checksum=True).compressobj()
    return compressor.compress, compressor.flush


def decoded(source: Any, encoding: str | None, part_size: int) -> Iterator[bytes]:
    """The bytes of an object read from the file object ``source``, decompressed with
    ``encoding``: read a part at a time, and decompressed a piece at a time, so a highly
    compressible part never expands in memory whole."""
    stream = source if encoding is None else zstd_module().ZstdDecompressor().stream_reader(source, read_size=part_size)
    step = part_size if encoding is None else PIECE
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


def upload(
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
    buffer = bytearray(max(1, min(part_size, PIECE, record.size)))
    view = memoryview(buffer)
    feed, finish = encoder(encoding, level)
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
    """``upload`` on S3, driving the multipart upload itself. A plain file's parts are sent as
    streams over the file's range, on ``parts_pool`` (shared by every file of a save, so the parts
    of a few large files fill the connections), while this thread hashes the file in order; the
    upload is completed only if the digest matched. An upload holds a few MiB, not a part
    (s3fs's file object buffers a part, copies it out and lets its buffer grow: ~4 parts
    measured). Compressed, parts go one after the other, one part of compressed bytes held. A
    file that fits one part is one PUT."""
    bucket, key, _ = fs.split_path(remote_file)
    digest = fmt.hasher(algorithm)
    feed, finish = encoder(encoding, level)
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
                    parts_pool.submit(retried, functools.partial(upload_part, number, start), f"Uploading part {number} of {local_file!r}")
                    for number, start in enumerate(range(0, record.size, part_size), 1)
                ]
            try:
                while data := os.pread(fd, PIECE, read):  # to the end: a longer file is caught too
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
                data = os.pread(fd, PIECE, read)
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


def download(
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
            pieces = decoded(source, encoding, part_size)
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
    check_object(url, name, remote_file, size, digest.hexdigest(), record, algorithm)


def check_object(url: str, name: str, remote_file: str, size: int, found: str, record: fmt.FileRecord, algorithm: str) -> None:
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


def retried(action: Callable[[], _T], what: str) -> _T:
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


def parallel(jobs: list[Callable[[], None]], concurrency: int) -> None:
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


def job(function: Callable[..., None], *args: Any, what: str) -> Callable[[], None]:
    """``function(*args)`` as a job for ``parallel``, its transient failures retried."""
    return lambda: retried(lambda: function(*args), what)
