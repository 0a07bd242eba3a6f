"""The CheckpointIO plugin: Lightning's contract -> plan -> write; reads through ``reader``.

Call order and ranks (Lightning 2.x): ``save_checkpoint`` and ``remove_checkpoint`` run on global
rank 0 only, so nothing here may run a collective; ``load_checkpoint`` runs on every rank;
``teardown`` runs on every rank at the end of ``fit``/``validate``/``test``/``predict``.
"""

import atexit
import contextlib
import os
import secrets
import threading
import time
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Optional

import fsspec
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from typing_extensions import override

from lightning_ckpt import remote, savejob, staging, writer
from lightning_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    skipped_damaged_message,
)
from lightning_ckpt.functional import (  # re-exported: ``lightning_ckpt.io.X`` keeps working
    DEFAULT_MAX_SHARD_SIZE,
    load_checkpoint,
    load_from_checkpoint,
    load_remote,
    location,
    remove_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from lightning_ckpt.plan import OPTIMIZER_COMPONENT, Blob, parse_size
from lightning_ckpt.savejob import Destination, Prepared
from lightning_ckpt.staging import StagingPool
from lightning_ckpt.worker import WriterProcess
from lightning_ckpt.writer import ShardWriter, WriteResult

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "ShardedCheckpointIO",
    "load_checkpoint",
    "load_from_checkpoint",
    "location",
    "remove_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
_VERIFY_MODES = ("structure", "full")


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
        async_save: ``save_checkpoint`` returns once the state is copied into a reused
            shared-memory staging pool; a persistent writer process writes and commits it.
        when_busy: what an async save does while the previous one is still being written:
            ``"wait"`` (block until it is durable, then save) or ``"skip"`` (skip this save with a
            warning, counted in ``skipped_saves``; the next removal is refused, so a skipped save
            never displaces a good checkpoint).
        staging_pool_size: cap on the staging pool (``None``: as large as the state needs).
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

    Call order and ranks: Lightning calls ``save_checkpoint``/``remove_checkpoint`` on global rank 0
    only, ``load_checkpoint`` and ``teardown`` on every rank; none of them runs a collective.
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
        part_timeout: float = writer.DEFAULT_PART_TIMEOUT,
        spread_writes: Optional[bool] = None,
        overlap_copies: bool = True,
        storage_options: Optional[dict[str, Any]] = None,
        local_dir: Optional[str | os.PathLike[str]] = None,
        local_keep: int = 1,
        upload_part_size: int | str = "64MiB",
        upload_concurrency: int = remote.DEFAULT_CONCURRENCY,
        compression: Optional[str | dict[str, str]] = None,
        compression_level: int = 3,
    ) -> None:
        super().__init__()
        if isinstance(local_keep, bool) or not isinstance(local_keep, int) or local_keep < 1:
            raise ValueError(f"`local_keep={local_keep!r}` must be an int >= 1.")
        if isinstance(upload_concurrency, bool) or not isinstance(upload_concurrency, int) or upload_concurrency < 1:
            raise ValueError(f"`upload_concurrency={upload_concurrency!r}` must be an int >= 1.")
        part_size = parse_size(upload_part_size, "upload_part_size")
        if part_size < 5 * 2**20:
            raise ValueError(f"`upload_part_size={upload_part_size!r}` is below 5 MiB, the smallest part S3 accepts.")
        if local_dir is not None and remote.is_remote(local_dir):
            raise ValueError(f"`local_dir={local_dir!r}` must be a local folder (it is the fast tier in front of the remote).")
        codecs = {"*": compression} if isinstance(compression, str) else dict(compression or {})
        for component, encoding in codecs.items():
            if encoding not in remote.ENCODINGS:
                raise ValueError(f"`compression={compression!r}`: {encoding!r} for {component!r} is not one of {sorted(remote.ENCODINGS)}.")
        if codecs:
            remote._zstd()  # a missing zstandard is reported now, not at the first upload
        if isinstance(compression_level, bool) or not isinstance(compression_level, int) or not 1 <= compression_level <= 22:
            raise ValueError(f"`compression_level={compression_level!r}` must be an int from 1 to 22.")
        self.remote = remote.RemoteOptions(
            dict(storage_options or {}),
            part_size,
            upload_concurrency,
            None if local_dir is None else os.path.abspath(os.fspath(local_dir)),
            local_keep,
            codecs,
            compression_level,
        )
        self._uploader = remote.Uploader()
        self.max_shard_size = parse_size(max_shard_size, "max_shard_size")
        if verify_on_load not in _VERIFY_MODES:
            raise ValueError(f"`verify_on_load={verify_on_load!r}` must be one of {_VERIFY_MODES}.")
        for name, value, allowed in (
            ("direct_io", direct_io, (None, True, False)),
            ("async_save", async_save, (True, False)),
            ("when_busy", when_busy, ("wait", "skip")),
            ("on_error", on_error, ("raise", "warn")),
            ("overlap_copies", overlap_copies, (True, False)),
        ):
            if value not in allowed:
                raise ValueError(f"`{name}={value!r}` must be one of {allowed}.")
        self.verify_on_load = verify_on_load
        self.async_save = async_save
        self.when_busy = when_busy
        self.on_error = on_error
        self.overlap_copies = overlap_copies
        self._overlap = False  # inside ``overlapping()``
        pool_cap = None if staging_pool_size is None else parse_size(staging_pool_size, "staging_pool_size")
        self._writer = ShardWriter(parse_size(buffer_size, "buffer_size"), direct_io)
        self._pool = StagingPool(pool_cap)
        rate = None if max_write_rate is None else parse_size(max_write_rate, "max_write_rate")
        self._worker = WriterProcess(
            {"chunk_bytes": self._writer.chunk_bytes, "direct_io": direct_io, "max_write_rate": rate, "remote": self.remote}
        )
        self._lock = threading.RLock()
        self._pending: Optional[_Pending] = None  # a save whose device copies are still landing
        self._action_errors: list[Exception] = []
        self._copy_waits: OrderedDict[str, staging.Copies] = OrderedDict()  # path -> its latest save's copies
        self._refuse_next_removal = False
        # Remote checkpoints this process loaded (resumed from), never removed by it (url_key).
        self._loaded_remote: set[str] = set()
        # Resolved checkpoint -> older intact ones to load instead if it fails verification
        # (set by ``ShardedModelCheckpoint`` for ``ckpt_path="last"``); see ``load_checkpoint``.
        self._fallbacks: dict[str, list[str]] = {}
        self.loaded_instead: tuple[str, str] | None = None  # (asked, loaded) by the last load that fell back
        self._staged: tuple[tuple[Any, ...], dict[str, tuple[int, int]]] | None = None
        self.skipped_saves = 0
        self._unpolled: deque[WriteResult] = deque(maxlen=1024)
        self.last_save: WriteResult | None = None
        self.last_stall_seconds: float | None = None  # how long the last save call blocked the caller
        if async_save:
            _track_optimizers()
        self.part_timeout = float(part_timeout)
        if spread_writes not in (None, True, False):
            raise ValueError(f"`spread_writes={spread_writes!r}` must be one of (None, True, False).")
        self.spread_writes = spread_writes
        self._part_token: str | None = None  # names multi-rank saves' shared folders; agreed once per run
        self._part_number = 0
        _live_instances.add(self)

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
        self._save(path, lambda: savejob.prepare(checkpoint, self.max_shard_size))

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
        from lightning_ckpt.distributed import plan_part

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
        folder = writer.part_folder(savejob.commit_dir_of(path, self.remote), self._part_token, self._part_number)

        def prepare() -> Prepared:
            planned = plan_part(checkpoint, rank, world_size, self.max_shard_size)
            part = writer.Part(
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
            start, started = time.perf_counter(), time.time()
            self._raise_upload_errors()
            if not self.async_save:
                self._save_now(path, prepare(), start)
                return
            self._worker.ensure_started()  # detects a dead writer (its error is reported next)
            self._report(self._worker.take_errors())
            prepared = prepare()
            fingerprint = savejob.fingerprint(prepared.plan)
            if fingerprint is not None and self._staged is not None and self._staged[0] == fingerprint:
                # A second save of the very same tensors (top-k file, then last.ckpt, in one
                # step): the pool holds (or is receiving) these bytes, and nothing overwrites it
                # while the writer has jobs. Only the (small) metadata differs.
                images = self._staged[1]
                self._then(lambda: self._submit(prepared, path, images, started))
                self.last_stall_seconds = time.perf_counter() - start
                return
            self._drain(block=True)  # the pool is about to be staged again
            self._raise_action_errors()
            if self._worker.busy:
                if self.when_busy == "skip" and can_skip:
                    self.skipped_saves += 1
                    self._refuse_next_removal = True
                    warnings.warn(
                        f"Skipped checkpoint {path!r}: the previous save ({self._worker.in_flight()[0]!r}) is"
                        f" still being written and `when_busy='skip'` ({self.skipped_saves} skipped so far).",
                        stacklevel=2,
                    )
                    return
                self._worker.wait()
                self._report(self._worker.take_errors())
            self._refuse_next_removal = False
            self._staged = None  # the pool is about to be overwritten
            self._stage_and_submit(prepared, path, fingerprint, started)
            self.last_stall_seconds = time.perf_counter() - start

    def _save_now(self, path: str, prepared: Prepared, start: float) -> None:
        """A synchronous save; of a URL: committed locally, then published (here, or in the
        background with a local tier). Multi-rank: rank 0 publishes once it committed the whole."""
        job = prepared.job(Destination.resolve(path, self.remote))
        result = job.run(self._writer, upload=self._uploader.publish)
        if job.publishes and job.destination.spool is not None:  # durable once published: the whole call
            result = WriteResult(path, result.nbytes, time.perf_counter() - start, result.files, result.direct_io)
        self.last_save = result
        self.last_stall_seconds = time.perf_counter() - start

    def _raise_upload_errors(self) -> None:
        """What a background upload (local tier, synchronous mode) raised, per ``on_error``."""
        errors = self._uploader.take_errors()
        for error in errors:
            if not isinstance(error, CheckpointWriteError):
                raise error
        self._report(errors)  # type: ignore[arg-type]

    def _submit(
        self, prepared: Prepared, path: str, images: dict[str, tuple[int, int]], started: float, chunked: bool = False
    ) -> int:
        pool = (self._pool.fd, self._pool.generation)
        job = prepared.job(Destination.resolve(path, self.remote), with_data=False)
        message = {"job": job, "images": images, **({"chunked": True} if chunked else {})}
        return self._worker.submit("save", path, message, pool=pool, submitted=started)

    def _stage_and_submit(
        self, prepared: Prepared, path: str, fingerprint: tuple[Any, ...] | None, started: float
    ) -> None:
        image_layout, headers = staging.layout(prepared.plan)
        cap = self._pool.max_bytes
        if cap is not None and image_layout.nbytes > cap:
            self._stage_in_chunks(prepared, path, image_layout, headers, cap, started)
            return
        deferrable = _changed_by_optimizers_only() if self._overlap else lambda _: False
        copies = self._pool.stage(prepared.plan, image_layout, headers, deferrable)
        self._staged = None if fingerprint is None else (fingerprint, image_layout.images)

        def submit() -> None:
            self._submit(prepared, path, image_layout.images, started)

        if copies is None:
            submit()
            return
        # Device copies are still landing in the pool: the writer gets the job once they have (a
        # watcher thread); the host does not wait here. Deferred copies: see ``overlapping``.
        self._copy_waits[path] = copies
        while len(self._copy_waits) > _COPY_WAITS_KEPT:
            self._copy_waits.popitem(last=False)
        self._pending = pending = _Pending(copies, [submit])
        threading.Thread(target=self._drain_when_landed, args=(pending,), name="lightning_ckpt-handoff", daemon=True).start()

    def _then(self, action: Callable[[], None]) -> None:
        """Run ``action`` after the pending save's hand-off to the writer (now if none is pending)."""
        if self._pending is not None:
            self._pending.actions.append(action)
        else:
            action()

    def _hand_over(self) -> None:
        """An optimizer is about to step (see ``_before_optimizer_step``)."""
        with self._lock:
            pending = self._pending
            if pending is not None:
                pending.copies.hand_over()
                self._drain(block=False)

    @contextlib.contextmanager
    def overlapping(self) -> Iterator[None]:
        """Async saves inside leave the device copies of parameters of stepping optimizers and of
        optimizer state to land while the next forward and backward run; the training stream is
        ordered after them just before the next ``optimizer.step()`` changes them. The caller
        promises that nothing else changes those tensors in place until then (``ShardedModelCheckpoint``
        uses it for saves between two training steps). Outside it, or with ``overlap_copies=False``,
        the training stream waits for every copy at once (the host never does)."""
        previous, self._overlap = self._overlap, self.overlap_copies
        try:
            yield
        finally:
            self._overlap = previous

    def _drain_when_landed(self, pending: "_Pending") -> None:
        pending.copies.wait()
        with self._lock:
            if self._pending is pending:
                try:
                    self._drain(block=False)
                except Exception as error:  # raised on the training thread at its next call
                    self._action_errors.append(error)

    def _drain(self, block: bool) -> None:
        """Hand the pending save (and what was queued behind it) to the writer once its copies have
        landed; ``block``: wait for them (training thread only: it orders the stream after them)."""
        with self._lock:
            pending = self._pending
            if pending is None:
                return
            if block:
                pending.copies.hand_over()
                pending.copies.wait()
            elif not pending.copies.landed():
                return
            self._pending = None
            errors = []
            for action in pending.actions:  # each runs, whatever an earlier one raised
                try:
                    action()
                except Exception as error:
                    errors.append(error)
            if errors:
                raise errors[0]

    def _raise_action_errors(self) -> None:
        """What a removal queued behind a save raised on the watcher thread (e.g. a refused path)."""
        if self._action_errors:
            error, self._action_errors = self._action_errors[0], []
            raise error

    def prepare_staging(self, nbytes: int, on_device: bool) -> None:
        """Async mode: start the writer process, and allocate the staging pool for a state of
        about ``nbytes`` now and fault it in (and page-lock it, ``on_device``) in the background,
        so the first save neither waits for that nor stalls on it. A later, larger state still
        grows the pool at its save."""
        if not self.async_save:
            return
        wanted = int(nbytes * _STAGING_HEADROOM) + _STAGING_SLACK  # headers, 4 KiB alignment, growth
        if self._pool.max_bytes is not None:
            wanted = min(wanted, self._pool.max_bytes)
        with self._lock:
            self._worker.ensure_started()  # its imports (seconds of CPU) run now, not in the first save
            if self._pending is None and not self._worker.busy:  # never under a save in flight
                self._pool.reserve(wanted, pin=on_device)

    def copy_wait_seconds(self, path: Any) -> float | None:
        """How long the training stream idled (GPU time) for the device copies of the latest async
        save to ``path``: a cost of that save beyond its call. ``None`` until known; 0 for a save
        that queued no device copy of its own."""
        copies = self._copy_waits.get(location(path))
        return 0.0 if copies is None else copies.waited_seconds()

    def _stage_in_chunks(
        self,
        prepared: Prepared,
        path: str,
        image_layout: staging.ImageLayout,
        headers: dict[str, Any],
        cap: int,
        started: float,
    ) -> None:
        """A state larger than ``staging_pool_size``: stage shard by shard through a ring, blocking
        only while the shards that do not fit wait for the writer to free space."""
        largest = max(staging.aligned(size) for _, size in image_layout.images.values())
        if largest > cap:
            raise ValueError(
                f"A shard of {largest} bytes does not fit `staging_pool_size` ({cap} bytes). Raise"
                " `staging_pool_size` or lower `max_shard_size`."
            )
        self._pool.reserve(cap, pin=bool(prepared.plan.cuda_devices()))
        ring = staging.Ring(cap)
        job_id: int | None = None
        try:
            for shard in prepared.plan.shards:
                _, size = image_layout.images[shard.filename]
                start = ring.alloc(staging.aligned(size))
                while start is None:
                    if job_id is None or not self._worker.wait_shard_written(job_id):
                        # The writer ended the job (failed or died): report it now, per `on_error`.
                        errors = self._worker.take_errors()
                        ended = CheckpointWriteError(f"Saving {path!r} stopped: the writer ended the job.", path)
                        self._report(errors or [ended])
                        return
                    ring.free_oldest()
                    start = ring.alloc(staging.aligned(size))
                self._pool.stage_shard(shard, headers[shard.filename], start)
                copies = self._pool.copies()
                if copies is not None:  # the writer reads this region next
                    copies.hand_over()
                    copies.wait()
                images = {shard.filename: (start, size)}
                if job_id is None:
                    job_id = self._submit(prepared, path, images, started, chunked=True)
                else:
                    self._worker.send_images(job_id, images)
        except BaseException:
            # Interrupted mid-job (Ctrl-C, a device error, the writer's own failure raised
            # above): the writer may wait for shards that will never come. End it; its job fails
            # and nothing is committed.
            self._worker.abort()
            raise

    @override
    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load a directory checkpoint (or a legacy ``.ckpt`` file); see :func:`load_checkpoint`.

        Waits for saves still being written, so a checkpoint is never read before it is committed.
        A checkpoint given fallbacks (``fall_back_on_damage``) that fails verification is skipped
        with a warning naming the damaged file, for the newest of its fallbacks that loads;
        ``loaded_instead`` then says which.
        """
        if self.async_save:
            with self._lock:
                self._drain(block=True)
                self._worker.wait()
        if remote.is_remote(path):
            self._uploader.wait()
            self.keep_loaded(path)
            return load_remote(os.fspath(path), self.remote, map_location, weights_only, self.verify_on_load == "full")
        candidates = [os.fspath(path), *self._fallbacks.pop(location(path), [])]
        self.loaded_instead = None
        skipped: list[tuple[str, CheckpointError]] = []
        for candidate in candidates:
            try:
                checkpoint = load_checkpoint(candidate, map_location, weights_only, verify=self.verify_on_load == "full")
            except (CorruptCheckpointError, CheckpointNotFoundError) as err:
                if candidate is candidates[-1]:
                    raise
                skipped.append((candidate, err))  # every rank reads the same bytes: all skip it
                continue
            if skipped:
                self.loaded_instead = (candidates[0], candidate)
                rank_zero_warn(skipped_damaged_message(skipped, candidate))
            return checkpoint
        raise AssertionError("unreachable: the last candidate returns or raises")

    def fall_back_on_damage(self, path: Any, fallbacks: list[str]) -> None:
        """Let the next ``load_checkpoint(path)`` load the first of ``fallbacks`` (older checkpoints,
        newest first) that verifies when ``path`` fails verification, instead of raising."""
        self._fallbacks[location(path)] = list(fallbacks)

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
            self._then(lambda: self._remove(path))  # after the save replacing it is handed off

    def _remove(self, path: str) -> None:
        with self._lock:
            if self._refuse_next_removal:
                self._refuse_next_removal = False
                warnings.warn(f"Kept {path!r}: the save that would have replaced it was skipped.", stacklevel=2)
                return
            if self.async_save:
                replacing = self._worker.last_save_id
                if self._worker.save_failed(replacing):
                    warnings.warn(f"Kept {path!r}: the save that would have replaced it failed.", stacklevel=2)
                    return
                if self._worker.busy:  # runs after that save, and only if it committed
                    self._worker.submit("remove", path, {"after": replacing})
                    return
            if remote.is_remote(path) and self.remote.local_dir is not None and not self.async_save:
                self._uploader.remove(path, lambda: savejob.remove(path, self.remote))  # behind the uploads
                return
        savejob.remove(path, self.remote)

    def wait(self) -> None:
        """Block until every save in flight is durable; raise (once) what failed in the background."""
        with self._lock:
            self._drain(block=True)
            self._worker.wait()
            self._report(self._worker.take_errors())
            self._raise_action_errors()
            self._uploader.wait()
            self._raise_upload_errors()

    @override
    def teardown(self) -> None:
        """Wait for saves in flight, stop the writer process and free the buffers."""
        with self._lock:
            try:
                self._drain(block=True)
                self._worker.stop()
                self._report(self._worker.take_errors())
                self._uploader.wait()
                self._raise_upload_errors()
            finally:
                self._staged = None
                self._release_pool()
                self._writer.close()

    def _release_pool(self) -> None:
        """Free the staging pool. Unmapping and freeing gigabytes of shared memory takes a while
        (0.4 s at 3 GB): a host-only pool is freed on a thread, so ``teardown`` does not wait for
        it; a page-locked one here (unregistering synchronises with the device)."""
        pool = self._pool
        if pool.pins or pool.nbytes == 0:
            pool.close()
            return
        self._pool = StagingPool(pool.max_bytes)
        self._pool.generation = pool.generation  # the writer tells pools apart by generation
        threading.Thread(target=pool.close, name="lightning_ckpt-free-pool", daemon=True).start()

    def _report(self, errors: list[CheckpointWriteError]) -> None:
        self._collect_results()
        if not errors:
            return
        if self.on_error == "warn":
            for error in errors:
                warnings.warn(str(error), stacklevel=3)
            return
        if len(errors) > 1:
            raise CheckpointWriteError("; ".join(str(e) for e in errors), errors[-1].path) from errors[0]
        raise errors[0]

    def _collect_results(self) -> None:
        kept, self._worker.kept = self._worker.kept, []
        for path in kept:
            warnings.warn(f"Kept {path!r}: the save that would have replaced it failed.", stacklevel=3)
        results, self._worker.results = self._worker.results, []
        for r in results:
            # seconds: from the save call until the checkpoint was committed and durable
            self.last_save = WriteResult(r["path"], r["nbytes"], r["durable_at"] - r["submitted"], r["files"], r["direct_io"])
            self._unpolled.append(self.last_save)
        published, self._uploader.results = self._uploader.results, []
        for done in published:  # local tier, synchronous mode: uploaded in the background
            self._unpolled.append(WriteResult(done.url, done.nbytes, done.seconds, done.files, False))

    def poll(self) -> list[WriteResult]:
        """Async saves that became durable since the last ``poll`` (never blocks, raises nothing:
        errors surface at the defined points). Synchronous saves are durable when they return."""
        with self._lock:
            self._worker.poll()
            self._collect_results()
            done = list(self._unpolled)
            self._unpolled.clear()
            return done

    def __getstate__(self) -> dict[str, Any]:
        # Spawn-based strategies pickle the plugin: ship the configuration, not locks, buffers or processes.
        state = self.__dict__.copy()
        state["_lock"] = None
        state["_pending"] = state["_staged"] = None
        state["_action_errors"] = []
        state["_copy_waits"] = OrderedDict()
        state["_writer"] = ShardWriter(self._writer.chunk_bytes, self._writer.direct_io)
        state["_pool"] = StagingPool(self._pool.max_bytes)
        state["_worker"] = WriterProcess(self._worker.config)
        state["_uploader"] = None  # threads and queues do not pickle: a new one in __setstate__
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._uploader = remote.Uploader()
        if self.async_save:
            _track_optimizers()
        _live_instances.add(self)


# Saves still in flight when the interpreter exits are finished (a checkpoint the user asked for is
# not dropped), then the writer process is stopped.
_live_instances: weakref.WeakSet[ShardedCheckpointIO] = weakref.WeakSet()


@dataclass
class _Pending:
    """An async save whose device copies are still landing, and what must follow its hand-off."""

    copies: staging.Copies
    actions: list[Callable[[], None]]  # in order: the submission first, then removals and re-saves


# Optimizers seen stepping in this process. Their parameters and state change only in their own
# ``step()``, so the copies of those tensors may overlap the next forward and backward.
_stepping: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_step_hook: Any = None
_COPY_WAITS_KEPT = 64
_STAGING_HEADROOM, _STAGING_SLACK = 1.05, 64 * 2**20  # prepare_staging's margin over the estimate


def _track_optimizers() -> None:
    """Register ``_before_optimizer_step`` once per process. It is never removed: torch iterates
    the hooks' dict in ``step()``, so a hook removed from inside that loop (or by another thread
    meanwhile) raises "OrderedDict mutated during iteration" there."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_before_optimizer_step)


def _before_optimizer_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Every optimizer's pre-step hook: note the optimizer as stepping, and, as the step changes
    what pending device copies read, order the training stream after them here, or, for a step
    given a closure (Lightning's automatic optimization runs forward and backward inside it), once
    the closure has run."""
    _stepping.add(optimizer)
    waiting = [io for io in list(_live_instances) if io._pending is not None]
    if not waiting:
        return None

    def hand_over() -> None:
        for io in waiting:
            io._hand_over()

    # ``args`` starts with the optimizer itself (``step`` is a method): the closure is next.
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        hand_over()
        return None

    def then_hand_over(*a: Any, **k: Any) -> Any:
        result = closure(*a, **k)
        hand_over()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": then_hand_over}
    return (args[0], then_hand_over, *args[2:]), kwargs


def _storage(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
    return local.untyped_storage().data_ptr()


def _changed_by_optimizers_only() -> Callable[[Blob], bool]:
    """Which blobs the forward and backward leave alone: optimizer state, and the parameters of
    optimizers seen stepping. Anything else (buffers, frozen weights, callback state) is not."""
    params = {_storage(p) for optimizer in list(_stepping) for group in optimizer.param_groups for p in group["params"]}

    def deferrable(blob: Blob) -> bool:
        assert blob.source is not None
        return blob.component == OPTIMIZER_COMPONENT or blob.source.untyped_storage().data_ptr() in params

    return deferrable


@atexit.register
def _finish_in_flight_saves() -> None:
    for io in list(_live_instances):
        try:
            io._drain(block=True)  # a save still waiting for its device copies
            io._worker.stop()
            io._uploader.wait()
            for upload_error in io._uploader.take_errors():
                warnings.warn(str(upload_error), stacklevel=1)
            for error in io._worker.take_errors():
                warnings.warn(str(error), stacklevel=1)
        except Exception:  # exiting anyway; the next run cleans any temporary directory
            io._worker.kill()
