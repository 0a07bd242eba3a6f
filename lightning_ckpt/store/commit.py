"""A checkpoint directory and its commit: the shards (``shards.ShardWriter`` writes their bytes),
``metadata.json``, the model index and ``manifest.json`` in a locked temporary directory, then
the atomic rename; removal, links and the clean-up of crashed saves.

Commit protocol (a crash at any point leaves the old checkpoint or the new one, never a mix):

1. take an ``flock`` on ``.<name>.lckpt-tmp-<token>.lock`` beside the target, then create the
   temporary directory ``.<name>.lckpt-tmp-<token>`` next to it (same filesystem);
2. write every shard, ``metadata.json``, the model index, fsync each file; ``manifest.json`` last;
3. fsync the temporary directory, then move it into place: ``renameat2(RENAME_NOREPLACE)`` when
   the target is new, ``renameat2(RENAME_EXCHANGE)`` when it exists (the old checkpoint stays
   complete at the target until this instant), fsync the parent, then delete the old one;
4. remove the lock file.

A temporary directory whose lock file is not held by a live process is stale and is removed by
the next save into the same folder. Nothing here imports Lightning.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightning_ckpt.errors import CheckpointError, CheckpointWriteError
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.plan import Blob, Plan, dtype_name
from lightning_ckpt.store.reuse import Reused, StoredFile, place_all, stored_files
from lightning_ckpt.store.shards import ShardWriter, fsync_dir, write_small

TMP_MARKER = ".lckpt-tmp-"
PART_MARKER = ".lckpt-part-"  # the shared folder of a multi-rank save (see ``parts``)


class ImageSource(Protocol):
    """Where the async path's shard file images are (see ``staging``).

    ``image`` may block until the shard is staged (a pool smaller than the state is refilled as
    the writer goes); ``written`` tells that the shard's region may be reused.
    """

    def image(self, filename: str) -> tuple[mmap.mmap, int, int]: ...

    def written(self, filename: str) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteResult:
    """What a save committed (built by keyword)."""

    path: str
    nbytes: int  # bytes of the checkpoint, all files (written or reused)
    seconds: float  # until durable (committed and fsynced)
    files: int
    direct_io: bool
    reused_bytes: int = 0  # of ``nbytes``, in shard files reused from an earlier checkpoint
    stored: tuple[StoredFile, ...] = ()  # the shard files as committed (see ``incremental.Tracker``)


# ----------------------------------------------------------------------------------------------
# Atomic commit

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc: Any = None


_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """``renameat2``; False when the kernel or filesystem does not support ``flags``.

    Called through ``syscall`` where the number is known, so an old glibc without the wrapper
    (before 2.28) still gets the atomic exchange.
    """
    global _libc
    if _libc is None:
        # The libc already loaded into this process: ``find_library`` would spawn ``ldconfig``.
        _libc = ctypes.CDLL(None, use_errno=True)
    number = _SYS_RENAMEAT2.get(os.uname().machine)
    args = (_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if number is not None:
        result = _libc.syscall(number, *args)
    elif getattr(_libc, "renameat2", None) is not None:
        result = _libc.renameat2(*args)
    else:
        return False
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), dst)


class CommittedError(OSError):
    """The new checkpoint is in place, but a step after the rename (the parent fsync) failed."""


def commit(tmp: str, target: str) -> None:
    """Atomically move the finished directory ``tmp`` to ``target``, replacing what is there.

    Raises ``CommittedError`` if the rename happened and a later step failed; any other error
    means ``target`` is as it was.
    """
    parent = os.path.dirname(target) or "."
    replaced = None
    if os.path.lexists(target):
        if _renameat2(tmp, target, _RENAME_EXCHANGE):
            replaced = tmp
        else:
            # No RENAME_EXCHANGE here: the old checkpoint is moved aside (still complete; if we
            # die now, the next save's cleanup moves it back) and the new one renamed into place.
            replaced = tmp + ".old"
            os.rename(target, replaced)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(replaced, target)  # put the old checkpoint back
                raise
    elif not _renameat2(tmp, target, _RENAME_NOREPLACE):
        os.rename(tmp, target)
    try:
        fsync_dir(parent)
    except OSError as err:
        raise CommittedError(err.errno, f"committed, but fsync of {parent!r} failed: {err.strerror}") from err
    # Committed. Failing to delete the replaced checkpoint must not fail the save: it sits under
    # a hidden temporary name that the next save into this folder removes.
    if replaced is not None:
        try:
            remove_tree(replaced)
        except OSError:
            pass


def remove_tree(path: str) -> None:
    """Remove a file or tree; another process removing the same stale leftover is not an error."""

    def ignore_missing(func: Any, name: str, exc_info: Any) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):
            raise exc_info[1]

    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, onerror=ignore_missing)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


class TempDir:
    """The locked temporary directory a save writes into (see the module docstring)."""

    def __init__(self, target: str, make_dir: bool = True) -> None:
        parent, name = os.path.split(target)
        self.parent = parent or "."
        while True:
            self.path = os.path.join(self.parent, f".{name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")
            self.lock_path = self.path + ".lock"
            try:
                self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            # A cleaner may have removed the file between open and flock: then retry.
            if os.path.exists(self.lock_path) and os.fstat(self._lock_fd).st_ino == os.stat(self.lock_path).st_ino:
                break
            os.close(self._lock_fd)
        if make_dir:
            os.mkdir(self.path)

    def release(self, remove: bool) -> None:
        if remove:
            remove_tree(self.path)
            _restore_or_remove_aside(self.path + ".old")
        try:
            os.unlink(self.lock_path)
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)


def _target_of(temporary: str) -> str:
    """``.<name>.lckpt-tmp-<pid>-<token>[.old|-removing]`` -> ``<name>`` in the same folder."""
    folder, name = os.path.split(temporary)
    return os.path.join(folder, name[1:].split(TMP_MARKER, 1)[0])


def _restore_or_remove_aside(aside: str) -> None:
    """A checkpoint moved aside by the two-rename fallback: put it back if its name is free."""
    if not os.path.lexists(aside):
        return
    target = _target_of(aside)
    if not os.path.lexists(target) and os.path.exists(os.path.join(aside, fmt.MANIFEST_FILE)):
        os.rename(aside, target)
    else:
        remove_tree(aside)


def clean_stale(folder: str) -> list[str]:
    """Remove temporary directories in ``folder`` left by crashed saves; never one still in use."""
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if TMP_MARKER not in name or not name.startswith(".") or name.endswith(".lock"):
            continue
        path = os.path.join(folder, name)
        lock_path = (path[: -len(".old")] if name.endswith(".old") else path) + ".lock"
        try:
            with _held_lock(lock_path) as held:
                if held is False:
                    continue  # a live save holds it
                # Holding the lock (or there is none): no writer can be using this name.
                if name.endswith(".old"):
                    _restore_or_remove_aside(path)
                else:
                    remove_tree(path)
                if held:
                    remove_tree(lock_path)
            removed.append(path)
        except OSError:
            continue  # best effort (e.g. another user's leftovers): never fail a save over it
    # Lock files whose directory is gone and whose holder died.
    for name in names:
        if TMP_MARKER in name and name.endswith(".lock"):
            lock_path = os.path.join(folder, name)
            if os.path.exists(lock_path[: -len(".lock")]):
                continue
            try:
                with _held_lock(lock_path) as held:
                    if held:
                        remove_tree(lock_path)
            except OSError:
                continue
    return removed


@contextlib.contextmanager
def _held_lock(lock_path: str) -> Iterator[bool | None]:
    """Try to take ``lock_path``: True (taken), False (held by a live process), None (no file)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def write_checkpoint(
    plan: Plan,
    target: str | os.PathLike[str],
    shard_writer: ShardWriter,
    *,
    metadata: bytes,
    created_by: dict[str, str],
    global_step: int | None = None,
    epoch: int | None = None,
    images: ImageSource | None = None,
    reuse: dict[str, Reused] | None = None,
) -> WriteResult:
    """Write ``plan`` as a committed checkpoint directory at ``target`` (see the commit protocol).

    Shard bytes come from the plan's tensors, or, with ``images``, from shard file images staged
    in shared memory (the async path); ``reuse``: see ``write_shards``. Multi-rank: ``parts``.
    """
    start = time.perf_counter()
    target, parent = prepare_target(target, replaces=True)
    tmp = None
    try:
        tmp = TempDir(target)
        direct = shard_writer.use_direct(parent)  # probed once per folder
        files, reused = write_shards(plan, tmp.path, shard_writer, direct, images, reuse)
        stored, file_of_blob = stored_files(tmp.path, files, plan), plan.file_of_blob()
        model_blobs = [(b, s.filename) for s in plan.shards if s.component == "model" for b in s.blobs]
        files.update(write_small_files(tmp.path, metadata, model_blobs))
        manifest = fmt.Manifest(
            files=files,
            components={c: [s.filename for s in plan.shards if s.component == c] for c in plan.components},
            tensors=[
                fmt.TensorRecord(
                    component=t.component,
                    path=[k if type(k) in (str, int) else repr(k) for k in t.path],
                    file=file_of_blob[(t.component, t.blob)],
                    blob=t.blob,
                    dtype=dtype_name(t.dtype),
                    shape=list(t.shape),
                    device=t.device,
                    byte_offset=t.byte_offset,
                    stride=None if t.stride is None else list(t.stride),
                    requires_grad=t.requires_grad,
                    parameter=t.parameter,
                )
                for t in plan.tensors
            ],
            created_by=created_by,
            global_step=global_step,
            epoch=epoch,
            model_index_file=fmt.MODEL_INDEX_FILE if model_blobs else None,
        )
        data = manifest.to_bytes()
        write_small(os.path.join(tmp.path, fmt.MANIFEST_FILE), data)
        fsync_dir(tmp.path)
        commit(tmp.path, target)
    except BaseException as err:
        if tmp is not None:
            tmp.release(remove=True)
        error = write_error(err, target)
        if error is None:
            raise
        raise error from err
    tmp.release(remove=False)
    total, reused_bytes = manifest.total_bytes + len(data), sum(files[name].size for name in reused)
    seconds = time.perf_counter() - start
    return WriteResult(
        path=target, nbytes=total, seconds=seconds, files=len(files) + 1, direct_io=direct, reused_bytes=reused_bytes, stored=stored
    )


def unwritable(folder: str | os.PathLike[str]) -> str | None:
    """Why checkpoints cannot be saved under the local ``folder`` (a file in its way, a read-only or
    unwritable folder), or ``None``: a probe folder is made and removed in ``folder``, or in its
    nearest existing parent when it does not exist yet (``folder`` itself is not created: the first
    save does that). A probe left by a crash is a crashed save's leftover: the next save cleans it."""
    folder = os.path.abspath(os.fspath(folder))
    existing = folder
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", existing)
        probe = os.path.join(existing, f"{TMP_MARKER}probe-{secrets.token_hex(4)}")
        os.mkdir(probe)
        with contextlib.suppress(FileNotFoundError):  # a concurrent save's ``clean_stale`` removed it
            os.rmdir(probe)
    except OSError as err:
        reason = f"[Errno {err.errno}] {err.strerror} ({existing!r})"
        return f"Checkpoints cannot be saved in {folder!r}: {reason}.{_FIXES.get(err.errno, _NOT_WRITABLE)}"
    return None


def prepare_target(target: str | os.PathLike[str], replaces: bool) -> tuple[str, str]:
    """(absolute target, its folder), the folder created. With ``replaces`` (the process that
    commits): refuse to replace a directory that is not a checkpoint, and clean crashed saves."""
    target = os.path.abspath(os.fspath(target))
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise CheckpointWriteError(f"Cannot create the folder {parent!r} for checkpoint {target!r}: {err}", target) from err
    if not replaces:
        return target, parent
    if os.path.isdir(target) and not os.path.exists(os.path.join(target, fmt.MANIFEST_FILE)) and os.listdir(target):
        raise CheckpointWriteError(
            f"{target!r} is a non-empty directory that is not a lightning_ckpt checkpoint; refusing to replace it."
            " Choose another checkpoint path or move that directory away.",
            target,
        )
    clean_stale(parent)
    return target, parent


def write_error(err: BaseException, target: str, writer: str = "Saving checkpoint") -> CheckpointWriteError | None:
    """The ``CheckpointWriteError`` a failed save raises, saying whether anything was committed;
    ``None`` for what is not a write failure (an interrupt), which propagates as it is."""
    if isinstance(err, CommittedError):
        return CheckpointWriteError(f"Checkpoint {target!r} was committed, but its durability is not guaranteed: {err}", target)
    if isinstance(err, (OSError, RuntimeError, ValueError)):
        return CheckpointWriteError(
            f"{writer} {target!r} failed: {_reason(err, target)}. Nothing was committed; any checkpoint previously at"
            f" that path is unchanged.{_FIXES.get(getattr(err, 'errno', None), '')}",
            target,
        )
    return None


_NOT_WRITABLE = " Make that folder writable, or save somewhere else (the callback's `dirpath`)."
_FULL = " Free space on that filesystem (or keep fewer checkpoints, e.g. a lower `save_top_k`), then save again."
_IN_THE_WAY = " Move that file away, or save somewhere else (the callback's `dirpath`)."
_FIXES = {
    errno.ENOTDIR: _IN_THE_WAY,
    errno.EEXIST: _IN_THE_WAY,
    errno.EROFS: _NOT_WRITABLE,
    errno.EACCES: _NOT_WRITABLE,
    errno.EPERM: _NOT_WRITABLE,
    errno.ENOSPC: _FULL,
    errno.EDQUOT: _FULL,
}


def _reason(err: BaseException, target: str) -> str:
    """The error as the user should read it: a file of ours (a shard, the lock or temporary folder
    of the save) stands for the checkpoint's folder, which is what the user chose and can fix."""
    filename = getattr(err, "filename", None)
    if isinstance(err, OSError) and isinstance(filename, str) and _is_internal(filename, target):
        return f"[Errno {err.errno}] {err.strerror} (writing in {os.path.dirname(os.path.abspath(target))!r})"
    return str(err).rstrip(".")


def _is_internal(filename: str, target: str) -> bool:
    """Is ``filename`` a file the save made for ``target`` (its temporary folder, lock, shards)?"""
    return TMP_MARKER in filename or os.path.abspath(filename).startswith(os.path.abspath(target) + os.sep)


def write_shards(
    plan: Plan,
    folder: str,
    shard_writer: ShardWriter,
    direct: bool,
    images: ImageSource | None,
    reuse: dict[str, Reused] | None = None,
) -> tuple[dict[str, fmt.FileRecord], set[str]]:
    """Write every shard of ``plan`` into ``folder`` (fsynced), from ``images`` when staged, but those
    in ``reuse`` (``incremental.place_all``). Returns every file's record, and the names reused."""
    files, reused = place_all(reuse or {}, folder, staged=images is not None)
    if images is None:
        # The filler thread copies device bytes on its own (default) stream, which is not ordered
        # after a training stream of the caller's (``torch.cuda.stream(s)``): the caller's streams
        # finish their queued writes first. A sync save blocks anyway.
        for device in plan.cuda_devices():
            torch.cuda.current_stream(device).synchronize()
    for shard in plan.shards:
        if shard.filename in files:
            continue
        file_path = os.path.join(folder, shard.filename)
        if images is not None:
            buffer, offset, size = images.image(shard.filename)
            files[shard.filename] = shard_writer.write_image(file_path, buffer, offset, size, direct)
            images.written(shard.filename)
        else:
            header, _ = fmt.build_header([(b.name, b.dtype, b.shape, b.nbytes) for b in shard.blobs])
            files[shard.filename] = shard_writer.write_shard(file_path, header, shard.blobs, direct)
    return files, reused


def write_small_files(
    folder: str, metadata: bytes, model_blobs: list[tuple[Blob, str]]
) -> dict[str, fmt.FileRecord]:
    """``metadata.json`` and, when there are model tensors, the Hugging Face style model index."""
    files = {fmt.METADATA_FILE: write_small(os.path.join(folder, fmt.METADATA_FILE), metadata)}
    if model_blobs:
        weight_map = {blob.name: filename for blob, filename in model_blobs}
        index = {
            "metadata": {"total_size": sum(blob.nbytes for blob, _ in model_blobs)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        files[fmt.MODEL_INDEX_FILE] = write_small(
            os.path.join(folder, fmt.MODEL_INDEX_FILE), (json.dumps(index, indent=2) + "\n").encode()
        )
    return files


def remove_checkpoint(path: str) -> None:
    """Remove a checkpoint directory or file at the absolute ``path``.

    A directory is first renamed to a hidden temporary name, so a crash mid-removal never leaves a
    half-deleted checkpoint under its real name. Refuses a directory that is not a checkpoint.
    """
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
    doomed = os.path.join(parent, f".{name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}-removing")
    os.rename(path, doomed)
    clean_stale(parent)  # removes `doomed` (no live lock holds it) and any other leftovers


def link_checkpoint(filepath: str, linkpath: str) -> None:
    """Make ``linkpath`` (absolute) a link to the checkpoint ``filepath``, or a copy where links are
    refused, swapped in atomically: a complete checkpoint is at ``linkpath`` at every instant."""
    temporary = TempDir(linkpath, make_dir=False)  # locked: stale cleanup leaves it alone
    try:
        try:
            os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), temporary.path)
        except OSError:  # no symlinks (Windows without privileges): copy
            (shutil.copytree if os.path.isdir(filepath) else shutil.copy)(filepath, temporary.path)
        commit(temporary.path, linkpath)
    except BaseException:
        temporary.release(remove=True)
        raise
    temporary.release(remove=False)
