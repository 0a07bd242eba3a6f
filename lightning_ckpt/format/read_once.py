"""One checkpoint loaded by many ranks, each byte read from storage once.

Every rank of a DDP run loads the same replicated checkpoint. On one node the page cache shares
those reads; across nodes on shared storage each node would read all of it. Here the shard files
are spread over the ranks by bytes (``spread``, the same greedy assignment on every rank, so they
agree without talking), each rank reads and hashes its own files (``read_file``: large sequential
reads, ``O_DIRECT`` where the filesystem takes it), the ranks agree on success in one
``all_gather_object`` (a damaged file is named on every rank, none waits on a broadcast that never
comes), and each file is broadcast from its reader over the process group (``broadcast_file``:
through the device in blocks where the backend needs one, NCCL). Before that, one more
``all_gather_object`` makes sure every rank opened the same checkpoint (the same manifest).
Every failure is raised alike on every rank (``_raise_agreed``), so no rank is left in a
collective the others left.

Every rank of ``group`` must call :func:`load_read_once` together (Lightning's restore does).
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_ckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from lightning_ckpt.format import digests
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.reader import (
    MapLocation,
    OpenedDir,
    Tensors,
    checked_tree,
    decode,
    is_committed,
    opened_all,
    shard_names,
    shard_of,
)

_PAGE = mmap.PAGESIZE
_BLOCK = 64 * 2**20  # bytes per broadcast (and per device bounce buffer under NCCL)
_READ_THREADS = 4  # own files read at once


@dataclass(frozen=True)
class ReadOnce:
    """What one rank's read-once load did: the bytes it read from storage, of the checkpoint's total."""

    bytes_read: int
    total_bytes: int
    files_read: int


def spread(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """File name -> the rank that reads it: largest first, each to the least-loaded rank (lowest
    rank on ties). Deterministic in ``sizes`` alone, so every rank computes the same assignment."""
    load = [0] * world_size
    owners: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners


def _buffer(size: int) -> mmap.mmap:
    """Anonymous, page-aligned memory for a whole file (rounded up to pages, as ``O_DIRECT``
    reads need): its pages are allocated as they are written, never zero-filled up front."""
    return mmap.mmap(-1, max(_PAGE, -(-size // _PAGE) * _PAGE))


def read_file(directory: OpenedDir, name: str, size: int, algorithm: str | None) -> tuple[mmap.mmap, str | None]:
    """File ``name`` (``size`` bytes, as the manifest says) read whole into fresh memory, hashed
    with ``algorithm`` block by block as it arrives (``None``: not hashed); (buffer, digest).

    Short reads continue where they stopped, a read interrupted by a signal is retried, and a
    filesystem that opens with ``O_DIRECT`` but refuses its reads (``EINVAL``) is read buffered
    from where it stopped. A file that ends before ``size`` is named as truncated.
    """
    path = directory.path
    buffer = _buffer(size)
    view = memoryview(buffer)
    running = None if algorithm is None else fmt.hasher(algorithm)
    fd, direct = directory.open_direct(name)
    done = hashed = 0
    try:
        while done < size:
            want = min(digests.CHUNK, len(buffer) - done)  # whole pages: O_DIRECT's alignment
            try:
                n = os.preadv(fd, [view[done : done + want]], done)
            except InterruptedError:
                continue
            except OSError as err:
                if not direct or err.errno != errno.EINVAL:  # the filesystem refuses O_DIRECT reads
                    raise
                os.close(fd)
                fd = -1  # closed: never closed again below, whatever the reopen does
                fd, direct = directory.open(name), False
                continue
            if n == 0:
                raise CorruptCheckpointError(
                    f"{path!r}: file {name!r} ended after {done} of its {size} bytes while it was read; it is"
                    " truncated. Resume from another checkpoint.",
                    path,
                    name,
                )
            done += n
            if running is not None:  # hashed as it arrives, while the block is in the CPU's caches
                running.update(view[hashed : min(done, size)])
            hashed = min(done, size)
    except BaseException:
        view.release()
        buffer.close()
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    view.release()
    return buffer, None if running is None else running.hexdigest()


def broadcast_file(buffer: mmap.mmap, size: int, src: int, group: Any) -> None:
    """Every rank's ``buffer`` holds the first ``size`` bytes of rank ``src``'s (a rank of
    ``group``) after this, sent in blocks; through a reused device buffer when the backend carries
    device tensors only (NCCL)."""
    data = torch.frombuffer(buffer, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)
    device = _collective_device(group)
    bounce = None if device.type == "cpu" else torch.empty(min(size, _BLOCK), dtype=torch.uint8, device=device)
    mine = dist.get_rank(group) == src
    source = src if group is None else dist.get_global_rank(group, src)  # broadcast takes global ranks
    for start in range(0, size, _BLOCK):
        block = data[start : start + _BLOCK]
        if bounce is None:
            dist.broadcast(block, src=source, group=group)
            continue
        staged = bounce[: block.numel()]
        if mine:
            staged.copy_(block)
        dist.broadcast(staged, src=source, group=group)
        if not mine:
            block.copy_(staged)


def _collective_device(group: Any) -> torch.device:
    """Where the tensors of ``group``'s collectives must live: the current CUDA device under NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gathered(value: Any, group: Any) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def _said(failure: BaseException | None) -> tuple[str, str, str | None] | None:
    return None if failure is None else (type(failure).__name__, str(failure), getattr(failure, "file", None))


def _raise_agreed(path: str, everyone: list[Any], failure: BaseException | None) -> None:
    """Raise on every rank the same error, the lowest failing rank's (``everyone``: each rank's
    ``_said``), as its type where it is one a resume falls back on (a damaged or missing
    checkpoint: every rank then moves to the same older one), else as a ``CheckpointError``: no
    rank goes on to a collective the others left."""
    failing = [(rank, said) for rank, said in enumerate(everyone) if said is not None]
    if not failing:
        return
    rank, (kind, message, file) = failing[0]
    agreed: CheckpointError
    if kind == CorruptCheckpointError.__name__:
        agreed = CorruptCheckpointError(message, path, file)
    elif kind == CheckpointNotFoundError.__name__:
        agreed = CheckpointNotFoundError(message, path)
    else:
        agreed = CheckpointError(f"rank {rank} could not read its share of {path!r}: {kind}: {message}", path)
    raise agreed from failure


def load_read_once(
    path: str,
    map_location: MapLocation,
    weights_only: bool | None,
    verify: bool,
    group: Any = None,
) -> tuple[dict[Any, Any], ReadOnce] | None:
    """Load the checkpoint directory ``path`` on every rank of ``group`` (the default group when
    ``None``), each shard file read from storage by one rank and broadcast; the dict, and what
    this rank read. ``verify``: each reader hashes its files as it reads them. ``None`` when no
    rank finds a committed checkpoint directory of ours there (a legacy file, a DCP folder,
    nothing): every rank then loads it the ordinary way.

    The ranks first agree that they opened the same checkpoint (the same manifest): one replaced
    meanwhile (``last.ckpt``'s atomic exchange) is opened again by every rank.
    """
    for _ in range(_ATTEMPTS):
        opened = _open_agreed(path, verify, group)
        if opened is None:
            return None
        if opened is _AGAIN:
            continue
        directory, manifest, tree, small_bytes = opened
        try:
            return _load_agreed(directory, manifest, tree, small_bytes, map_location, weights_only, verify, group)
        finally:
            directory.__exit__()
    raise CheckpointError(
        f"{path!r} was replaced {_ATTEMPTS} times while the ranks opened it (another job saving there?); the ranks"
        " could not agree on one checkpoint to load.",
        path,
    )


_AGAIN: Any = object()  # the ranks opened different checkpoints at the path: open it again
_ATTEMPTS = 20


def _open_agreed(path: str, verify: bool, group: Any) -> Any:
    """(directory, manifest, tree, small bytes) opened alike on every rank; ``None`` when no rank
    sees a checkpoint of ours; ``_AGAIN`` when they saw different ones. One collective."""
    directory: OpenedDir | None = None
    key = failure = None
    opened: Any = None
    if is_committed(path):
        try:
            directory = OpenedDir(path)
            manifest, tree, small_bytes = checked_tree(directory, verify)
            opened = (directory, manifest, tree, small_bytes)
            key = fmt.digest(manifest.to_bytes())
        except BaseException as err:  # agreed on below, then raised
            failure = err
    everyone = _gathered((key, _said(failure)), group)
    keys = {k for k, _ in everyone}
    outcome, keep = opened, False
    try:
        _raise_agreed(path, [said for _, said in everyone], failure)
        if keys == {None}:
            outcome = None
        elif None in keys:
            seen = [rank for rank, (k, _) in enumerate(everyone) if k is not None]
            raise CheckpointError(
                f"{path!r} is a checkpoint for ranks {seen} only; the others see none there. Every rank must see the"
                " same checkpoint folder (a filesystem shared by every node), or pass"
                " `ShardedCheckpointIO(read_once=False)`.",
                path,
            )
        elif len(keys) > 1:
            outcome = _AGAIN
        keep = outcome is opened
    finally:
        if not keep and directory is not None:  # raised, or not to be read: closed here
            directory.__exit__()
    return outcome


def _load_agreed(
    directory: OpenedDir,
    manifest: fmt.Manifest,
    tree: Any,
    small_bytes: int,
    map_location: MapLocation,
    weights_only: bool | None,
    verify: bool,
    group: Any,
) -> tuple[dict[Any, Any], ReadOnce]:
    """Read this rank's share, agree on it (one collective), broadcast every file, decode."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    shard_files = [n for n in manifest.files if n in shard_names(manifest)]
    owners = spread({n: manifest.files[n].size for n in shard_files}, world_size)
    mine = [n for n in shard_files if owners[n] == rank]
    buffers: dict[str, mmap.mmap] = {}
    failure: BaseException | None = None
    try:
        buffers.update(_read_own(directory, manifest, mine, verify))
    except BaseException as err:  # agreed on below, then raised
        failure = err
    _raise_agreed(directory.path, _gathered(_said(failure), group), failure)
    try:
        for name in shard_files:
            if name not in buffers:
                buffers[name] = _buffer(manifest.files[name].size)
            broadcast_file(buffers[name], manifest.files[name].size, owners[name], group)
        shards = {name: shard_of(directory, name, buffers[name], manifest.files[name].size) for name in shard_files}
        tensors = Tensors(directory, manifest, map_location, shards, verify_each=False)
        checkpoint = decode(directory, manifest, tree, tensors.tensor, map_location, weights_only)
    except BaseException:
        buffers.clear()  # the error may be kept (a resume falling back): not the checkpoint's bytes with it
        raise
    read = small_bytes + sum(manifest.files[n].size for n in mine)
    return checkpoint, ReadOnce(read, manifest.total_bytes, len(mine))


def _read_own(directory: OpenedDir, manifest: fmt.Manifest, names: list[str], verify: bool) -> dict[str, mmap.mmap]:
    """This rank's files, read (and with ``verify`` checked against the manifest) a few at once:
    all of them, or none and the first failure raised."""
    algorithm = manifest.checksum if verify else None

    def read(name: str) -> mmap.mmap:
        record = manifest.files[name]
        buffer, found = read_file(directory, name, record.size, algorithm)
        if found is not None:
            try:
                digests.check_digest(directory.path, name, manifest.checksum, record.digest, found)
            except BaseException:
                buffer.close()
                raise
        return buffer

    return opened_all(names, read, lambda buffer: buffer.close(), _READ_THREADS, "lightning_ckpt-read")
