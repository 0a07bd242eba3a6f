"""ShardedModelCheckpoint with a real Trainer: same checkpoints as ModelCheckpoint, metrics, memory."""

from __future__ import annotations

import csv
import gc
import json
import os
from datetime import timedelta

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from models import STEPS_PER_EPOCH, TinyRegressor, trainer_kwargs

import lightning_ckpt as lc
from lightning_ckpt.lightning.release import _malloc_trim, heap_free_bytes

CONFIGS = [
    dict(monitor="train_loss", mode="min", save_top_k=2, every_n_train_steps=1, save_last=True),
    dict(monitor="train_loss", mode="max", save_top_k=2, every_n_train_steps=1),
    dict(monitor="train_loss", mode="min", save_top_k=1, every_n_train_steps=2, save_last="link"),
    dict(monitor="train_loss", mode="min", save_top_k=-1, every_n_train_steps=3),
    dict(monitor=None, save_top_k=1, every_n_train_steps=2, save_last=True),
    dict(monitor="train_loss", save_top_k=3, every_n_epochs=1, save_last=True),
    # A fixed file name: every save collides, so the version counter (file_exists) decides names.
    dict(monitor="train_loss", filename="ckpt", save_top_k=-1, every_n_train_steps=2, save_last=True),
    dict(monitor=None, filename="ckpt", save_top_k=-1, every_n_train_steps=1, enable_version_counter=False),
]


def _run(callback_cls, dirpath, config, epochs=3, **trainer_overrides):
    seed_everything(0, workers=True)
    callback = callback_cls(dirpath=dirpath, **config)
    trainer = Trainer(
        max_epochs=epochs,
        callbacks=[callback],
        plugins=[lc.ShardedCheckpointIO()],
        **trainer_kwargs(**trainer_overrides),
    )
    trainer.fit(TinyRegressor())
    return trainer, callback


def _kept(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_keeps_the_same_checkpoints_as_model_checkpoint(config, tmp_path):
    _, stock = _run(ModelCheckpoint, tmp_path / "stock", config)
    _, ours = _run(lc.ShardedModelCheckpoint, tmp_path / "ours", config)
    assert _kept(tmp_path / "ours") == _kept(tmp_path / "stock")
    assert os.path.basename(ours.best_model_path) == os.path.basename(stock.best_model_path)
    assert os.path.basename(ours.last_model_path) == os.path.basename(stock.last_model_path)
    assert sorted(map(os.path.basename, ours.best_k_models)) == sorted(map(os.path.basename, stock.best_k_models))
    if config.get("save_last") == "link":
        assert os.path.islink(tmp_path / "ours" / "last.ckpt")


def test_records_metrics_through_the_loggers(tmp_path):
    logger = CSVLogger(tmp_path / "logs", name="run", version=0)
    seed_everything(0)
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1, slowdown_window=2)
    trainer = Trainer(
        max_epochs=3, callbacks=[callback], plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs(logger=logger)
    )
    trainer.fit(TinyRegressor())
    records = callback.save_records
    assert len(records) == 3 * STEPS_PER_EPOCH // 2
    for record in records:
        assert record["stall_s"] > 0 and record["nbytes"] > 0 and record["durable_s"] > 0
        assert record["host_rss_after"] > 0
    closed = [r for r in records if r["slowdown"] is not None]
    assert closed and all(r["pre_step_median_s"] > 0 and r["recovery_steps"] >= 0 for r in closed)
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    logged = {k for row in rows for k, v in row.items() if v not in ("", None)}
    for name in ("ckpt/stall_s", "ckpt/bytes_gb", "ckpt/durable_s", "ckpt/write_gbps", "ckpt/host_rss_after_gb",
                 "ckpt/post_save_slowdown", "ckpt/post_save_recovery_steps"):
        assert name in logged, name
    (line,) = (tmp_path / "logs" / "run" / "version_0" / "ckpt_metrics.jsonl").read_text().splitlines()
    saved = json.loads(line)
    assert len(saved["saves"]) == len(records) and len(saved["step_times_s"]) >= 3 * STEPS_PER_EPOCH - 1


def test_a_resume_logs_its_load(tmp_path, capsys):
    seed_everything(0)
    first = lc.ShardedModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{step}", every_n_train_steps=2)
    Trainer(max_steps=2, callbacks=[first], plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs()).fit(TinyRegressor())
    assert first.load_record is None  # nothing was restored
    saved = str(tmp_path / "ckpts" / "step=2.ckpt")
    logger = CSVLogger(tmp_path / "logs", name="run", version=0)
    armed = []  # whether each load could run collectives (read_once): the restore's alone

    class Spy(lc.ShardedCheckpointIO):
        def load_checkpoint(self, path, *args, **kwargs):
            armed.append(self._collective_load)
            return super().load_checkpoint(path, *args, **kwargs)

    class LoadsOnFitStart(TinyRegressor):  # a user's loads (on one rank), around the restore: never collective
        def configure_model(self):
            io.load_checkpoint(saved)

        def on_fit_start(self):
            io.load_checkpoint(saved)

    io = Spy()
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, verbose=True)
    other = lc.ShardedModelCheckpoint(dirpath=tmp_path / "other", every_n_train_steps=3, verbose=True)
    trainer = Trainer(max_steps=4, callbacks=[callback, other], plugins=[io], **trainer_kwargs(logger=logger))
    trainer.fit(LoadsOnFitStart(), ckpt_path=saved)
    assert armed == [None, (1, 1), None] and io._collective_load is None  # configure_model, restore, on_fit_start
    assert "resume_start" not in vars(trainer._checkpoint_connector)  # unwrapped at teardown
    record = callback.load_record
    assert other.load_record is record  # both callbacks see it; it is logged and printed once
    assert record.path == saved and not record.read_once and record is not io.last_load  # on_fit_start loaded after it
    assert record.total_bytes == record.bytes_read == lc.verify_checkpoint(saved).total_bytes
    assert record.seconds > 0 and record.gbps == record.total_bytes / record.seconds / 1e9
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = [row for row in csv.DictReader(f) if row.get("ckpt/load_s")]
    assert len(rows) == 1 and rows[0]["step"] == "2"
    assert float(rows[0]["ckpt/load_gbps"]) > 0 and float(rows[0]["ckpt/load_read_gb"]) == record.bytes_read / 1e9
    assert capsys.readouterr().out.count(f"loaded {record.total_bytes / 1e3:.0f} kB from {saved} in") == 1  # a tiny one
    # A load outside the restore runs no collective and is recorded too.
    io.load_checkpoint(saved)
    assert io.last_load is not record and io.last_load.path == saved


def test_async_saves_report_durability_later(tmp_path):
    seed_everything(0)
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(
        max_epochs=2, callbacks=[callback], plugins=[lc.ShardedCheckpointIO(async_save=True)], **trainer_kwargs()
    )
    trainer.fit(TinyRegressor())
    records = callback.save_records
    assert len(records) == 2 * STEPS_PER_EPOCH // 2
    assert all(r["durable_s"] is not None and r["durable_s"] > 0 and r["nbytes"] > 0 for r in records)


def test_works_with_lightnings_default_io(tmp_path):
    seed_everything(0)
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=2, monitor="train_loss")
    trainer = Trainer(max_epochs=2, callbacks=[callback], **trainer_kwargs())
    trainer.fit(TinyRegressor())
    assert len(_kept(tmp_path)) == 2 and all(os.path.isfile(tmp_path / n) for n in _kept(tmp_path))
    assert all(r["nbytes"] > 0 for r in callback.save_records)


def test_memory_is_released_after_a_large_synchronous_save(tmp_path):
    """Host RSS after saving a ~400 MB state comes back close to where it was before."""

    class Big(TinyRegressor):
        def __init__(self):
            super().__init__()
            self.register_buffer("ballast", torch.randn(100_000_000))  # 400 MB, saved in state_dict

    seed_everything(0)
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=1)
    trainer = Trainer(max_epochs=1, callbacks=[callback], **trainer_kwargs())  # TorchCheckpointIO: pickles it all
    trainer.fit(Big())
    for record in callback.save_records:
        grown = record["host_rss_after"] - record["host_rss_before"]
        assert grown < 100e6, f"RSS grew by {grown / 1e6:.0f} MB across a save of {record['nbytes'] / 1e6:.0f} MB"


class _HostCopies(TinyRegressor):
    """Each save builds 150 MB of host copies in 100 KB tensors (as a GPU model's state taken to the
    host would be) and keeps a block of the same size alive after every third (as a training
    process allocates during a save): the copies, freed after the save, stay as free heap glibc
    cannot return from the top."""

    def __init__(self):
        super().__init__()
        self.kept: list[bytearray] = []

    def on_save_checkpoint(self, checkpoint):
        copies = {}
        for i in range(1500):
            copies[f"copy.{i}"] = torch.ones(25_000)
            if i % 3 == 2:
                self.kept.append(bytearray(100_000))
        checkpoint["host_copies"] = copies


@pytest.mark.skipif(heap_free_bytes() is None, reason="measures the glibc heap (mallinfo2, glibc 2.33+)")
def test_release_trims_only_what_a_save_left_behind(tmp_path):
    """The default policy trims, off the training thread, the freed heap a save of host copies left
    behind; with the release off that heap is measured and kept; an async save leaves nothing."""

    def fit(model, release_memory, io, folder):
        # Measured against a collected, trimmed heap: an earlier test's garbage freed during a save
        # would hide what the save left.
        gc.collect()
        _malloc_trim()
        seed_everything(0)
        callback = lc.ShardedModelCheckpoint(
            dirpath=tmp_path / folder, every_n_train_steps=2, save_top_k=-1, release_memory=release_memory,
            release_threshold_mb=50,
        )  # fmt: skip
        trainer = Trainer(max_epochs=1, callbacks=[callback], plugins=[io], **trainer_kwargs())
        trainer.fit(model)
        return callback.save_records

    auto = fit(_HostCopies(), "auto", lc.ShardedCheckpointIO(), "auto")
    assert len(auto) == 2
    for record in auto:  # every save faults the copies in again, and each is trimmed after it
        assert record["heap_left_bytes"] > 100e6 and not record["release_skipped"], record["release_reason"]
        assert record["released_bytes"] > 50e6 and record["background_trim_s"] is not None

    off = fit(_HostCopies(), False, lc.ShardedCheckpointIO(), "off")
    assert off[0]["heap_left_bytes"] > 100e6  # the first save leaves it; the next reuses it
    assert all(r["release_skipped"] and r["released_bytes"] is None for r in off)
    assert all(r["release_reason"] == "release_memory='never'" for r in off)

    asynchronous = fit(TinyRegressor(), True, lc.ShardedCheckpointIO(async_save=True), "async")
    assert all(r["release_skipped"] and r["heap_left_bytes"] < 50e6 for r in asynchronous)
    assert all("below the 50 MB threshold" in r["release_reason"] for r in asynchronous)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="empty_cuda_cache='sometimes'.*on_pressure"):
        lc.ShardedModelCheckpoint(empty_cuda_cache="sometimes")
    with pytest.raises(ValueError, match="release_memory='sometimes'.*'auto'"):
        lc.ShardedModelCheckpoint(release_memory="sometimes")
    with pytest.raises(ValueError, match="release_threshold_mb=-1"):
        lc.ShardedModelCheckpoint(release_threshold_mb=-1)
    with pytest.raises(ValueError, match="slowdown_window"):
        lc.ShardedModelCheckpoint(slowdown_window=0)


@pytest.mark.parametrize(
    "config",
    [dict(train_time_interval=timedelta(seconds=5)), dict(every_n_train_steps=3, monitor="x"), dict(every_n_epochs=2)],
)
def test_state_key_matches_model_checkpoint(config):
    """Saved callback state is found again on resume, whatever the trigger, and moves between
    ModelCheckpoint and ShardedModelCheckpoint."""
    assert lc.ShardedModelCheckpoint(**config).state_key == ModelCheckpoint(**config).state_key


def test_time_trigger_saves_and_resumes_its_state(tmp_path):
    import re
    import time as _time

    from lightning.pytorch import Callback

    step_ends: dict[int, float] = {}

    class Slow(Callback):
        def on_train_batch_start(self, *args):
            _time.sleep(0.05)

        def on_train_batch_end(self, trainer, *args):  # runs just before the checkpoint callback's
            step_ends[trainer.global_step] = _time.monotonic()

    seed_everything(0)
    interval = 0.8
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path, train_time_interval=timedelta(seconds=interval), save_top_k=-1)
    trainer = Trainer(max_epochs=10, callbacks=[callback, Slow()], plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs())
    trainer.fit(TinyRegressor())
    kept = _kept(tmp_path)
    saved = sorted(int(re.search(r"step=(\d+)", name).group(1)) for name in kept)
    # 40 steps of >= 50 ms: at least 2 s of training, so at least 2 saves. Saved by time, not every
    # step: consecutive saves are an interval apart, however slow a loaded machine makes the steps
    # and the saves (a count bound would assume a step time). The slack covers the moment between
    # Slow's timestamp and the callback's own clock reading.
    assert len(saved) >= 2, kept
    gaps = [step_ends[b] - step_ends[a] for a, b in zip(saved, saved[1:])]
    assert min(gaps) > interval - 0.2, (saved, gaps)
    state = lc.load_checkpoint(tmp_path / kept[-1])["callbacks"]
    assert callback.state_key in state


def test_two_callbacks_sharing_a_folder_keep_what_two_model_checkpoints_keep(tmp_path):
    def run(cls, folder):
        seed_everything(0)
        every = cls(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
        best = cls(dirpath=folder, every_n_train_steps=2, save_top_k=1, monitor="train_loss")
        trainer = Trainer(max_epochs=2, callbacks=[every, best], plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs())
        trainer.fit(TinyRegressor())

    run(ModelCheckpoint, tmp_path / "stock")
    run(lc.ShardedModelCheckpoint, tmp_path / "ours")
    assert _kept(tmp_path / "ours") == _kept(tmp_path / "stock")
    assert any(name.endswith("-v1.ckpt") for name in _kept(tmp_path / "ours"))  # the version counter saw the sibling's file


def test_copies_overlap_only_saves_followed_by_a_training_step(tmp_path):
    """Saves between two training steps may overlap their device copies with the next step; a save
    followed by validation, the end of an epoch or the end of training may not (a callback may
    swap weights in place there)."""
    from lightning.pytorch.callbacks import Callback

    from lightning_ckpt.lightning.callback import _training_step_follows

    class Spy(Callback):
        seen: list[tuple[int, int, bool]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append((trainer.current_epoch, batch_idx, _training_step_follows(trainer)))

    seed_everything(0)
    trainer = Trainer(
        max_epochs=2, callbacks=[Spy()], **trainer_kwargs(limit_val_batches=1, val_check_interval=2)
    )
    trainer.fit(TinyRegressor())
    assert STEPS_PER_EPOCH == 4
    # Validation runs after batches 1 and 3; batch 3 also ends the epoch.
    assert Spy.seen == [(e, b, b in (0, 2)) for e in (0, 1) for b in range(4)]


def test_async_staging_pool_is_prepared_after_the_first_step(tmp_path):
    io = lc.ShardedCheckpointIO(async_save=True)
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    seed_everything(0)
    prepared = []

    class Watch(TinyRegressor):
        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 1:  # after the first step, before any save
                prepared.append((io.async_saver.pool.nbytes, io.async_saver.pool.generation))

    trainer = Trainer(max_epochs=1, callbacks=[callback], plugins=[io], **trainer_kwargs())
    model = Watch()
    trainer.fit(model)
    state = sum(p.nbytes for p in model.parameters()) * 3  # weights + Adam's two moments
    (nbytes, generation), = prepared
    assert nbytes >= state and generation == 1
    assert len(callback.save_records) >= 1
    for record in callback.save_records:
        assert record["copy_wait_s"] == 0.0  # no device copies on the CPU
