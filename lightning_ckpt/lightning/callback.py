"""``ShardedModelCheckpoint``: Lightning's ``ModelCheckpoint`` without avoidable collectives,
with compile-safe state dicts, memory release after each save, and self-measurement.

Which ranks run what: every hook runs on every rank (Lightning's contract for callbacks); the
checkpoint bytes are written by the CheckpointIO on global rank 0 only. Decisions every rank can
take alike are taken locally:

* the version counter's "does this file exist" uses a rank-consistent record of known checkpoint
  paths (rank 0's listing of ``dirpath``, as deep as the ``filename`` template reaches, broadcast
  once at every ``setup``, then updated identically on every rank by each save and removal)
  instead of a filesystem probe plus a collective;
* the top-k decision is local when the monitored value is the same on every rank: logged with
  ``sync_dist=True`` (and not ``rank_zero_only``), a torchmetrics ``Metric``, ``epoch``/``step``,
  or a single process. Otherwise it falls back to Lightning's all-reduce;
* ``save_last="link"`` links without a barrier;
* ``train_time_interval`` with several ranks (one process runs Lightning's own trigger, whose
  broadcast is free there): rank 0 decides at scheduled check steps only, and broadcasts the
  decision together with the number of steps until the next check, planned from the measured
  step time so that the check lands before the deadline even if steps become
  ``schedule.SLOWDOWN_TOLERANCE`` times slower (``schedule.TimeSchedule``).

A *save step* is one hook call (``on_train_batch_end``, ``on_validation_end``, ...) that writes
one or more files (the top-k file, ``last.ckpt``). In one process each file is saved through
``Trainer.save_checkpoint``, as ``ModelCheckpoint`` does (users, loggers and other callbacks wrap
it; its barrier is a no-op there). With several ranks its barrier (one per file) is not run:
nothing on the other ranks reads a checkpoint before the next stage's setup, whose own
collectives order it after rank 0's write. When the IO can skip a save
(``ShardedCheckpointIO(async_save=True, when_busy="skip")``) the step ends with one collective,
a broadcast telling every rank whether rank 0's IO skipped one. A skipped save, and the saves
after it in the same step, are undone on every rank: the bookkeeping (``best_k_models``,
``best_model_path``, ``last_model_path``, ...) is restored to what it was before and nothing is
removed, so the callback's state is as if they had not been requested.
"""

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Optional, Union
from weakref import proxy

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from rich.console import Console
from typing_extensions import override

from lightning_ckpt.compile import install_load_hook, strip_compiled_prefixes
from lightning_ckpt.errors import CheckpointWriteError
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.lightning.monitor import LoadRecord
from lightning_ckpt.lightning.plugin import CheckpointIOFeatures, ShardedCheckpointIO
from lightning_ckpt.lightning.records import SaveRecorder, features, saves_async
from lightning_ckpt.lightning.release import (
    DEFAULT_RELEASE_THRESHOLD_MB,
    EmptyCudaCache,
    MemoryReleaser,
    MemoryStats,
    memory_stats,
    release_mode,
)
from lightning_ckpt.lightning.resume import listing
from lightning_ckpt.lightning.schedule import TimeSchedule
from lightning_ckpt.lightning.strategies import (
    collective_restores,
    enable_sharded_checkpoints,
    end_collective_restores,
    prepare_staging,
    restored_load,
    save_from_ranks,
    sharded_io,
)
from lightning_ckpt.remote import is_remote, url_key
from lightning_ckpt.store.commit import link_checkpoint, unwritable

# Checkpoint paths known to exist, per folder (see the module docstring); shared by instances
# saving into the same folder, and reset from the filesystem at every ``setup``.
_RECORDS: dict[str, set[str]] = {}

# ModelCheckpoint's save bookkeeping: what a skipped save must leave untouched.
_BOOKKEEPING = (
    "best_k_models",
    "kth_best_model_path",
    "kth_value",
    "best_model_path",
    "best_model_score",
    "current_score",
    "last_model_path",
    "_last_global_step_saved",
    "_last_checkpoint_saved",
)


@dataclass(frozen=True)
class _Snapshot:
    """The bookkeeping and the record of known paths just before a save attempt."""

    values: dict[str, Any]
    known: frozenset[str]


class ShardedModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` with the same options and the same kept checkpoints, plus:

    Args:
        release_memory: what to release after each save (after staging, for async saves).
            ``"auto"`` (default; ``True`` too): measure the freed heap the save left behind and
            ``malloc_trim`` it on a background thread when it is at least ``release_threshold_mb``
            (or the host is short of memory); the CUDA cache per ``empty_cuda_cache``.
            ``"always"``: ``gc.collect()``, the CUDA cache per ``empty_cuda_cache`` and
            ``malloc_trim(0)`` after every save, on the training thread (the behaviour before
            ``"auto"``). ``"never"`` (``False``): nothing. What was left, released, skipped and
            why is recorded. The async staging pool is never released. See ``lightning_ckpt.lightning.release``.
        empty_cuda_cache: ``"on_pressure"`` (default): empty the CUDA caching allocator's cache
            only when it retried or failed an allocation since the previous save (the cache is
            the next step's memory otherwise, and emptying it slows that step down); ``"always"``;
            ``"never"``. See ``lightning_ckpt.lightning.release``.
        slowdown_window: steps before/after a save compared for the post-save slowdown.
        metrics_file: JSON-lines file in the first logger's run folder (``trainer.log_dir``), to
            which each ``fit`` appends one line with every save's record and the step times;
            ``None`` to skip. Without a logger nothing is written (``save_records`` still holds
            them), and never anything but checkpoints in ``dirpath``.
        plot: also write ``ckpt_step_times.png`` (step time with saves marked) to the run folder
            if matplotlib is installed.
        compile_safe: save state-dict keys without ``_orig_mod.`` and let the module load keys in
            either form, so checkpoints move between compiled and uncompiled models.
        release_threshold_mb: the freed heap (MB, 1e6 bytes) a save must leave behind for
            ``release_memory="auto"`` to trim it.

    Every other argument is ``ModelCheckpoint``'s, with the same meaning; ``verbose=True`` also
    prints a line per save and a summary table at the end of fit. Metrics are logged as
    ``ckpt/...`` through the trainer's loggers; ``save_records`` holds them as data.
    """

    def __init__(
        self,
        dirpath: Optional[_PATH] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        verbose: bool = False,
        save_last: Optional[Union[bool, Literal["link"]]] = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[timedelta] = None,
        every_n_epochs: Optional[int] = None,
        save_on_train_epoch_end: Optional[bool] = None,
        enable_version_counter: bool = True,
        release_memory: Union[bool, Literal["auto", "always", "never"]] = "auto",
        empty_cuda_cache: EmptyCudaCache = "on_pressure",
        slowdown_window: int = 20,
        metrics_file: Optional[str] = "ckpt_metrics.jsonl",
        plot: bool = False,
        compile_safe: bool = True,
        release_threshold_mb: float = DEFAULT_RELEASE_THRESHOLD_MB,
    ) -> None:
        super().__init__(
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=save_top_k,
            save_on_exception=save_on_exception,
            save_weights_only=save_weights_only,
            mode=mode,
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
        )
        self._releaser = MemoryReleaser(release_mode(release_memory), empty_cuda_cache, release_threshold_mb)
        if not isinstance(slowdown_window, int) or slowdown_window < 1:
            raise ValueError(f"`slowdown_window={slowdown_window!r}` must be a positive number of steps.")
        self.release_memory = self._releaser.mode
        self.empty_cuda_cache = empty_cuda_cache
        self.release_threshold_mb = release_threshold_mb
        self._memory_after_save: MemoryStats | None = None  # allocator counters at the previous save
        self._staging_prepared = False  # once per fit (see ``strategies.prepare_staging``)
        self.load_record: Optional[LoadRecord] = None  # the load of the run's restore (``_restored``)
        self._overlap = False  # inside ``_between_steps``
        self.metrics_file = metrics_file
        self.plot = plot
        self.compile_safe = compile_safe
        self._recorder = SaveRecorder(slowdown_window)  # rank 0's records of the saves
        self._known: set[str] = set()
        self._load_hook: Any = None
        # The triggers as configured: on_train_batch_end toggles the live ones for one call.
        self._configured_triggers = (self._every_n_train_steps, self._train_time_interval)
        # Time trigger (see the module docstring): identical on every rank except the clocks.
        self._schedule = TimeSchedule()
        # The save step in progress (see the module docstring); identical on every rank except
        # ``_skipped_at``, which only rank 0 knows until the step's broadcast.
        self._in_save_step = False
        self._attempts: list[_Snapshot] = []
        self._pending: _Snapshot | None = None
        self._skipped_at: int | None = None

    # ------------------------------------------------------------------------------ collectives

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        # The rank-consistent record of existing checkpoints, from the filesystem (never from an
        # earlier run's memory): one broadcast here, none per save.
        known = self._listing(trainer) if trainer.is_global_zero else []
        # A folder checkpoints cannot be written to fails the fit now, not a save interval later (rank
        # 0's probe; ranks that write parts probe too). The same broadcast carries the name
        # multi-rank saves give their shared folders.
        problem = self._unwritable(trainer, stage) if trainer.is_global_zero else None
        known, token, problem = trainer.strategy.broadcast((known, secrets.token_hex(8), problem))
        io = sharded_io(trainer.strategy)
        if problem is None and io is not None and not trainer.is_global_zero:
            problem = self._unwritable(trainer, stage)
        if problem is not None:
            raise CheckpointWriteError(problem, os.fspath(self.dirpath or ""))
        if io is not None:
            io.use_part_token(token)
        plugin = features(trainer.strategy.checkpoint_io)
        if plugin is not None:  # frozen weights in shards of their own, for incremental saves
            plugin.track_frozen(pl_module)
        # Every rank runs the restore that follows: its load may read once (``read_once``).
        collective_restores(trainer)
        # Before the strategy restores (Trainer._run: callbacks' setup, then strategy.setup, then the
        # restore): a stock ModelParallelStrategy / FSDPStrategy resumes from our checkpoints.
        enable_sharded_checkpoints(trainer.strategy)
        self._staging_prepared = False
        # One record per folder, shared by every checkpoint callback saving there (as the
        # filesystem would be).
        record = _RECORDS.setdefault(os.path.normpath(os.fspath(self.dirpath or "")), set())
        record.clear()
        record.update(known)
        self._known = record
        if self.compile_safe and self._load_hook is None:
            self._load_hook = install_load_hook(pl_module)

    def _unwritable(self, trainer: pl.Trainer, stage: str) -> str | None:
        """Why this fit's checkpoints cannot be saved in the local ``dirpath`` (``writer.unwritable``)."""
        saves = self.save_top_k != 0 or bool(self.save_last)
        if stage != TrainerFn.FITTING or not saves or self.dirpath is None or is_remote(self.dirpath):
            return None
        return unwritable(self.dirpath)

    def _listing(self, trainer: pl.Trainer) -> list[str]:
        """What ``dirpath`` holds, as deep as the file name templates reach; a URL listed with the
        plugin's storage options when it is ours."""
        io = trainer.strategy.checkpoint_io
        return listing(self.dirpath, self._template_depth(), io.remote if isinstance(io, ShardedCheckpointIO) else None)

    def _template_depth(self) -> int:
        """How many folders below ``dirpath`` the file name templates reach (``"{epoch}/model"``: 1)."""
        templates = (self.filename or "", self.CHECKPOINT_NAME_LAST or "")
        return max(template.replace(os.sep, "/").count("/") for template in templates)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        end_collective_restores(trainer)
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None
        super().teardown(trainer, pl_module, stage)

    @property
    @override
    def state_key(self) -> str:
        # ModelCheckpoint's key, so the callback state moves between the two classes (switch to
        # this one and resume with the top-k record intact), built from the configured triggers
        # (on_train_batch_end toggles the live trigger attributes for one call).
        every_n_train_steps, train_time_interval = self._configured_triggers
        config = dict(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=train_time_interval,
        )
        return f"{ModelCheckpoint.__qualname__}{config!r}"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._restored(trainer)
        self._schedule.start()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restored(trainer)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restored(trainer)

    def _restored(self, trainer: pl.Trainer) -> None:
        """After the Trainer's restore: its load (if any) is ``load_record``, logged once (by the
        first callback here) as ``ckpt/load_s``, ``ckpt/load_gbps`` and ``ckpt/load_read_gb``."""
        record, first = restored_load(trainer)
        if record is None:
            return
        self.load_record = record
        if not first:
            return
        if self.verbose and trainer.is_global_zero:
            Console(soft_wrap=True).print(record.line())
        for logger in trainer.loggers:
            logger.log_metrics(record.metrics(), step=trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        interval = self._train_time_interval
        if not self._staging_prepared and trainer.global_step > 0:
            self._staging_prepared = True  # after the first optimizer step: its state exists now
            prepare_staging(trainer, pl_module)
        with self._save_step(trainer), self._between_steps(trainer):
            if interval is None or trainer.world_size == 1:  # one process: Lightning's broadcast is free
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
                return
            # Lightning's time trigger broadcasts every batch. Decide here instead, then let
            # Lightning run its step-trigger path (every_n_train_steps=1) for the steps that save.
            save_now = self._time_to_save(trainer, interval.total_seconds())
            self._train_time_interval, self._every_n_train_steps = None, 1 if save_now else 0
            try:
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            finally:
                self._train_time_interval, self._every_n_train_steps = interval, 0

    def _time_to_save(self, trainer: pl.Trainer, interval: float) -> bool:
        """Rank-consistent time decision, communicating only on scheduled check steps."""
        return self._schedule.due(interval, trainer.is_global_zero, trainer.world_size, trainer.strategy.broadcast)

    @override
    def file_exists(self, filepath: _PATH, trainer: pl.Trainer) -> bool:
        """Rank-consistent answer from the record of known checkpoints (no collective)."""
        return os.path.normpath(os.fspath(filepath)) in self._known

    @override
    def check_monitor_top_k(self, trainer: pl.Trainer, current: Optional[torch.Tensor] = None) -> bool:
        if current is None or not self._monitor_is_rank_consistent(trainer):
            return super().check_monitor_top_k(trainer, current)
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        monitor_op = {"min": torch.lt, "max": torch.gt}[self.mode]
        return bool(monitor_op(current, self.best_k_models[self.kth_best_model_path]))

    def _monitor_is_rank_consistent(self, trainer: pl.Trainer) -> bool:
        """Is the monitored value the same on every rank? Detected from how it was logged."""
        if trainer.world_size == 1 or self.monitor in ("epoch", "step"):
            return True
        for collection in _result_collections(trainer):
            for result in collection.values():
                meta = getattr(result, "meta", None)
                if meta is None or meta.name != self.monitor:
                    continue
                if not result.is_tensor:
                    # A torchmetrics Metric: synced when computed at epoch level, or on every step
                    # if it was built with dist_sync_on_step=True; a step value is rank-local.
                    return bool(getattr(result.value, "dist_sync_on_step", False) or not meta.on_step)
                return bool(meta.sync.should and not meta.sync.rank_zero_only)
        return False

    @staticmethod
    @override
    def _link_checkpoint(trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        # As Lightning's, without the barrier: the link is only read by a later resume.
        # The new link is made under a temporary name and swapped in atomically, so there is
        # always a complete last.ckpt (the old one until the swap).
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            link_checkpoint(filepath, os.path.abspath(linkpath))

    # ------------------------------------------------------------------ save steps and skips

    @contextmanager
    def _save_step(self, trainer: pl.Trainer, collective: bool = True) -> Iterator[None]:
        """Bracket one hook's saves; close them with the step's one collective (if any save ran).

        Nested brackets (a hook calling another bracketed method) join the outer one.
        """
        if self._in_save_step:
            yield
            return
        self._in_save_step, self._attempts, self._pending, self._skipped_at = True, [], None, None
        try:
            yield
            if not self._attempts:
                return  # no save: no collective
            skipped_at = self._skipped_at
            if collective and trainer.world_size > 1 and _can_skip(trainer.strategy.checkpoint_io):
                skipped_at = trainer.strategy.broadcast(skipped_at)
            if skipped_at is not None:
                self._restore(self._attempts[skipped_at])
        finally:
            self._in_save_step, self._attempts, self._pending, self._skipped_at = False, [], None, None
            self._releaser.start_pending()  # after the step's saves, off the training thread

    def _snapshot(self) -> _Snapshot:
        values = {name: getattr(self, name) for name in _BOOKKEEPING}
        values["best_k_models"] = dict(self.best_k_models)
        return _Snapshot(values, frozenset(self._known))

    def _restore(self, snapshot: _Snapshot) -> None:
        for name, value in snapshot.values.items():
            setattr(self, name, dict(value) if name == "best_k_models" else value)
        self._known.clear()
        self._known.update(snapshot.known)

    @override
    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        with self._save_step(trainer):
            if self._skipped_at is not None:
                return  # rank 0: an earlier save of this step was skipped, and so is this one
            self._pending = self._snapshot()  # before ModelCheckpoint updates its bookkeeping
            super()._save_topk_checkpoint(trainer, monitor_candidates)
            self._pending = None

    @override
    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        with self._save_step(trainer):
            if self._skipped_at is not None:
                return  # rank 0: as above (and never link to a skipped checkpoint)
            self._pending = self._snapshot()
            super()._save_last_checkpoint(trainer, monitor_candidates)
            self._pending = None
            if self.last_model_path and self._skipped_at is None:  # saved or linked: it exists now
                self._known.add(os.path.normpath(self.last_model_path))

    @override
    def _should_remove_checkpoint(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        if not is_remote(previous):
            return super()._should_remove_checkpoint(trainer, previous, current)
        # Lightning 2.6 answers True for any remote `previous` (Lightning issue #21813): a run
        # resuming into a new dirpath deleted the previous run's checkpoints, the one it resumed
        # from included. The two guards it applies to local paths, on URLs: never the checkpoint
        # the trainer resumed from, never one outside this callback's dirpath.
        key = url_key(previous)
        if key == url_key(current):
            return False
        if trainer.ckpt_path is not None and is_remote(trainer.ckpt_path) and key == url_key(trainer.ckpt_path):
            return False
        return self.dirpath is not None and is_remote(self.dirpath) and key.startswith(url_key(self.dirpath) + "/")

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if self._skipped_at is not None:
            return  # rank 0: the save that would have replaced it was skipped; keep it
        super()._remove_checkpoint(trainer, filepath)
        self._known.discard(os.path.normpath(filepath))

    # ----------------------------------------------------------------------- ckpt_path="last"

    @override
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """Lightning's ``last`` checkpoints in this callback's folder (its contract, unchanged);
        for ``ckpt_path="last"`` in a local folder the plugin is told to load the newest checkpoint
        there that is committed and intact instead, skipping damaged ones with a warning naming the
        damaged file and the one used (``ShardedCheckpointIO.resume_last``).

        Lightning resolves the path on every rank before any process group exists, so no
        collective is possible; none is needed (see ``resume``).
        """
        found = super()._find_last_checkpoints(trainer)
        io = trainer.strategy.checkpoint_io
        if found and not is_remote(os.path.dirname(min(found))) and isinstance(io, CheckpointIOFeatures):
            io.resume_last(found, self._template_depth())
        return found

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        # The plugin loaded an older checkpoint than the one resolved (it failed verification):
        # the run resumed from that one, which must never be removed as outdated by this run.
        io = features(trainer.strategy.checkpoint_io)
        instead = None if io is None else io.loaded_instead
        if instead is not None and trainer.ckpt_path is not None and os.fspath(trainer.ckpt_path) == instead[0]:
            # Not the public setter: it would also mark the path as user-set for the next ``fit``.
            trainer._checkpoint_connector._ckpt_path = instead[1]

    # ------------------------------------------------------------------------ compile safety

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.compile_safe and "state_dict" in checkpoint:
            checkpoint["state_dict"] = strip_compiled_prefixes(checkpoint["state_dict"])

    # ------------------------------------------------------------------- saving and measuring

    @override
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        with self._save_step(trainer):
            self._attempts.append(self._pending or self._snapshot())
            self._pending = None
            if self._skipped_at is not None:
                return
            io = features(trainer.strategy.checkpoint_io)
            skipped_before = 0 if io is None else io.skipped_saves
            self._releaser.before_save()  # no heap trim runs during a save
            before = memory_stats()
            start = time.perf_counter()
            with io.overlapping() if io is not None and self._overlap else contextlib.nullcontext():
                save_from_ranks(trainer, filepath, self.save_weights_only)
            stall = time.perf_counter() - start
            after = memory_stats()  # with ``before``: what the save call left behind
            if trainer.is_global_zero and io is not None and io.skipped_saves != skipped_before:
                self._skipped_at = len(self._attempts) - 1  # undone on every rank at the step's end
                return
            self._last_global_step_saved = trainer.global_step
            self._last_checkpoint_saved = filepath
            self._known.add(os.path.normpath(filepath))
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.after_save_checkpoint(proxy(self))
            release = self._releaser.after_save(before, after, self._memory_after_save)
            if trainer.is_global_zero:
                self._recorder.record(trainer, filepath, stall, before, release, self._memory_after_save, self.verbose)
            self._memory_after_save = release.after

    @contextmanager
    def _between_steps(self, trainer: pl.Trainer) -> Iterator[None]:
        """Saves in this hook are followed by a training step before anything else may change the
        weights: the plugin may overlap their device copies with it (``overlapping``)."""
        self._overlap = _training_step_follows(trainer)
        try:
            yield
        finally:
            self._overlap = False

    @property
    def save_records(self) -> list[dict[str, Any]]:
        """Every save's measurements, as plain data (rank 0; empty elsewhere)."""
        return [r.as_dict() for r in self._recorder.monitor.records]

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._recorder.step_started(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restored(trainer)  # trainer.validate(ckpt_path=...) restored before this
        self._recorder.monitor.pause(time.perf_counter())  # validation time is not a training step

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._save_step(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._save_step(trainer):
            super().on_validation_end(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        _explain_directory_error(exception)
        # No collective: the exception may have been raised on this rank alone.
        with self._save_step(trainer, collective=False):
            super().on_exception(trainer, pl_module, exception)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with self._save_step(trainer):
            super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero:
            self._recorder.finish(trainer, self._releaser, self.verbose, self.dirpath, self.metrics_file, self.plot)


def _training_step_follows(trainer: pl.Trainer) -> bool:
    """In ``on_train_batch_end``: is the next thing to run another training step (not validation,
    not the end of the epoch or of training)? Then nothing but ``optimizer.step()`` changes the
    weights before that step's optimizer step. Any doubt (Lightning internals changed): ``False``."""
    try:
        epoch_loop = trainer.fit_loop.epoch_loop
        if trainer.should_stop or epoch_loop.batch_progress.is_last_batch or epoch_loop.done:
            return False
        return not epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
    except Exception:
        return False


def _can_skip(io: Any) -> bool:
    """Can this IO skip a save (so rank 0 must tell the other ranks)? Configured alike on every rank."""
    return saves_async(io) and io.when_busy == "skip"


def _explain_directory_error(exception: BaseException) -> None:
    """A lightning_ckpt directory read by an IO that expects a file (``ckpt_path=`` given to a
    Trainer without the plugin) raises a bare ``IsADirectoryError``: say what it is and how to
    load it, keeping the exception's type."""
    path = getattr(exception, "filename", None)
    if not isinstance(exception, IsADirectoryError) or not isinstance(path, (str, os.PathLike)):
        return
    if os.path.isfile(os.path.join(path, fmt.MANIFEST_FILE)) and "lightning_ckpt" not in str(exception.strerror):
        exception.strerror = (
            f"{exception.strerror}: a lightning_ckpt checkpoint directory, which the Trainer's CheckpointIO cannot"
            " read. Add the plugin, `Trainer(plugins=[lightning_ckpt.ShardedCheckpointIO()])`; outside a Trainer use"
            " `lightning_ckpt.load_from_checkpoint(Model, path)`, or convert it with"
            " `python -m lightning_ckpt convert DIR FILE.ckpt`"
        )


def _result_collections(trainer: pl.Trainer) -> list[Any]:
    """Lightning's logged-metric collections of the training and validation loops."""
    epoch_loop = trainer.fit_loop.epoch_loop
    collections = [getattr(epoch_loop, "_results", None), getattr(getattr(epoch_loop, "val_loop", None), "_results", None)]
    return [c for c in collections if c is not None]
