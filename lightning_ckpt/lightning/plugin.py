"""The CheckpointIO plugin: Lightning's contract and option validation over the save pipeline.

Saves are planned by ``savejob`` and run by the savers (``saver.SyncSaver``, ``saver.AsyncSaver``);
loads go through ``functional``/``reader``; see docs/architecture.md.

Call order and ranks (Lightning 2.x): ``save_checkpoint`` and ``remove_checkpoint`` run on global
rank 0 only, so nothing here may run a collective; ``load_checkpoint`` runs on every rank;
``teardown`` runs on every rank at the end of ``fit``/``validate``/``test``/``predict``.
"""

import contextlib
import os
import secrets
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal, Optional, Protocol, runtime_checkable

import fsspec
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_ckpt import remote
from lightning_ckpt.compile import normalize_key
from lightning_ckpt.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    skipped_damaged_message,
)
from lightning_ckpt.format.plan import Stable, parse_size
from lightning_ckpt.format.read_once import ReadOnce, load_read_once
from lightning_ckpt.functional import (  # re-exported: ``lightning_ckpt.io.X`` (the old path) keeps working
    DEFAULT_MAX_SHARD_SIZE,
    load_checkpoint,
    load_remote,
    location,
    remove_checkpoint,
    save_checkpoint,
    stored_bytes,
    verify_checkpoint,
)
from lightning_ckpt.lightning.loading import load_from_checkpoint
from lightning_ckpt.lightning.monitor import LoadRecord
from lightning_ckpt.lightning.options import (
    AsyncOptions,
    SaveOptions,
    one_of,
    refuse_async_only,
    remote_options,
)
from lightning_ckpt.lightning.resume import last_good
from lightning_ckpt.save import job as savejob
from lightning_ckpt.save.background import AsyncSaver
from lightning_ckpt.save.changes import (
    Tracker,
    frozen_keys,
    stable_predicate,
    track_optimizer_steps,
    tracked_name,
)
from lightning_ckpt.save.job import Prepared
from lightning_ckpt.save.outcomes import Outcomes
from lightning_ckpt.save.protocol import WriterConfig
from lightning_ckpt.save.ranks import plan_part
from lightning_ckpt.save.sync import SyncSaver
from lightning_ckpt.store import parts
from lightning_ckpt.store.commit import WriteResult
from lightning_ckpt.store.shards import ShardWriter

__all__ = [
    "CheckpointIOFeatures",
    "DEFAULT_MAX_SHARD_SIZE",
    "ShardedCheckpointIO",
    "load_checkpoint",
    "load_from_checkpoint",
    "location",
    "remove_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]


@runtime_checkable
class CheckpointIOFeatures(Protocol):
    """What ``ShardedModelCheckpoint`` uses of a plugin beyond Lightning's ``CheckpointIO``
    contract. ``ShardedCheckpointIO`` has all of it; Lightning's own plugins none (the callback
    then measures and saves as ``ModelCheckpoint`` does). Called on the training thread; which
    ranks call what: see each method of ``ShardedCheckpointIO``."""

    async_save: bool
    when_busy: str
    max_shard_size: int
    loaded_instead: tuple[str, str] | None
    skipped_saves: int
    last_save: WriteResult | None

    def overlapping(self) -> AbstractContextManager[None]: ...

    def prepare_staging(self, nbytes: int, on_device: bool) -> None: ...

    def check_staging_pool(self, largest_image: int) -> None: ...

    def copy_wait_seconds(self, path: Any) -> float | None: ...

    def poll(self) -> list[WriteResult]: ...

    def wait(self) -> None: ...

    def resume_last(self, found: set[str], depth: int) -> None: ...

    def track_frozen(self, module: torch.nn.Module) -> None: ...


class ShardedCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves split, sharded, atomic, checksummed checkpoint directories.

    Example::

        trainer = Trainer(plugins=[ShardedCheckpointIO(max_shard_size="2GB", async_save=True)])

    Args:
        max_shard_size: cap on each shard file's tensor bytes (int bytes or ``"2GB"``, ``"500MiB"``).
            A single tensor larger than the cap gets a shard of its own.
        verify_on_load: ``"full"`` (default: every byte a load reads is hashed and checked
            against the manifest first; a damaged file raises ``CorruptCheckpointError``) or
            ``"structure"`` (the opt-out: files present, sizes and the metadata's digest right).
        direct_io: write shard data with ``O_DIRECT`` (bypasses and so preserves the page cache).
            ``None`` probes the filesystem and falls back to buffered writes where it is refused.
        buffer_size: size of each of the four reused host buffers that a synchronous save streams
            through; its extra host memory is about four times this, whatever the checkpoint size.
            Rounded down to a multiple of 4 KiB (``O_DIRECT``'s alignment), and 4 KiB at least.
        async_save: ``save_checkpoint`` returns once the state is copied into a reused
            shared-memory staging pool; a persistent writer process writes and commits it.
        when_busy: what an async save does while the previous one is still being written:
            ``"wait"`` (block until it is durable, then save) or ``"skip"`` (skip this save with a
            warning, counted in ``skipped_saves``; the next removal is refused, so a skipped save
            never displaces a good checkpoint).
        staging_pool_size: cap on the staging pool (``None``: as large as the state needs). A
            larger state is staged through it in pieces, so it must hold the largest shard
            (about ``max_shard_size``, or the largest tensor): a smaller cap is refused after the
            first optimizer step, before any save. Async options without ``async_save=True`` are
            refused at construction.
        on_error: a failed background write is ``"raise"`` d (once, at the next save, ``wait()`` or
            ``teardown()``) or only ``"warn"`` ed, so training goes on.
        max_write_rate: cap on the writer process's write rate, in bytes per second (``"1GB"``
            means 1 GB/s). Spreading the write out makes it compete less with training for memory
            bandwidth and I/O, at the cost of a later durable time. ``None``: as fast as possible.
        part_timeout: multi-rank saves: how many seconds rank 0 waits for the other ranks' parts
            before it gives the save up (nothing is committed). Every rank must write to the same
            shared filesystem path.
        spread_writes: DDP: every rank writes about ``1/world_size`` of the replicated state
            (``True``), or rank 0 writes it all (``False``). ``None`` (default): spread on one node
            only, where every rank sees rank 0's folder; pass ``True`` for multi-node runs on a shared
            filesystem. Sharded strategies always write from every rank.
        overlap_copies: async saves of CUDA state through ``ShardedModelCheckpoint`` between two
            training steps copy parameters and optimizer state to the host while the next forward
            and backward run, and the next ``optimizer.step()`` waits for them (see
            ``overlapping``). Pass ``False`` if something changes parameters in place outside
            ``optimizer.step()`` between two steps; the training stream then waits for the copies
            right after the save.
        storage_options: for ``s3://`` and other fsspec URLs: passed to the filesystem
            (credentials, ``endpoint_url`` under ``client_kwargs`` ...). Any path Lightning hands
            over may be such a URL; ``s3fs`` comes with ``pip install 'lightning-ckpt[s3]'``.
        local_dir: remote checkpoints only: the local tier. Each save is committed under this
            folder at local-disk speed (safe against a process crash at once), then uploaded in
            the background (synchronous mode: the call returns after the local commit); loads use
            the local copy when it is the newest. ``None``: each save is committed in a temporary
            folder and uploaded before it counts as done.
        local_keep: how many published checkpoints the local tier keeps per folder (one not
            yet uploaded is never removed).
        upload_part_size: size of each part of a multipart upload (and of each read of a
            download). On S3 an upload holds a few MiB (a compressed one, one part); other
            filesystems' file objects buffer a few parts per object in flight.
        upload_concurrency: objects uploaded or downloaded at once.
        compression: remote checkpoints only: store shard files zstd-compressed (``"zstd"``: all
            components; ``{"optimizer": "zstd"}``: those named). Compressed while uploading and
            decompressed while downloading, each file checked against its manifest digest; local
            checkpoints and the local tier stay plain safetensors. Needs ``zstandard``
            (``pip install 'lightning-ckpt[zstd]'``). ``None`` (default): stored as they are.
        compression_level: the zstd level (1 fastest ... 19; 3 is zstd's default).
        incremental: a save reuses the shard files of the previous checkpoint this plugin
            committed into the same folder whose tensors provably did not change since (same
            storage, offset, shape, stride, dtype and version counter; see
            ``lightning_ckpt.save.changes``): hard-linked (or copied) into the new checkpoint, not
            staged, written or uploaded again. Every checkpoint stays complete on its own.
            Frozen weights are kept in shards of their own (``model-stable-*``) when the plugin
            knows them (``track_frozen``; ``ShardedModelCheckpoint`` tells it). On by default;
            pass ``False`` if your code changes saved tensors in place behind PyTorch's back
            (through ``.data``, ``.numpy()``, DLPack or a ``torch.distributed`` collective such as
            ``dist.broadcast(t)``), which no version counter sees. ``"link"`` is ``True``;
            ``"copy"`` copies each reused file instead of linking it (a reflink where the
            filesystem has them, else ``copy_file_range``: in the kernel, neither staged nor
            hashed again), so that every checkpoint has bytes of its own: one damaged on disk
            does not damage the others (see docs/incremental.md for which to pick).

        read_once: DDP resumes through ``ShardedModelCheckpoint``: each shard file is read from
            storage by one rank (spread by bytes) and broadcast to the others over the training
            process group, instead of every rank reading the whole checkpoint. ``None``
            (default): when the ranks span several nodes (on one node the page cache already
            shares the reads); ``True``: on one node too; ``False``: never.

    Call order and ranks: Lightning calls ``save_checkpoint``/``remove_checkpoint`` on global rank 0
    only, ``load_checkpoint`` and ``teardown`` on every rank; none of them runs a collective, but
    the Trainer's restore that reads once (``read_once``): two ``all_gather_object`` and a
    broadcast per shard file. ``last_load`` describes the latest load (seconds, bytes, GB/s).
    """

    def __init__(
        self,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        verify_on_load: Literal["full", "structure"] = "full",
        direct_io: Optional[bool] = None,
        buffer_size: int | str = "16MiB",
        async_save: bool = False,
        when_busy: Literal["wait", "skip"] = "wait",
        staging_pool_size: int | str | None = None,
        on_error: Literal["raise", "warn"] = "raise",
        max_write_rate: int | str | None = None,
        part_timeout: float = parts.DEFAULT_PART_TIMEOUT,
        spread_writes: Optional[bool] = None,
        overlap_copies: bool = True,
        storage_options: Optional[dict[str, Any]] = None,
        local_dir: Optional[str | os.PathLike[str]] = None,
        local_keep: int = 1,
        upload_part_size: int | str = "64MiB",
        upload_concurrency: int = remote.DEFAULT_CONCURRENCY,
        compression: Optional[str | dict[str, str]] = None,
        compression_level: int = 3,
        incremental: bool | Literal["link", "copy"] = True,
        read_once: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.options = SaveOptions(
            max_shard_size=parse_size(max_shard_size, "max_shard_size"),
            verify_on_load=verify_on_load,
            direct_io=direct_io,
            buffer_bytes=parse_size(buffer_size, "buffer_size"),
            on_error=on_error,
            part_timeout=float(part_timeout),
            spread_writes=spread_writes,
            incremental=incremental,
            read_once=read_once,
        )
        one_of("async_save", async_save, (True, False))
        refuse_async_only(
            async_save,
            {
                "when_busy": (when_busy, "wait"),
                "staging_pool_size": (staging_pool_size, None),
                "max_write_rate": (max_write_rate, None),
                "overlap_copies": (overlap_copies, True),
            },
        )
        async_options = AsyncOptions(
            when_busy=when_busy,
            pool_cap=None if staging_pool_size is None else parse_size(staging_pool_size, "staging_pool_size"),
            max_write_rate=None if max_write_rate is None else parse_size(max_write_rate, "max_write_rate"),
            overlap_copies=overlap_copies,
        )
        self.async_options = async_options if async_save else None  # the async machinery is built only then
        self.remote = remote_options(
            storage_options=storage_options,
            local_dir=local_dir,
            local_keep=local_keep,
            upload_part_size=upload_part_size,
            upload_concurrency=upload_concurrency,
            compression=compression,
            compression_level=compression_level,
        )
        # The flat attributes callers read (the callback, strategies, LightningCLI's round trip).
        self.max_shard_size = self.options.max_shard_size
        self.verify_on_load = self.options.verify_on_load
        self.async_save = async_save
        self.when_busy = async_options.when_busy
        self.on_error = self.options.on_error
        self.overlap_copies = async_options.overlap_copies
        self.incremental = self.options.incremental is not False
        self.part_timeout = self.options.part_timeout
        self.spread_writes = self.options.spread_writes
        self.read_once = self.options.read_once
        # (world_size, num_nodes) while the next load is the Trainer's restore on every rank
        # (``expect_collective_load``, consumed by that load): only then may a load run
        # collectives (``read_once``).
        self._collective_load: tuple[int, int] | None = None
        self.last_load: LoadRecord | None = None  # the latest load: seconds, bytes, GB/s
        self._frozen_source: Optional[Callable[[], Optional[frozenset[str]]]] = None  # see ``track_frozen``
        self._lock = threading.RLock()
        self._build_savers()
        # Remote checkpoints this process loaded (resumed from), never removed by it (url_key).
        self._loaded_remote: set[str] = set()
        # ``ckpt_path="last"`` being resolved: Lightning's ``last`` checkpoints of one local folder
        # and how deep its templates reach (``resume_last``), until the next load.
        self._last: tuple[frozenset[str], int] | None = None
        self.loaded_instead: tuple[str, str] | None = None  # (asked, loaded) by the last load, when they differ
        self.last_stall_seconds: float | None = None  # how long the last save call blocked the caller
        self._part_token: str | None = None  # names multi-rank saves' shared folders; agreed once per run
        self._part_number = 0

    def _build_savers(self) -> None:
        options = self.options
        self._outcomes = Outcomes(self.on_error)
        self._writer = ShardWriter(options.buffer_bytes, options.direct_io)
        # One tracker per plugin and process: a new one (a new run, a resumed one) reuses nothing.
        self._tracker = Tracker(copies=self.options.incremental == "copy") if self.incremental else None
        if self.incremental:
            track_optimizer_steps()
        self._sync = SyncSaver(self._writer, self.remote, self._outcomes, self._tracker)
        self._async: AsyncSaver | None = None
        if self.async_options is not None:
            writer = WriterConfig(
                chunk_bytes=self._writer.chunk_bytes,
                direct_io=options.direct_io,
                max_write_rate=self.async_options.max_write_rate,
                remote=self.remote,
            )
            self._async = AsyncSaver(
                self.async_options, writer, self._outcomes, self._tracker, self._lock, options.max_shard_size
            )

    @property
    def sync_saver(self) -> SyncSaver:
        """The saver of synchronous saves (its ``uploader``: the local tier's upload thread).
        For inspection by tests, benchmarks and tools; the plugin's own methods are the API."""
        return self._sync

    @property
    def async_saver(self) -> AsyncSaver | None:
        """The saver of asynchronous saves (its ``pool``: the staging pool; ``worker``: the writer
        process; ``pending``: a save whose device copies are still landing); ``None`` without
        ``async_save=True``. For inspection by tests, benchmarks and tools; the plugin's own
        methods are the API."""
        return self._async

    @property
    def skipped_saves(self) -> int:
        """Async saves skipped because the previous one was still being written (``when_busy="skip"``)."""
        return 0 if self._async is None else self._async.skipped_saves

    @property
    def last_save(self) -> Optional[WriteResult]:
        """The latest save known durable (async: as of the last ``poll``/save/``wait``)."""
        return self._outcomes.last_save

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to the directory (or fsspec URL) ``path``.

        Synchronous mode returns once it is durable and committed (remote: published; with
        ``local_dir``, committed locally and uploading); async mode once it is staged.
        """
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` is not supported by ShardedCheckpointIO;"
                f" got storage_options={storage_options!r}. Pass them once as"
                " `ShardedCheckpointIO(storage_options=...)` instead."
            )
        path = location(path)
        if self.async_save and remote.is_remote(path) and fsspec.utils.get_protocol(path) == "memory":
            raise ValueError(
                f"Cannot save {path!r} with `async_save=True`: a memory:// filesystem lives in one process, and the"
                " writer process is another, so the checkpoint would never reach this one. Use a synchronous"
                " ShardedCheckpointIO, or a filesystem both processes reach."
            )
        self._save(path, lambda: savejob.prepare(checkpoint, self.max_shard_size, self._stable()))

    def track_frozen(self, module: torch.nn.Module) -> None:
        """Keep the frozen weights of ``module`` (an ``nn.Module`` whose ``state_dict`` is the
        checkpoint's ``state_dict``, or Fabric's ``model``) in shards of their own, read at every
        save, so incremental saves reuse those files whole. A layout hint only: whether a file is
        reused is decided from the tensors themselves. ``ShardedModelCheckpoint`` calls it at
        setup; the module is held by a weak reference."""
        reference = weakref.ref(module)

        def keys() -> Optional[frozenset[str]]:
            alive = reference()
            return None if alive is None else frozen_keys(alive, normalize_key)

        self._frozen_source = keys

    def _stable(self) -> Optional[Stable]:
        if not self.incremental or self._frozen_source is None:
            return None
        keys = self._frozen_source()
        return stable_predicate(keys, normalize_key) if keys else None

    def save_sharded(
        self, checkpoint: dict[str, Any], path: Any, rank: int, world_size: int, broadcast: Callable[[str], str]
    ) -> None:
        """Called on every rank: write this rank's part of a multi-rank checkpoint at ``path``.

        Sharded tensors (DTensor, ShardedTensor) are written by the ranks that hold them,
        replicated ones spread over their holders; rank 0 commits the whole once every part is
        durable (see ``distributed.py``). No collective runs, except ``broadcast`` once per run,
        at the first save, to agree on the name of the shared temporary directory (none when
        ``use_part_token`` was called, as ``ShardedModelCheckpoint`` does at setup). In async mode
        every rank stages into its own pool and its own writer process writes; a save still in
        flight is waited for (``when_busy="skip"`` cannot skip one rank's part alone).
        """

        path = location(path)
        if remote.is_remote(path) and self.remote.local_dir is None:
            raise ValueError(
                f"Saving {path!r} from every rank needs `ShardedCheckpointIO(local_dir=...)` on a folder all ranks"
                " share (the ranks write their parts there; rank 0 uploads the committed checkpoint). For DDP,"
                " `spread_writes=False` saves from rank 0 alone instead."
            )
        if self._part_token is None:
            self._part_token = broadcast(secrets.token_hex(8))
        self._part_number += 1
        folder = parts.part_folder(savejob.commit_dir_of(path, self.remote), self._part_token, self._part_number)

        def prepare() -> Prepared:
            planned = plan_part(checkpoint, rank, world_size, self.max_shard_size, self._stable())
            part = parts.Part(
                rank, world_size, folder, planned.pieces, planned.tensors, planned.layout, self.part_timeout
            )
            return savejob.prepared(checkpoint, planned.plan, planned.tree, part)

        self._save(path, prepare, can_skip=False)

    def use_part_token(self, token: str) -> None:
        """Adopt ``token`` (equal on every rank) to name multi-rank saves' shared folders, so the
        first save needs no broadcast; ``ShardedModelCheckpoint`` sends it with its setup broadcast."""
        if self._part_token is None:
            self._part_token = token

    def _save(self, path: str, prepare: Callable[[], Prepared], can_skip: bool = True) -> None:
        with self._lock:
            start = time.perf_counter()
            self._sync.raise_errors()
            if self._async is None:
                self._sync.save(path, prepare(), start)
                self.last_stall_seconds = time.perf_counter() - start
                return
            stall = self._async.save(path, prepare, can_skip, start)
            if stall is not None:
                self.last_stall_seconds = stall

    @contextlib.contextmanager
    def overlapping(self) -> Iterator[None]:
        """Async saves inside leave the device copies of parameters of stepping optimizers and of
        optimizer state to land while the next forward and backward run; the training stream is
        ordered after them just before the next ``optimizer.step()`` changes them. The caller
        promises that nothing else changes those tensors in place until then (``ShardedModelCheckpoint``
        uses it for saves between two training steps). Outside it, or with ``overlap_copies=False``,
        the training stream waits for every copy at once (the host never does)."""
        if self._async is None:
            yield
            return
        previous, self._async.overlap = self._async.overlap, self.overlap_copies
        try:
            yield
        finally:
            self._async.overlap = previous

    def prepare_staging(self, nbytes: int, on_device: bool) -> None:
        """Async mode: start the writer process, and allocate the staging pool for a state of
        about ``nbytes`` now and fault it in (and page-lock it, ``on_device``) in the background,
        so the first save neither waits for that nor stalls on it. A later, larger state still
        grows the pool at its save."""
        if self._async is not None:
            self._async.prepare_staging(nbytes, on_device)

    def check_staging_pool(self, largest_image: int) -> None:
        """Async mode: raise ``ValueError`` (the numbers, the fix) if ``staging_pool_size`` is
        below ``largest_image``, the largest shard image the state can make
        (``save.staging.largest_image``): refused at the first step, not at the first save."""
        if self._async is not None:
            self._async.check_pool(largest_image)

    def copy_wait_seconds(self, path: Any) -> float | None:
        """How long the training stream idled (GPU time) for the device copies of the latest async
        save to ``path``: a cost of that save beyond its call. ``None`` until known; 0 for a save
        that queued no device copy of its own."""
        return 0.0 if self._async is None else self._async.copy_wait_seconds(location(path))

    @override
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load a directory checkpoint (or a legacy ``.ckpt`` file); see :func:`load_checkpoint`.

        Waits for saves still being written, so a checkpoint is never read before it is committed.
        ``ckpt_path="last"`` loads the newest intact checkpoint of the folder (see ``resume_last``).
        """
        if self._async is not None:
            with self._lock:
                self._async.drain(block=True)
                self._async.worker.wait()
        verify = self.verify_on_load == "full"
        collective, self._collective_load = self._collective_load, None
        start = time.perf_counter()
        if remote.is_remote(path):
            self._sync.uploader.wait()
            self.keep_loaded(path)
            checkpoint = load_remote(os.fspath(path), self.remote, map_location, weights_only, verify)
            self.last_load = LoadRecord(os.fspath(path), time.perf_counter() - start, None, None)
            return checkpoint
        reads_once = self._reads_once(collective)
        read: dict[str, ReadOnce] = {}

        def load(candidate: str) -> dict[str, Any]:
            if reads_once:  # a collective: every rank, alike (legacy files and DCP folders: None)
                loaded = load_read_once(savejob.local_path(candidate), map_location, weights_only, verify)
                if loaded is not None:
                    checkpoint, read[candidate] = loaded
                    return checkpoint
            return load_checkpoint(candidate, map_location, weights_only, verify=verify)

        checkpoint = self.load_resolved(path, load)
        loaded = self.loaded_instead[1] if self.loaded_instead is not None else os.fspath(path)
        seconds = time.perf_counter() - start
        if loaded in read:
            share = read[loaded]
            self.last_load = LoadRecord(loaded, seconds, share.total_bytes, share.bytes_read, read_once=True)
        else:
            size = stored_bytes(savejob.local_path(loaded))
            self.last_load = LoadRecord(loaded, seconds, size, size)
        return checkpoint

    def expect_collective_load(self, world_size: int, num_nodes: int) -> None:
        """The next load is the Trainer's restore, which every rank of the run calls together
        (``ShardedModelCheckpoint`` arms it right inside Lightning's ``resume_start``:
        ``strategies.collective_restores``; ``end_collective_load`` takes it back), so it may
        read once and broadcast (``read_once``). Outside that window no load runs a collective: a
        load called on one rank alone never waits for the others."""
        self._collective_load = (world_size, num_nodes)

    def end_collective_load(self) -> None:
        """The Trainer's restore is over (see ``expect_collective_load``)."""
        self._collective_load = None

    def _reads_once(self, collective: tuple[int, int] | None) -> bool:
        if collective is None or self.read_once is False:
            return False
        world_size, num_nodes = collective
        if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
            return False
        return self.read_once is True or num_nodes > 1

    def resume_last(self, found: set[str], depth: int) -> None:
        """``ckpt_path="last"`` is resolving among ``found``, the ``last`` checkpoints Lightning found
        in one local folder (its templates reaching ``depth`` folders below it): whichever of them
        Lightning picks, the next load loads the newest committed and intact checkpoint of that
        folder instead (``resume.last_good``: damaged newer ones are skipped with a warning naming
        the damage), and falls back on older ones if the load finds damage the cheap check cannot.
        ``loaded_instead`` then says which. Every rank calls it alike (``ShardedModelCheckpoint``)."""
        self._last = (frozenset(location(p) for p in found), depth)

    def load_resolved(self, path: Any, load: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
        """``load`` of ``path``, or, while ``ckpt_path="last"`` resolves to it (``resume_last``), of the
        newest intact checkpoint of its folder, falling back on older ones (newest first) when one
        fails verification. Sets ``loaded_instead``. Every rank calls it alike, as Lightning loads."""
        asked = os.fspath(path)
        last, self._last = self._last, None
        candidates, skipped = [asked], []
        if last is not None and location(path) in last[0]:
            good = last_good(set(last[0]), last[1])
            if good is not None:  # else every one is damaged: loading Lightning's pick raises, naming its damage
                candidates, skipped = [good.path, *good.fallbacks], list(good.skipped)
        self.loaded_instead = None
        for candidate in candidates:
            try:
                checkpoint = load(candidate)
            except (CorruptCheckpointError, CheckpointNotFoundError) as err:
                if candidate is candidates[-1]:
                    raise
                # Every rank reads the same bytes: all skip it. Without its frames: they may hold
                # what was read of it (a read-once load's buffers), while the next one loads.
                skipped.append((candidate, err.with_traceback(None)))
                continue
            if candidate != asked:
                self.loaded_instead = (asked, candidate)
            if skipped:
                rank_zero_warn(skipped_damaged_message(skipped, candidate))
            return checkpoint
        raise AssertionError("unreachable: the last candidate returns or raises")

    def keep_loaded(self, url: Any) -> None:
        """Never remove the remote checkpoint ``url`` from this process: it was loaded (resumed
        from). Lightning 2.6's ``ModelCheckpoint`` keeps a local checkpoint the run resumed from,
        or one outside its ``dirpath``, but asks to remove any remote one (Lightning issue
        #21813): a run resuming into a new ``dirpath`` would delete the checkpoint it resumed
        from. ``ShardedModelCheckpoint`` applies both guards to URLs as well. The module function
        :func:`remove_checkpoint` still removes it when asked directly."""
        self._loaded_remote.add(remote.url_key(url))

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint directory or legacy file. Refuses directories that are not checkpoints.

        In async mode the removal is queued behind the saves in flight: a checkpoint is only
        removed once the one replacing it is committed.
        """
        path = location(path)
        if remote.is_remote(path) and remote.url_key(path) in self._loaded_remote:
            warnings.warn(
                f"Kept {path!r}: this run loaded (resumed from) it, and a callback asked to remove it. Lightning's"
                " `ModelCheckpoint` removes remote checkpoints it tracked from the run it resumed (Lightning issue"
                " #21813); `ShardedModelCheckpoint` keeps those outside its `dirpath`. To remove it anyway:"
                f" `lightning_ckpt.remove_checkpoint({path!r})`.",
                stacklevel=2,
            )
            return
        with self._lock:
            if self._tracker is not None:
                self._tracker.forget(tracked_name(path, self.remote))
            if self._async is None:
                self._remove(path)
            else:
                self._async.then(lambda: self._remove(path))  # after the save replacing it is handed off

    def _remove(self, path: str) -> None:
        with self._lock:
            if self._async is None:
                self._sync.remove(path)
            elif not self._async.remove(path):  # neither kept nor queued behind a save in flight
                savejob.remove(path, self.remote)

    def wait(self) -> None:
        """Block until every save in flight is durable; raise (once) what failed in the background."""
        with self._lock:
            if self._async is not None:
                self._async.wait()
            self._sync.wait()

    @override
    def teardown(self) -> None:
        """Wait for saves in flight, stop the writer process and free the buffers."""
        with self._lock:
            try:
                if self._async is not None:
                    self._async.stop()
                self._sync.wait()
            finally:
                if self._async is not None:
                    self._async.staged = None
                    self._async.release_pool()
                self._writer.close()

    def poll(self) -> list[WriteResult]:
        """Async saves that became durable since the last ``poll`` (never blocks, raises nothing:
        errors surface at the defined points). Synchronous saves are durable when they return."""
        with self._lock:
            if self._async is not None:
                self._async.worker.poll()
            return self._outcomes.take()

    def __getstate__(self) -> dict[str, Any]:
        # Spawn-based strategies pickle the plugin: ship the configuration, not locks, buffers,
        # threads or processes (new savers in ``__setstate__``).
        state = self.__dict__.copy()
        for name in ("_lock", "_outcomes", "_writer", "_sync", "_async", "_tracker", "_frozen_source"):
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._build_savers()
