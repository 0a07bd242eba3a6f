"""Asynchronous saves: ``AsyncSaver`` stages the state into a reused ``staging.StagingPool``,
hands the job to the writer process (``worker.WriterProcess``) once the device copies have landed
(the hand-off thread, or the optimizer pre-step hook in ``hooks``), reuses staged bytes for a second
save of the same tensors (fingerprint), skips or waits while busy (``AsyncOptions.when_busy``),
queues removals behind the save replacing them, and finishes saves in flight at interpreter exit.

Threads: the caller's (training) thread runs everything but the hand-off thread
(``drain_when_landed``); it takes the plugin's lock. Errors go to ``outcomes.Outcomes``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_ckpt.errors import CheckpointWriteError
from lightning_ckpt.format.plan import Plan
from lightning_ckpt.save import hooks, staging
from lightning_ckpt.save import job as savejob
from lightning_ckpt.save.changes import Ticket, Tracker, begin_incremental
from lightning_ckpt.save.job import Destination, Prepared
from lightning_ckpt.save.outcomes import Outcomes
from lightning_ckpt.save.protocol import WriterConfig
from lightning_ckpt.save.staging import StagingPool
from lightning_ckpt.save.worker import WriterProcess
from lightning_ckpt.store.reuse import Reused


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncOptions:
    """Async saves (``async_save=True``): what a save does while the previous one is still being
    written, the staging pool's cap, the writer process's write rate cap (bytes per second), and
    whether device copies may overlap the next forward and backward."""

    when_busy: Literal["wait", "skip"] = "wait"
    pool_cap: int | None = None
    max_write_rate: int | None = None
    overlap_copies: bool = True

    def __post_init__(self) -> None:
        if self.when_busy not in ("wait", "skip"):
            raise ValueError(f"`when_busy={self.when_busy!r}` must be one of ('wait', 'skip').")
        if self.overlap_copies is not True and self.overlap_copies is not False:
            raise ValueError(f"`overlap_copies={self.overlap_copies!r}` must be one of (True, False).")


class AsyncSaver:
    """Async saves of one plugin (see the module docstring). Every method runs under ``lock``."""

    def __init__(
        self,
        config: AsyncOptions,
        writer: WriterConfig,
        outcomes: Outcomes,
        tracker: Tracker | None,
        lock: threading.RLock,
        max_shard_size: int,
    ) -> None:
        self.options, self.when_busy, self.lock, self.outcomes = writer.remote, config.when_busy, lock, outcomes
        self.max_shard_size = max_shard_size  # the plan's cap: what a capped pool must hold (``check_pool``)
        self.tracker = tracker  # incremental saves (``None``: every save stages and writes every file)
        self.tickets: dict[int, Ticket] = {}  # writer job id -> its incremental ticket
        self.pool = StagingPool(config.pool_cap)
        self.worker = WriterProcess(writer)
        self.pending: Pending | None = None  # a save whose device copies are still landing
        self.action_errors: list[Exception] = []
        self.copy_waits: OrderedDict[str, staging.Copies] = OrderedDict()  # path -> its latest save's copies
        self.staged: tuple[tuple[Any, ...], dict[str, tuple[int, int]]] | None = None  # fingerprint, images
        self.submitted: tuple[tuple[Any, ...] | None, int | None] = (None, None)  # the staging save's fingerprint, job id
        self.refuse_next_removal = False
        self.skipped_saves = 0
        self.overlap = False  # inside ``ShardedCheckpointIO.overlapping()`` with ``overlap_copies``
        outcomes.collectors.append(self.collect)
        self.warmed = False  # by the process's first optimizer steps (``warm_up``)
        hooks.register_async(self)

    def save(self, path: str, prepare: Callable[[], Prepared], can_skip: bool, start: float) -> float | None:
        """Stage the save ``prepare()`` plans and hand it to the writer process (once its device
        copies have landed); how long the caller was held (``start``: ``perf_counter`` at its
        call), or ``None`` when the save was skipped (``when_busy="skip"``, ``can_skip``)."""
        started = time.time()
        with self.lock:
            self.worker.ensure_started()  # detects a dead writer (its error is reported next)
            self.outcomes.report(self.take_errors())
            prepared = prepare()
            fingerprint = savejob.fingerprint(prepared.plan)
            if fingerprint is not None and self.staged is not None and self.staged[0] == fingerprint:
                # A second save of the very same tensors (top-k file, then last.ckpt, in one
                # step): the pool holds (or is receiving) these bytes, and nothing overwrites it
                # while the writer has jobs. Only the (small) metadata differs.
                images = self.staged[1]
                reuse, ticket = begin_incremental(self.tracker, prepared, path, self.options)
                # Every shard not reused must be staged (the same decision against the same
                # checkpoint, unless that one's files went away meanwhile: then stage again).
                if all(s.filename in images or s.filename in reuse for s in prepared.plan.shards):
                    # Incremental: its files are those of the save that staged these images, in
                    # flight or not: the writer takes them from that checkpoint once it committed.
                    def submit_same() -> None:
                        same_as = self.submitted[1] if self.tracker is not None and self.submitted[0] == fingerprint else None
                        self.submit(prepared, path, images, started, reuse=reuse, ticket=ticket, same_as=same_as)

                    self.then(submit_same)
                    return time.perf_counter() - start
            self.drain(block=True)  # the pool is about to be staged again
            self.raise_action_errors()
            if self.worker.busy:
                if self.when_busy == "skip" and can_skip:
                    self.skipped_saves += 1
                    self.refuse_next_removal = True
                    warnings.warn(
                        f"Skipped checkpoint {path!r}: the previous save ({self.worker.in_flight()[0]!r}) is"
                        f" still being written and `when_busy='skip'` ({self.skipped_saves} skipped so far).",
                        stacklevel=4,
                    )
                    return None
                self.worker.wait()
                self.outcomes.report(self.take_errors())
            self.refuse_next_removal = False
            self.staged = None  # the pool is about to be overwritten
            self.stage_and_submit(prepared, path, fingerprint, started)
            return time.perf_counter() - start

    def take_errors(self) -> list[CheckpointWriteError]:
        """The writer's errors; after any, nothing is reused until a save commits whole (a save
        that reuses from the failed one would fail too)."""
        errors = self.worker.take_errors()
        if errors and self.tracker is not None:
            self.tracker.clear()
            self.tickets.clear()
        return errors

    def submit(
        self,
        prepared: Prepared,
        path: str,
        images: dict[str, tuple[int, int]],
        started: float,
        chunked: bool = False,
        reuse: dict[str, Reused] | None = None,
        ticket: Ticket | None = None,
        fingerprint: tuple[Any, ...] | None = None,
        same_as: int | None = None,
    ) -> int:
        """Send the job (without tensor data) and the staged images' offsets to the writer process;
        the destination is resolved here, so a skipped or failed staging leaves no spool behind.
        ``reuse``/``ticket``: see ``begin_incremental``; ``fingerprint``: of the tensors it
        staged; ``same_as``: see ``protocol.SaveRequest``."""
        pool = (self.pool.fd, self.pool.generation)
        destination = Destination.resolve(path, self.options)
        job = prepared.job(destination, with_data=False, reuse=reuse)
        copy_same = self.tracker is not None and self.tracker.copies
        job_id = self.worker.submit_save(
            path, job, images, pool, submitted=started, chunked=chunked, same_as=same_as, copy_same=copy_same
        )
        if fingerprint is not None:
            self.submitted = (fingerprint, job_id)
        if ticket is not None:
            self.tickets[job_id] = ticket
        return job_id

    def stage_and_submit(
        self, prepared: Prepared, path: str, fingerprint: tuple[Any, ...] | None, started: float
    ) -> None:
        # Shards reused from the previous checkpoint hold only unchanged tensors: not staged.
        reuse, ticket = begin_incremental(self.tracker, prepared, path, self.options)
        to_stage = dataclasses.replace(
            prepared.plan, shards=tuple(s for s in prepared.plan.shards if s.filename not in reuse)
        )
        image_layout, headers = staging.layout(to_stage)
        cap = self.pool.max_bytes
        if cap is not None and image_layout.nbytes > cap:
            self.stage_in_chunks(prepared, to_stage, path, image_layout, headers, cap, started, reuse, ticket)
            return
        deferrable = hooks.changed_by_optimizers_only() if self.overlap else lambda _: False
        # Host state whose owner copies it itself (ChunkedAdamW's arena) is left to it: not copied here.
        copies = self.pool.stage(to_stage, image_layout, headers, deferrable, defer_host=True)
        self.staged = None if fingerprint is None else (fingerprint, image_layout.images)

        def submit() -> None:
            self.submit(prepared, path, image_layout.images, started, reuse=reuse, ticket=ticket, fingerprint=fingerprint)

        if copies is None:
            submit()
            return
        # Device copies are still landing in the pool: the writer gets the job once they have (a
        # watcher thread); the host does not wait here. Deferred copies: see ``overlapping``.
        self.copy_waits[path] = copies
        while len(self.copy_waits) > _COPY_WAITS_KEPT:
            self.copy_waits.popitem(last=False)
        self.pending = pending = Pending(copies, [submit])
        threading.Thread(target=self.drain_when_landed, args=(pending,), name="lightning_ckpt-handoff", daemon=True).start()

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` after the pending save's hand-off to the writer (now if none is pending)."""
        if self.pending is not None:
            self.pending.actions.append(action)
        else:
            action()

    def hand_over(self) -> None:
        """An optimizer is about to step (see ``hooks.before_optimizer_step``): order the training
        stream after the pending copies, and hand the save over if they have landed."""
        with self.lock:
            pending = self.pending
            if pending is not None:
                pending.copies.hand_over()
                self.drain(block=False)

    def drain_when_landed(self, pending: Pending) -> None:
        if pending.copies.device is not None:
            torch.cuda.set_device(pending.copies.device)  # see ``Copies.device``
        pending.copies.wait()
        with self.lock:
            if self.pending is pending:
                try:
                    self.drain(block=False)
                except Exception as error:  # raised on the training thread at its next call
                    self.action_errors.append(error)

    def drain(self, block: bool) -> None:
        """Hand the pending save (and what was queued behind it) to the writer once its copies have
        landed; ``block``: wait for them (training thread only: it orders the stream after them)."""
        with self.lock:
            pending = self.pending
            if pending is None:
                return
            if block:
                pending.copies.hand_over()
                pending.copies.wait()
            elif not pending.copies.landed():
                return
            self.pending = None
            errors = []
            for action in pending.actions:  # each runs, whatever an earlier one raised
                try:
                    action()
                except Exception as error:
                    errors.append(error)
            if errors:
                raise errors[0]

    def raise_action_errors(self) -> None:
        """What a removal queued behind a save raised on the watcher thread (e.g. a refused path)."""
        if self.action_errors:
            error, self.action_errors = self.action_errors[0], []
            raise error

    def check_pool(self, largest_image: int) -> None:
        """Refuse a capped pool smaller than ``largest_image`` (the largest shard image the state
        can make: ``staging.largest_image``) now, before the first save fails on it."""
        cap = self.pool.max_bytes
        if cap is not None and cap < largest_image:
            raise ValueError(
                f"`staging_pool_size` ({cap:,} bytes) is smaller than the largest shard this state can make"
                f" (up to {largest_image:,} bytes with `max_shard_size={self.max_shard_size:,}`): the first async save"
                f" would fail. {staging.pool_fix(largest_image)}"
            )

    def prepare_staging(self, nbytes: int, on_device: bool) -> None:
        """Async mode: start the writer process, and allocate the staging pool for a state of
        about ``nbytes`` now and fault it in (and page-lock it, ``on_device``) in the background,
        so the first save neither waits for that nor stalls on it. A later, larger state still
        grows the pool at its save."""
        wanted = int(nbytes * _STAGING_HEADROOM) + _STAGING_SLACK  # headers, 4 KiB alignment, growth
        if self.pool.max_bytes is not None:
            wanted = min(wanted, self.pool.max_bytes)
        with self.lock:
            self.worker.ensure_started()  # its imports (seconds of CPU) run now, not in the first save
            if self.pending is None and not self.worker.busy:  # never under a save in flight
                self.pool.reserve(wanted, pin=on_device)

    def warm_up(self, optimizer: torch.optim.Optimizer) -> None:
        """Before an optimizer step, until done (async mode): start the writer process at the
        process's first step, and at the next one, once ``optimizer`` has state, fault in the
        staging pool for its parameters and state (``prepare_staging``). The first save then
        neither waits for the writer's start-up nor stalls on a fresh pool: Fabric's, or a
        Trainer's without ``ShardedModelCheckpoint`` (which prepares for the whole state itself).
        Under torch.distributed only rank 0 starts its writer, and no pool is prepared: the other
        ranks of a DDP run may never save, and each rank's share of a save is the plan's to know."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not optimizer.state or distributed:  # a first step: the state does not exist yet
            self.warmed = distributed
            # Started once: an optimizer without state (SGD) comes back here every step.
            if self.worker.pid is None and (not distributed or torch.distributed.get_rank() == 0):
                with self.lock:
                    self.worker.ensure_started()
            return
        self.warmed = True
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = staging.optimizer_state_tensors(optimizer)
        nbytes, on_device = staging.staging_need(params + state)
        self.check_pool(staging.largest_image([params, state], self.max_shard_size))
        self.prepare_staging(nbytes, on_device)

    def copy_wait_seconds(self, path: Any) -> float | None:
        """How long the training stream idled (GPU time) for the device copies of the latest async
        save to ``path``: a cost of that save beyond its call. ``None`` until known; 0 for a save
        that queued no device copy of its own."""
        copies = self.copy_waits.get(path)
        return 0.0 if copies is None else copies.waited_seconds()

    def stage_in_chunks(
        self,
        prepared: Prepared,
        to_stage: Plan,
        path: str,
        image_layout: staging.ImageLayout,
        headers: dict[str, Any],
        cap: int,
        started: float,
        reuse: dict[str, Reused],
        ticket: Ticket | None,
    ) -> None:
        """A state larger than ``staging_pool_size``: stage shard by shard through a ring, blocking
        only while the shards that do not fit wait for the writer to free space."""
        largest = max(staging.aligned(size) for _, size in image_layout.images.values())
        if largest > cap:
            raise ValueError(
                f"A shard of {largest:,} bytes does not fit `staging_pool_size` ({cap:,} bytes). {staging.pool_fix(largest)}"
            )
        self.pool.reserve(cap, pin=bool(staging.one_device(to_stage)))
        ring = staging.Ring(cap)
        job_id: int | None = None
        try:
            for shard in to_stage.shards:
                _, size = image_layout.images[shard.filename]
                start = ring.alloc(staging.aligned(size))
                while start is None:
                    if job_id is None or not self.worker.wait_shard_written(job_id):
                        # The writer ended the job (failed or died): report it now, per `on_error`.
                        errors = self.take_errors()
                        ended = CheckpointWriteError(f"Saving {path!r} stopped: the writer ended the job.", path)
                        self.outcomes.report(errors or [ended])
                        return
                    ring.free_oldest()
                    start = ring.alloc(staging.aligned(size))
                self.pool.stage_shard(shard, headers[shard.filename], start)
                copies = self.pool.copies()
                if copies is not None:  # the writer reads this region next
                    copies.hand_over()
                    copies.wait()
                images = {shard.filename: (start, size)}
                if job_id is None:
                    job_id = self.submit(prepared, path, images, started, chunked=True, reuse=reuse, ticket=ticket)
                else:
                    self.worker.send_images(job_id, images)
        except BaseException:
            # Interrupted mid-job (Ctrl-C, a device error, the writer's own failure raised
            # above): the writer may wait for shards that will never come. End it; its job fails
            # and nothing is committed.
            self.pool.discard_copies()
            self.worker.abort()
            raise

    def release_pool(self) -> None:
        """Free the staging pool. Unmapping and freeing gigabytes of shared memory takes a while
        (0.4 s at 3 GB): a host-only pool is unmapped on a thread, so ``teardown`` does not wait
        for it; a page-locked one here (unregistering synchronises with the device)."""
        pool = self.pool
        if pool.pins or pool.nbytes == 0:
            pool.close()
            return
        self.pool = StagingPool(pool.max_bytes)
        self.pool.generation = pool.generation  # the writer tells pools apart by generation
        pool.close(unmap_in_background=True)

    def remove(self, path: str) -> bool:
        """Queue the removal of ``path`` behind the save replacing it; ``True`` when handled here
        (kept, or queued in the writer), ``False`` when the caller removes it now."""
        with self.lock:
            if self.refuse_next_removal:
                self.refuse_next_removal = False
                warnings.warn(f"Kept {path!r}: the save that would have replaced it was skipped.", stacklevel=4)
                return True
            replacing = self.worker.last_save_id
            if self.worker.save_failed(replacing):
                warnings.warn(f"Kept {path!r}: the save that would have replaced it failed.", stacklevel=4)
                return True
            if self.worker.busy:  # runs after that save, and only if it committed
                self.worker.submit_remove(path, after=replacing)
                return True
            return False

    def collect(self) -> None:
        kept, self.worker.kept = self.worker.kept, []
        for path in kept:
            warnings.warn(f"Kept {path!r}: the save that would have replaced it failed.", stacklevel=4)
        results, self.worker.results = self.worker.results, []
        for job_id, result in results:  # ``seconds``: from the save call until durable
            ticket = self.tickets.pop(job_id, None)
            if ticket is not None and self.tracker is not None:
                self.tracker.committed(*ticket[:2], result.stored, *ticket[2:])
            self.outcomes.last_save = result
            self.outcomes.unpolled.append(result)

    def wait(self) -> None:
        """Block until every save in flight is durable; raise (once) what failed."""
        with self.lock:
            self.drain(block=True)
            self.worker.wait()
            self.outcomes.report(self.take_errors())
            self.raise_action_errors()

    def stop(self) -> None:
        """Finish the saves in flight and stop the writer process; raise what failed."""
        with self.lock:
            # Stopped, it warms up no more: the step hook (process-wide) would otherwise restart the
            # writer, or refuse the pool, at any optimizer's next step after this plugin's teardown.
            self.warmed = True
            self.drain(block=True)
            self.worker.stop()
            self.outcomes.report(self.take_errors())

    def finish_at_exit(self) -> None:
        """Interpreter exit: finish the save in flight (a checkpoint the user asked for is not
        dropped), stop the writer process, warn about what failed."""
        try:
            self.drain(block=True)  # a save still waiting for its device copies
            self.worker.stop()
            for error in self.worker.take_errors():
                warnings.warn(str(error), stacklevel=1)
        except Exception:  # exiting anyway; the next run cleans any temporary directory
            self.worker.kill()


@dataclass
class Pending:
    """An async save whose device copies are still landing, and what must follow its hand-off."""

    copies: staging.Copies
    actions: list[Callable[[], None]]  # in order: the submission first, then removals and re-saves


_COPY_WAITS_KEPT = 64
_STAGING_HEADROOM, _STAGING_SLACK = 1.05, 64 * 2**20  # prepare_staging's margin over the estimate


__all__ = ["AsyncOptions", "AsyncSaver", "Pending"]
