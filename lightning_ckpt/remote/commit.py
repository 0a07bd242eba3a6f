"""The commit of a remote checkpoint: generations and the ``CURRENT`` pointer.

Object stores have no rename, so a remote checkpoint is a folder of immutable *generations* and
one small pointer object, ``CURRENT``, that names the committed one::

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

Reading (``read_committed``, ``fetch``, ``verify``) goes through ``CURRENT`` too, and reads again
when a newer save replaced the generation while it was being read.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import secrets
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fsspec.spec import AbstractFileSystem

from lightning_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.reader import OpenedDir, manifest_in, read_consistently
from lightning_ckpt.remote.transfer import (
    ENCODINGS,
    PIECE,
    RemoteOptions,
    check_object,
    download,
    job,
    parallel,
    retried,
    upload,
)
from lightning_ckpt.store import commit as writer


class CopySource(Protocol):
    """Where a publication copies some files from on the server instead of uploading them
    (incremental saves: ``server_copy.ServerCopies``). Called from ``publish``'s upload threads."""

    absent: frozenset[str]  # files with no local copy: copied, or the publication fails
    copied: dict[str, int]  # file -> object bytes copied (so far)

    def copy(self, fs: AbstractFileSystem, name: str, record: fmt.FileRecord, encoding: str | None, target: str) -> int | None:
        """Copy file ``name`` to the object ``target``; its object size, or ``None`` to upload it."""
        ...


CURRENT_FILE = "CURRENT"
POINTER_FORMAT = "lightning_ckpt.pointer"
POINTER_VERSION = 1
_GENERATION = re.compile(r"gen-(\d{13})-[0-9a-f]{8}")
_READS = 4  # reads of a checkpoint replaced by a newer save meanwhile, before it counts as damaged
_PROCESS_STARTED_MS = int(time.time() * 1000)
_cleaned: set[tuple[Any, str]] = set()  # (protocol, folder) already rid of orphans by this process


def new_generation() -> str:
    """A generation name that sorts by creation time: ``gen-<unix ms>-<random>``."""
    return f"gen-{int(time.time() * 1000):013d}-{secrets.token_hex(4)}"


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
    for attempt in range(_READS):
        pointer = read_pointer(fs, root, url)
        if pointer is None:
            raise _not_found(url)
        folder = f"{root}/{pointer['generation']}"
        try:
            data = fs.cat_file(f"{folder}/{fmt.MANIFEST_FILE}")
        except FileNotFoundError:
            if attempt + 1 < _READS and read_pointer(fs, root, url) != pointer:
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


def publish(local: str, url: str, options: RemoteOptions, copies: CopySource | None = None) -> Published:
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

        def upload_file(name: str, record: fmt.FileRecord) -> None:
            encoding = encodings.get(name)
            target = f"{folder}/{name}{ENCODINGS[encoding] if encoding else ''}"
            copied = None if copies is None else copies.copy(fs, name, record, encoding, target)  # incremental
            if copied is None and name not in fds:
                raise FileNotFoundError(f"{name!r}, unchanged since an earlier checkpoint, could not be copied from it")
            size = copied if copied is not None else upload(
                fs, fds[name], os.path.join(local, name), target, record, manifest.checksum, options.part_size, encoding,
                options.compression_level, parts_pool,
            )
            if encoding is not None:
                objects[name] = {"encoding": encoding, "size": size}

        jobs = [
            job(upload_file, name, record, what=f"Uploading {name!r}")
            for name, record in sorted(manifest.files.items(), key=lambda item: -item[1].size)  # largest first
        ]
        # The parts of multipart uploads (S3), all files' on one pool: `concurrency` parts in flight.
        with concurrent.futures.ThreadPoolExecutor(options.concurrency, thread_name_prefix="lightning_ckpt-part") as parts_pool:
            parallel(jobs, options.concurrency)
        pointer = _pointer_bytes(generation, manifest_bytes, dict(sorted(objects.items())))
        retried(lambda: fs.pipe_file(f"{folder}/{fmt.MANIFEST_FILE}", manifest_bytes), "Uploading the manifest")
        committing = True
        retried(lambda: fs.pipe_file(f"{root}/{CURRENT_FILE}", pointer), f"Writing {CURRENT_FILE}")
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


def _open_committed(local: str, absent: frozenset[str]) -> tuple[bytes, fmt.Manifest, dict[str, int]]:
    """The manifest (bytes, parsed) of the committed local checkpoint ``local`` and an open fd of
    each file it lists, all read through one directory fd: one checkpoint, whatever replaces it
    once they are open. Replaced (and removed) while being opened: the newer one is opened."""

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

    fs, root = options.filesystem(url)
    for attempt in range(_READS):
        committed = read_committed(url, options)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = writer.TempDir(dest)
        try:
            ranged = _ranged_download_jobs(fs, committed, options, url, tmp.path)
            ranges = [each for jobs, _ in ranged.values() for each in jobs]
            # Every range and every other object at once, hashed as they arrive; then the digests.
            parallel(ranges + _download_jobs(fs, committed, options, url, tmp.path, skip=set(ranged)), options.concurrency)
            parallel([check for _, check in ranged.values()], options.concurrency)
            with open(os.path.join(tmp.path, fmt.MANIFEST_FILE), "wb") as f:
                f.write(committed.manifest_bytes)
            writer.commit(tmp.path, dest)
        except FileNotFoundError:
            tmp.release(remove=True)
            pointer = read_pointer(fs, root, url)
            if attempt + 1 < _READS and pointer is not None and pointer["generation"] != committed.generation:
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
    for attempt in range(_READS):
        committed = read_committed(url, options)
        try:
            parallel(_download_jobs(fs, committed, options, url, None), options.concurrency)
        except FileNotFoundError as err:
            pointer = read_pointer(fs, root, url)
            if attempt + 1 < _READS and pointer is not None and pointer["generation"] != committed.generation:
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
        jobs.append(job(download, fs, path, local, record, committed.manifest.checksum, options.part_size, url, name, encoding, what=f"Reading {name!r}"))
    return jobs


def _ranged_download_jobs(
    fs: AbstractFileSystem, committed: Committed, options: RemoteOptions, url: str, into: str
) -> dict[str, tuple[list[Callable[[], None]], Callable[[], None]]]:
    """S3, plain files of more than one part: {file: (range jobs, check)}. Each range job fetches
    one part-sized range, writes it at its offset (one part in memory per range in flight) and
    hands it to the file's ``_InOrderDigest``, so the ranges of all files download in parallel and
    are hashed as they arrive; ``check``, run after every range landed, compares the digest with
    the manifest's. Compressed objects (one zstd frame) stream in order instead (``download``)."""
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

        digest = _InOrderDigest(local, committed.manifest.checksum)

        def fetch_range(path: str = path, local: str = local, start: int = 0, end: int = 0, digest: _InOrderDigest = digest) -> None:
            data = fs.cat_file(path, start=start, end=end)
            fd = os.open(local, os.O_WRONLY)
            try:
                view, offset = memoryview(data), start
                while view:
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
            finally:
                os.close(fd)
            digest.landed(start, data)

        ranges = [
            job(fetch_range, path, local, start, min(start + part, record.size), what=f"Reading {name!r} at {start}")
            for start in range(0, record.size, part)
        ]

        def check(record: fmt.FileRecord = record, name: str = name, path: str = path, digest: _InOrderDigest = digest) -> None:
            size, found = digest.result()
            check_object(url, name, path, size, found, record, committed.manifest.checksum)

        found[name] = (ranges, check)
    return found


class _InOrderDigest:
    """A file's digest computed while its ranges land, in any order: a range that extends the
    hashed prefix is hashed from memory at once, and so, read back from the file (just written:
    the page cache), are the ranges that landed beyond it before. Thread-safe."""

    def __init__(self, local: str, algorithm: str) -> None:
        self.local = local
        self.hasher = fmt.hasher(algorithm)
        self.hashed = 0  # bytes [0, hashed) are in the digest
        self.ahead: dict[int, int] = {}  # ranges landed beyond the prefix: start -> end
        self.lock = threading.Lock()

    def landed(self, start: int, data: bytes) -> None:
        """Bytes ``data`` at ``start`` are in the file (a retried range may land again: ignored)."""
        with self.lock:
            if start < self.hashed or start in self.ahead:
                return
            if start > self.hashed:
                self.ahead[start] = start + len(data)
                return
            self.hasher.update(data)
            self.hashed += len(data)
            while self.hashed in self.ahead:
                self._hash_file(self.ahead.pop(self.hashed))

    def _hash_file(self, end: int | None) -> None:
        """Hash the file from the prefix's end up to ``end`` (``None``: its end)."""
        with open(self.local, "rb", buffering=0) as f:
            f.seek(self.hashed)
            while end is None or self.hashed < end:
                chunk = f.read(PIECE if end is None else min(PIECE, end - self.hashed))
                if not chunk:
                    break
                self.hasher.update(chunk)
                self.hashed += len(chunk)

    def result(self) -> tuple[int, str]:
        """(bytes hashed, digest) once every range landed; a gap left hashes the file from there."""
        with self.lock:
            self.ahead.clear()
            self._hash_file(None)
            return self.hashed, self.hasher.hexdigest()


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
