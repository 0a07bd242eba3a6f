"""Reusing a shard file of an earlier checkpoint in a new one (incremental saves): hard-linked
into the new checkpoint's temporary directory, or copied (asked for, or where the filesystem
refuses links: a reflink where it has them, else ``copy_file_range``), with
its size and digest carried over from the earlier checkpoint's manifest. Every checkpoint stays a
complete directory of ordinary files: removing any other one never breaks it.

Which files may be reused is ``save.changes``'s to decide (``Tracker``); this runs where the
checkpoint is written (the training process or the writer process).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.plan import Plan

# A file as it was: (size, st_dev, st_ino, st_mtime_ns). Links and renames keep it; a rewrite or a
# new file (even one given a recycled inode number) does not.
FileId = tuple[int, int, int, int]


def file_id(path: str) -> FileId | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns


@dataclass(frozen=True, slots=True)
class Reused:
    """A shard file of the new checkpoint taken from an earlier one (picklable, for the writer):
    where it is, and its size, digest and identity when that checkpoint committed.

    ``id`` is ``None`` for a remote save committed in a spool folder: the file is not written at
    all, and publishing copies ``remote`` (the earlier checkpoint's URL and file name) into the
    new generation on the server. A save into the local tier has both: a local file to link, and
    the earlier checkpoint's object to copy instead of uploading the file again.
    """

    sources: tuple[str, ...]  # its path in the earlier checkpoint; then where it lies until that commits
    size: int
    digest: str
    id: FileId | None
    remote: tuple[str, str] | None = None  # (earlier checkpoint's URL, file name there)
    copy: bool = False  # copied, not linked: each checkpoint keeps bytes of its own
    staged: bool = False  # its bytes were staged too: written from them if the earlier file is gone


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A shard file as committed: what ``Tracker.committed`` needs to reuse it later."""

    filename: str
    size: int
    digest: str
    id: FileId | None  # None: not a local file (a remote save's file that stayed on the server)


def stored_files(folder: str, files: Mapping[str, fmt.FileRecord], plan: Plan) -> tuple[StoredFile, ...]:
    """The ``StoredFile`` of each shard file of ``plan`` in ``folder`` (recorded in ``files``)."""
    result = []
    for name in (shard.filename for shard in plan.shards):
        record = files[name]
        result.append(StoredFile(name, record.size, record.digest, file_id(os.path.join(folder, name))))
    return tuple(result)


class ReuseUnavailable(OSError):
    """An earlier checkpoint's file meant for reuse is gone or not what it was."""


def place_reused(reused: Reused, path: str, manifests: dict[str, fmt.Manifest | None]) -> fmt.FileRecord:
    """Put the earlier file ``reused`` at ``path`` (a new checkpoint's temporary directory): a
    hard link, or a copy where the filesystem refuses links. Returns its record, the earlier
    checkpoint's (checked against its manifest where it has one yet; ``manifests`` caches them).
    Raises ``ReuseUnavailable`` when that file is gone or not the one recorded; nothing is left
    at ``path`` then."""
    # Twice round: a multi-rank save's file may move from its part folder into the checkpoint
    # (rank 0's commit renames the folder) between two looks.
    for source in reused.sources * 2:
        if file_id(source) != reused.id:
            continue
        folder, name = os.path.split(source)
        if folder not in manifests:
            try:
                with open(os.path.join(folder, fmt.MANIFEST_FILE), "rb") as f:
                    manifests[folder] = fmt.Manifest.from_bytes(f.read(), where=folder)
            except FileNotFoundError:
                manifests[folder] = None  # a part folder: no manifest until rank 0 commits
            except (OSError, fmt.CorruptCheckpointError, ValueError) as err:
                raise ReuseUnavailable(errno.ESTALE, f"cannot reuse {source!r}: {err}") from err
        manifest, record = manifests[folder], fmt.FileRecord(reused.size, reused.digest)
        listed = None if manifest is None else manifest.files.get(name)
        if manifest is not None and (listed is None or (listed.size, listed.digest) != (record.size, record.digest)):
            raise ReuseUnavailable(errno.ESTALE, f"cannot reuse {source!r}: its manifest records another file")
        if reused.copy:
            _copy(source, path)
            return record
        try:
            os.link(source, path)
        except FileNotFoundError:
            continue  # moved meanwhile
        except OSError as err:
            if err.errno not in _NO_LINK:
                raise ReuseUnavailable(err.errno, f"cannot link {source!r}: {err.strerror}") from err
            _copy(source, path)
        return record
    raise ReuseUnavailable(errno.ENOENT, f"cannot reuse {reused.sources[0]!r}: it is gone or changed since it was written")


def place_all(reuse: Mapping[str, Reused], folder: str, staged: bool) -> tuple[dict[str, fmt.FileRecord], set[str]]:
    """``place_reused`` for each of ``reuse`` (new filename -> earlier file) into ``folder``: the
    records of those placed, and their names. Placed before anything is written, so the earlier
    checkpoint is needed for the shortest time. One that is no longer there is left out (the
    caller writes it from the tensors), unless the save was ``staged`` without it (async): then
    the save fails, nothing is committed, and the next save writes every file."""
    files: dict[str, fmt.FileRecord] = {}
    manifests: dict[str, fmt.Manifest | None] = {}
    for filename, source in reuse.items():
        if source.id is None:  # stays on the server (see ``Reused``): listed, not written
            files[filename] = fmt.FileRecord(source.size, source.digest)
            continue
        try:
            files[filename] = place_reused(source, os.path.join(folder, filename), manifests)
        except ReuseUnavailable as err:
            if staged and not source.staged:
                raise ReuseUnavailable(
                    err.errno, f"{err.strerror}; it was not staged, as it held only unchanged tensors. The next"
                    " save writes every file again"
                ) from err
    return files, set(files)


# Links refused: another filesystem, none supported, too many links to the file.
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


def _copy(source: str, path: str) -> None:
    """Copy ``source`` to ``path`` (a reflink where the filesystem has them, else
    ``copy_file_range``: in the kernel, or on the server) and fsync."""
    try:
        with open(source, "rb") as src, open(path, "xb") as dst:
            if not _reflink(src, dst):
                _copy_range(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
    except OSError as err:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        raise ReuseUnavailable(err.errno or errno.EIO, f"cannot copy {source!r}: {err}") from err


FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def _reflink(src: Any, dst: Any) -> bool:
    """Share ``src``'s extents with the empty ``dst`` (btrfs, xfs, bcachefs): copy-on-write, no
    bytes moved. ``False`` where the filesystem or the platform has no reflinks."""
    try:
        import fcntl

        fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
    except (ImportError, OSError):
        return False
    return True


def _copy_range(src: Any, dst: Any) -> None:
    size = os.fstat(src.fileno()).st_size
    copied = 0
    while copied < size:
        try:
            n = os.copy_file_range(src.fileno(), dst.fileno(), size - copied)
        except (AttributeError, OSError) as err:  # no copy_file_range, or not between these two
            if copied or (isinstance(err, OSError) and err.errno not in _NO_RANGE_COPY):
                raise
            shutil.copyfileobj(src, dst, 16 * 2**20)
            return
        if n == 0:
            raise OSError(errno.EIO, f"copy ended after {copied} of {size} bytes")
        copied += n


_NO_RANGE_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}
