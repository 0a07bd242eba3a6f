"""One checkpoint loaded by many ranks, each byte read from storage once.

Every rank of a DDP run loads the same replicated checkpoint. On one node the page cache shares
those reads; across nodes on shared storage each node would read all of it. Here the shard files
are spread over the ranks by bytes (``spread``, the same greedy assignment on every rank, so they
agree without talking), each rank reads and hashes its own files (``read_file``: large sequential
reads, ``O_DIRECT`` where the filesystem takes it), the ranks agree on success in one
``all_gather_object`` (a damaged file is named on every rank, none waits on a broadcast that never
comes), and each file is broadcast from its reader over the process group (``broadcast_file``:
through the device in blocks where the backend needs one, NCCL).

Every rank of ``group`` must call :func:`load_read_once` together (Lightning's restore does).
"""

from __future__ import annotations

import concurrent.futures
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
    Shard,
    Tensors,
    checked_tree,
    decode,
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


def _open_direct(directory: OpenedDir, name: str) -> tuple[int, bool]:
    """``name`` opened for reading, with ``O_DIRECT`` where the filesystem takes it (tmpfs does
    not: then buffered, reading ahead sequentially); (fd, direct)."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return directory.open(name, os.O_RDONLY | direct), True
        except FileNotFoundError:
            raise
        except OSError:
            pass
    fd = directory.open(name)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd, False


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
    fd, direct = _open_direct(directory, name)
    done = hashed = 0
    try:
        while done < size:
            want = min(digests.CHUNK, len(buffer) - done)  # whole pages: O_DIRECT's alignment
            try:
                n = os.preadv(fd, [view[done : done + want]], done)
            except InterruptedError:
                continue
            except OSError as err:
                if not direct or err.errno != 22:  # EINVAL: the filesystem refuses O_DIRECT reads
                    raise
                os.close(fd)
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
        os.close(fd)
    view.release()
    return buffer, None if running is None else running.hexdigest()


def broadcast_file(buffer: mmap.mmap, size: int, src: int, group: Any) -> None:
    """Every rank's ``buffer`` holds rank ``src``'s first ``size`` bytes after this, sent in
    blocks; through a reused device buffer when the backend carries device tensors only (NCCL)."""
    data = torch.frombuffer(buffer, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)
    device = _collective_device(group)
    bounce = None if device.type == "cpu" else torch.empty(min(size, _BLOCK), dtype=torch.uint8, device=device)
    mine = dist.get_rank() == src
    for start in range(0, size, _BLOCK):
        block = data[start : start + _BLOCK]
        if bounce is None:
            dist.broadcast(block, src=src, group=group)
            continue
        staged = bounce[: block.numel()]
        if mine:
            staged.copy_(block)
        dist.broadcast(staged, src=src, group=group)
        if not mine:
            block.copy_(staged)


def _collective_device(group: Any) -> torch.device:
    """Where the tensors of ``group``'s collectives must live: the current CUDA device under NCCL."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(failure: BaseException | None, group: Any) -> None:
    """One collective: raise on every rank if any rank failed (the first failing rank's error, as
    its type with its message and file where it is ours), so no rank waits on a broadcast from a
    rank that stopped."""
    said = None if failure is None else (type(failure).__name__, str(failure), getattr(failure, "file", None))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, said, group=group)
    if failure is not None:
        raise failure
    for rank, other in enumerate(everyone):
        if other is None:
            continue
        kind, message, file = other
        if kind == CheckpointNotFoundError.__name__:
            raise CheckpointNotFoundError(message)
        if kind == CorruptCheckpointError.__name__:
            raise CorruptCheckpointError(message, None, file)
        raise CheckpointError(f"rank {rank} failed to load its share of the checkpoint: {kind}: {message}")


def load_read_once(
    path: str,
    map_location: MapLocation,
    weights_only: bool | None,
    verify: bool,
    group: Any = None,
) -> tuple[dict[Any, Any], ReadOnce]:
    """Load the checkpoint directory ``path`` on every rank of ``group`` (the default group when
    ``None``), each shard file read from storage by one rank and broadcast; the dict, and what
    this rank read. ``verify``: each reader hashes its files as it reads them."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    buffers: dict[str, mmap.mmap] = {}
    failure: BaseException | None = None
    directory: OpenedDir | None = None
    try:
        directory = OpenedDir(path)
        manifest, tree, small_bytes = checked_tree(directory, verify)
        shard_files = [n for n in manifest.files if n in shard_names(manifest)]
        owners = spread({n: manifest.files[n].size for n in shard_files}, world_size)
        mine = [n for n in shard_files if owners[n] == rank]
        buffers.update(_read_own(directory, manifest, mine, verify))
    except BaseException as err:  # agreed on below, then raised
        failure = err
    try:
        _agree(failure, group)
        assert directory is not None
        for name in shard_files:
            if name not in buffers:
                buffers[name] = _buffer(manifest.files[name].size)
            broadcast_file(buffers[name], manifest.files[name].size, owners[name], group)
        shards: dict[str, Shard] = {name: shard_of(directory, name, buffers[name], manifest.files[name].size) for name in shard_files}
        tensors = Tensors(directory, manifest, map_location, shards, verify_each=False)
        checkpoint = decode(directory, manifest, tree, tensors.tensor, map_location, weights_only)
    finally:
        if directory is not None:
            directory.__exit__()
    read = small_bytes + sum(manifest.files[n].size for n in mine)
    return checkpoint, ReadOnce(read, manifest.total_bytes, len(mine))


def _read_own(directory: OpenedDir, manifest: fmt.Manifest, names: list[str], verify: bool) -> dict[str, mmap.mmap]:
    """This rank's files, read (and with ``verify`` checked against the manifest) a few at once."""
    algorithm = manifest.checksum if verify else None
    read: dict[str, mmap.mmap] = {}
    if not names:
        return read
    workers = max(1, min(len(names), os.cpu_count() or 1, _READ_THREADS))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="lightning_ckpt-read") as pool:
        futures = {n: pool.submit(read_file, directory, n, manifest.files[n].size, algorithm) for n in names}
        failure: BaseException | None = None
        for name in names:  # every future collected: no buffer left behind
            try:
                buffer, found = futures[name].result()
            except BaseException as err:
                failure = failure or err
                continue
            read[name] = buffer
            if found is not None and failure is None:
                try:
                    digests.check_digest(directory.path, name, manifest.checksum, manifest.files[name].digest, found)
                except CorruptCheckpointError as err:
                    failure = err
    if failure is not None:
        for buffer in read.values():
            buffer.close()
        raise failure
    return read
