"""The callback's measurement of its saves (global rank 0): one ``SaveRecord`` per save, the
figures that become known later filled in (durability from the writer, the device-copy wait a
step later, a background heap trim), metrics logged through the trainer's loggers, and at the
end of fit the summary and the run folder's metrics file and plot.
"""

from __future__ import annotations

import os
import time
from typing import Any, TypeGuard

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from rich.console import Console

from lightning_ckpt.lightning.monitor import (
    SaveMonitor,
    SaveRecord,
    print_summary,
    save_line,
)
from lightning_ckpt.lightning.plugin import CheckpointIOFeatures, location
from lightning_ckpt.lightning.release import (
    HeapTrim,
    MemoryReleaser,
    MemoryStats,
    SaveRelease,
)


def features(io: Any) -> CheckpointIOFeatures | None:
    """``io`` when it is ``ShardedCheckpointIO`` (or has all it offers), else ``None`` (Lightning's own)."""
    return io if isinstance(io, CheckpointIOFeatures) else None


def saves_async(io: Any) -> TypeGuard[CheckpointIOFeatures]:
    """Does ``io`` save asynchronously (through the features the callback uses)?"""
    return isinstance(io, CheckpointIOFeatures) and bool(io.async_save)


class SaveRecorder:
    """Rank 0's records of one callback's saves, and the figures still awaited for them."""

    def __init__(self, slowdown_window: int) -> None:
        self.monitor = SaveMonitor(window=slowdown_window)
        self._awaiting_trim: list[tuple[HeapTrim, SaveRecord]] = []  # background trims not done yet
        self._awaiting_durable: list[tuple[str, SaveRecord]] = []
        self._awaiting_copy_wait: list[tuple[str, SaveRecord]] = []

    def __eq__(self, other: object) -> bool:
        # By value, as ``MemoryReleaser``: the callback holding it pickles and compares as ``ModelCheckpoint``.
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # type: ignore[assignment]

    def record(
        self,
        trainer: pl.Trainer,
        filepath: str,
        stall: float,
        before: MemoryStats,
        release: SaveRelease,
        previous: MemoryStats | None,
        verbose: bool,
    ) -> None:
        """Record a save that just returned after ``stall`` seconds; ``previous``: the allocator
        counters at the previous save."""
        after = release.after
        io = trainer.strategy.checkpoint_io
        nbytes, durable, reused = _written(io, filepath, stall)
        waits_copies = saves_async(io)
        record = SaveRecord(
            index=len(self.monitor.records),
            path=filepath,
            global_step=trainer.global_step,
            step_index=len(self.monitor.step_times),
            call_s=stall,
            release_s=release.seconds,
            nbytes=nbytes,
            reused_bytes=reused,  # of ``nbytes``, reused from an earlier checkpoint (incremental saves)
            durable_s=durable,
            host_rss_before=before.host_rss,
            host_rss_after=after.host_rss,
            cuda_reserved_before=before.cuda_reserved,
            cuda_reserved_after=after.cuda_reserved,
            cuda_cache_emptied=release.cuda_cache_emptied,
            copy_wait_s=None if waits_copies else 0.0,
            cuda_fragmentation=before.cuda_fragmentation,
            cuda_alloc_retries=before.cuda_alloc_retries - (previous.cuda_alloc_retries if previous else 0),
            heap_left_bytes=release.heap_left,
            release_skipped=release.skipped,
            release_reason=release.reason,
            released_bytes=release.released,
        )
        self.monitor.add(record)
        if release.trim is not None:
            self._awaiting_trim.append((release.trim, record))
        if durable is None:
            self._awaiting_durable.append((location(filepath), record))
        if waits_copies:  # keyed as the IO keys them: a URL as it is, a local path absolute
            self._awaiting_copy_wait.append((location(filepath), record))
        _log(trainer, record)
        if verbose:
            Console(soft_wrap=True).print(save_line(record))

    def step_started(self, trainer: pl.Trainer) -> None:
        """A training step begins: close the previous one and log what became known meanwhile."""
        closed = self.monitor.on_step_start(time.perf_counter())
        if trainer.is_global_zero:
            for record in closed + self._newly_durable(trainer) + self._copy_waits_known(trainer) + self._trims_done():
                _log(trainer, record)

    def finish(
        self,
        trainer: pl.Trainer,
        releaser: MemoryReleaser,
        verbose: bool,
        dirpath: Any,
        metrics_file: str | None,
        plot: bool,
    ) -> None:
        """End of fit (rank 0): wait for the last figures, log them, print the summary
        (``verbose``), and write ``metrics_file`` and the plot into the run folder, unless it is
        the checkpoint folder ``dirpath``."""
        io = trainer.strategy.checkpoint_io
        if self._awaiting_durable and isinstance(io, CheckpointIOFeatures):
            io.wait()  # final durability figures
        releaser.wait()  # the last trim's figures (a trim takes milliseconds)
        if torch.cuda.is_initialized():
            # The copy waits' timing events are on the training stream, which nothing above
            # waited for: without this the last save's wait could stay unknown.
            torch.cuda.synchronize()
        for record in self.monitor.finish() + self._newly_durable(trainer) + self._copy_waits_known(trainer) + self._trims_done():
            _log(trainer, record)
        if not self.monitor.records:
            return
        if verbose:
            print_summary(self.monitor.records)
        run_dir = _run_dir(trainer)
        if run_dir is None or (dirpath is not None and os.path.abspath(run_dir) == os.path.abspath(dirpath)):
            return  # no run folder, or it is the checkpoint folder: nothing but checkpoints there
        if metrics_file:
            self.monitor.append_jsonl(os.path.join(run_dir, metrics_file))
        if plot:
            self.monitor.plot(os.path.join(run_dir, "ckpt_step_times.png"))

    def _newly_durable(self, trainer: pl.Trainer) -> list[SaveRecord]:
        io = trainer.strategy.checkpoint_io
        if not self._awaiting_durable or not isinstance(io, CheckpointIOFeatures):
            return []
        done = []
        for result in io.poll():  # in completion order, which is submission order
            path = location(result.path)
            match = next((i for i, (p, _) in enumerate(self._awaiting_durable) if p == path), None)
            if match is not None:
                _, record = self._awaiting_durable.pop(match)
                record.nbytes, record.durable_s, record.reused_bytes = result.nbytes, result.seconds, result.reused_bytes
                done.append(record)
        return done

    def _trims_done(self) -> list[SaveRecord]:
        """Records whose background heap trim finished since the last look."""
        done, running = [], []
        for trim, record in self._awaiting_trim:
            (done if trim.done() else running).append((trim, record))
        self._awaiting_trim = running
        for trim, record in done:
            record.released_bytes, record.background_trim_s = trim.released, trim.seconds
        return [record for _, record in done]

    def _copy_waits_known(self, trainer: pl.Trainer) -> list[SaveRecord]:
        """Records whose device-copy wait became known (measured on the GPU a step after the save)."""
        io = trainer.strategy.checkpoint_io
        known, waiting = [], []
        for path, record in self._awaiting_copy_wait:
            record.copy_wait_s = io.copy_wait_seconds(path)
            (waiting if record.copy_wait_s is None else known).append((path, record))
        self._awaiting_copy_wait = waiting
        return [record for _, record in known]


def _log(trainer: pl.Trainer, record: SaveRecord) -> None:
    metrics = record.metrics()
    # A strategy that accounts device memory (ChunkedOffloadStrategy) logs it with each save.
    memory_stats = getattr(trainer.strategy, "memory_stats", None)
    if callable(memory_stats):
        metrics.update({f"offload/{key}": float(value) for key, value in memory_stats().items()})
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _written(io: Any, filepath: str, stall: float) -> tuple[int | None, float | None, int | None]:
    """(bytes, seconds until durable, of those bytes reused) of a save that just returned, where
    the IO can tell."""
    if saves_async(io):
        return None, None, None  # known once the writer process reports it (see ``poll``)
    found = features(io)
    last = None if found is None else found.last_save
    if last is not None and os.path.abspath(last.path) == os.path.abspath(filepath):
        return last.nbytes, last.seconds, last.reused_bytes  # ShardedCheckpointIO, synchronous
    if isinstance(io, AsyncCheckpointIO):
        # Its thread writes after the call returned and reports nothing: a file there now is an
        # earlier save's (last.ckpt) or a partial one, neither this save's size nor its durability.
        return None, None, None
    if os.path.isfile(filepath):  # Lightning's TorchCheckpointIO: written when save returned
        return os.path.getsize(filepath), stall, 0
    return None, None, None


def _run_dir(trainer: pl.Trainer) -> str | None:
    """The first logger's run folder, as ``trainer.log_dir`` finds it but on this rank alone (the
    property broadcasts; rank 0 calls this); ``None`` without a logger (Lightning then writes no
    run files either)."""
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    folder = logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger)) else logger.save_dir
    return None if folder is None else os.fspath(folder)
