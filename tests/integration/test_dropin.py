"""ShardedModelCheckpoint as a drop-in for ModelCheckpoint: the cases a new user hit, each against
what a stock ModelCheckpoint does (real Trainer on CPU)."""

import glob
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from models import STEPS_PER_EPOCH, TinyRegressor, trainer_kwargs

import lightning_ckpt as lc


def _fit(callback, plugins=None, epochs=1, model=None, ckpt_path=None, **overrides):
    seed_everything(0)
    trainer = Trainer(max_epochs=epochs, callbacks=[callback], plugins=plugins or [], **trainer_kwargs(**overrides))
    trainer.fit(model or TinyRegressor(), ckpt_path=ckpt_path)
    return trainer


def _checkpoints(folder) -> list[str]:
    """Every checkpoint under ``folder`` (also in sub-folders), relative to it."""
    found = glob.glob(os.path.join(folder, "**", "*.ckpt"), recursive=True)
    return sorted(os.path.relpath(p, folder) for p in found if not os.path.dirname(os.path.relpath(p, folder)).endswith(".ckpt"))


_RUN = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from lightning.pytorch import Trainer, seed_everything
    from models import TinyRegressor, trainer_kwargs
    import lightning_ckpt as lc
    seed_everything(0)
    callback = lc.ShardedModelCheckpoint(dirpath={dirpath!r}, filename="{{epoch}}/model", save_last=True)
    Trainer(max_epochs=1, callbacks=[callback], plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs()).fit(TinyRegressor())
    """
)


def test_a_second_run_with_a_sub_folder_filename_keeps_the_first_runs_checkpoint(tmp_path):
    """Two runs (two processes) into one folder with filename="{epoch}/model": the second one
    must not overwrite epoch=0/model.ckpt (the version counter sees files in sub-folders)."""
    for _ in range(2):
        stock = ModelCheckpoint(dirpath=tmp_path / "stock", filename="{epoch}/model", save_last=True)
        _fit(stock, plugins=[lc.ShardedCheckpointIO()])
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _RUN.format(tests=tests, dirpath=str(tmp_path / "ours"))
    for _ in range(2):
        subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, capture_output=True, timeout=300)
    assert _checkpoints(tmp_path / "ours") == _checkpoints(tmp_path / "stock")
    assert {"epoch=0/model.ckpt", "epoch=0/model-v1.ckpt"} <= set(_checkpoints(tmp_path / "ours"))


def test_the_record_follows_the_filesystem_not_an_earlier_fit(tmp_path):
    """Fit, delete the folder, fit again in the same process: the same names as the first time."""
    dirpath = tmp_path / "ckpts"
    _fit(lc.ShardedModelCheckpoint(dirpath=dirpath, save_last=True), plugins=[lc.ShardedCheckpointIO()])
    first = _checkpoints(dirpath)
    shutil.rmtree(dirpath)
    _fit(lc.ShardedModelCheckpoint(dirpath=dirpath, save_last=True), plugins=[lc.ShardedCheckpointIO()])
    assert _checkpoints(dirpath) == first == sorted([f"epoch=0-step={STEPS_PER_EPOCH}.ckpt", "last.ckpt"])


class _Heavy(TinyRegressor):
    """~32 MB of state, so that a rate-capped async write outlasts several training steps."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ballast", torch.zeros(8_000_000))


def test_skipped_saves_leave_the_callback_as_if_they_had_not_been_requested(tmp_path):
    dirpath = tmp_path / "ckpts"
    callback = lc.ShardedModelCheckpoint(
        dirpath=dirpath, every_n_train_steps=1, save_top_k=2, monitor="train_loss", save_last=True
    )
    io = lc.ShardedCheckpointIO(async_save=True, when_busy="skip", max_write_rate="64MB")
    with pytest.warns(UserWarning, match="Skipped checkpoint"):
        trainer = _fit(callback, plugins=[io], epochs=3, model=_Heavy())
    assert io.skipped_saves > 0
    on_disk = set(_checkpoints(dirpath))
    tracked = {os.path.basename(p) for p in callback.best_k_models}
    assert tracked | {"last.ckpt"} == on_disk, (tracked, on_disk)
    assert os.path.isdir(callback.best_model_path) and os.path.isdir(callback.last_model_path)
    assert callback.best_model_score == min(callback.best_k_models.values())
    # Every recorded save was written (became durable); skipped ones are not records.
    records = callback.save_records
    assert records and all(r["durable_s"] is not None for r in records)
    # The checkpoint state agrees with what is on disk.
    state = lc.load_checkpoint(dirpath / "last.ckpt")["callbacks"][callback.state_key]
    assert all(os.path.isdir(p) for p in state["best_k_models"])
    trainer.validate(_Heavy(), ckpt_path="best")


def test_metrics_go_to_the_log_folder_and_accumulate_across_resumes(tmp_path):
    dirpath = tmp_path / "ckpts"
    for epochs, ckpt_path in ((1, None), (2, "last")):
        logger = CSVLogger(tmp_path / "logs", name="run", version=0)
        callback = lc.ShardedModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=True)
        _fit(callback, plugins=[lc.ShardedCheckpointIO()], epochs=epochs, ckpt_path=ckpt_path, logger=logger)
    assert all(name.endswith(".ckpt") for name in os.listdir(dirpath))  # nothing but checkpoints
    lines = (tmp_path / "logs" / "run" / "version_0" / "ckpt_metrics.jsonl").read_text().splitlines()
    runs = [json.loads(line) for line in lines]
    assert len(runs) == 2 and all(run["saves"] and run["step_times_s"] for run in runs)
    assert runs[0]["saves"][0]["global_step"] == 2 and runs[1]["saves"][-1]["global_step"] == 2 * STEPS_PER_EPOCH


def test_without_a_logger_nothing_but_checkpoints_is_written(tmp_path):
    """Lightning's own tests put dirpath == default_root_dir with logger=False and list the folder."""
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path / "run", every_n_train_steps=2, save_top_k=-1, save_last=True)
    _fit(callback, plugins=[lc.ShardedCheckpointIO()], default_root_dir=tmp_path / "run")
    assert callback.save_records and all(name.endswith(".ckpt") for name in os.listdir(tmp_path / "run"))


def test_the_summary_follows_verbose_and_is_not_cut_when_piped(tmp_path, capsys):
    _fit(lc.ShardedModelCheckpoint(dirpath=tmp_path / "quiet", every_n_train_steps=2), plugins=[lc.ShardedCheckpointIO()])
    assert "checkpoint saves" not in capsys.readouterr().out
    long_name = "a-rather-long-checkpoint-file-name-{epoch}-{step}-that-is-wider-than-eighty-columns-by-itself"
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path / "loud", filename=long_name, every_n_train_steps=2, verbose=True)
    _fit(callback, plugins=[lc.ShardedCheckpointIO()])
    out = capsys.readouterr().out
    assert "checkpoint saves" in out
    assert os.path.basename(callback.save_records[-1]["path"]) in out  # whole, on one line


def test_a_checkpoint_directory_without_the_plugin_says_how_to_load_it(tmp_path):
    dirpath = tmp_path / "ckpts"
    _fit(lc.ShardedModelCheckpoint(dirpath=dirpath, save_last=True), plugins=[lc.ShardedCheckpointIO()])
    with pytest.raises(IsADirectoryError, match=r"lightning_ckpt checkpoint directory.*ShardedCheckpointIO"):
        _fit(lc.ShardedModelCheckpoint(dirpath=dirpath), epochs=2, ckpt_path=str(dirpath / "last.ckpt"))


@pytest.mark.parametrize("cls", [lc.ShardedModelCheckpoint, lc.ShardedCheckpointIO])
def test_public_classes_introspect_like_lightnings(cls):
    """Real, evaluated annotations on __init__ (LightningCLI / jsonargparse read them)."""
    from jsonargparse import ArgumentParser

    annotations = [p.annotation for p in inspect.signature(cls.__init__).parameters.values()]
    assert not any(isinstance(a, str) for a in annotations)
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "obj")
    parser.parse_args([])


class _CountingTrainer(Trainer):
    """A Trainer whose ``save_checkpoint`` a user (or a logger, another callback) wrapped."""

    saved: list[str]

    def save_checkpoint(self, filepath, weights_only=None, storage_options=None):
        self.saved.append(os.path.relpath(filepath, self.default_root_dir))
        super().save_checkpoint(filepath, weights_only, storage_options)


@pytest.mark.parametrize("plugins", [[], [lc.ShardedCheckpointIO()]], ids=["lightning-io", "our-io"])
def test_in_one_process_every_save_goes_through_trainer_save_checkpoint(tmp_path, plugins):
    """As with ModelCheckpoint, which calls ``trainer.save_checkpoint`` for every file it writes."""
    saved = {}
    for name, callback in (("stock", ModelCheckpoint), ("ours", lc.ShardedModelCheckpoint)):
        seed_everything(0)
        trainer = _CountingTrainer(
            max_epochs=2,
            default_root_dir=tmp_path / name,
            callbacks=[callback(dirpath=tmp_path / name, save_top_k=-1, every_n_train_steps=2, save_last=True)],
            plugins=[type(p)() for p in plugins],
            **trainer_kwargs(),
        )
        trainer.saved = []
        trainer.fit(TinyRegressor())
        saved[name] = trainer.saved
    assert saved["ours"] == saved["stock"] and len(saved["stock"]) > 2


def test_a_pickled_callback_equals_the_original_as_modelcheckpoints_does(tmp_path):
    """Lightning's ``test_pickling``: spawn strategies and users copy callbacks by pickling them."""
    import pickle

    for callback in (ModelCheckpoint(dirpath=tmp_path), lc.ShardedModelCheckpoint(dirpath=tmp_path, train_time_interval=None)):
        assert vars(pickle.loads(pickle.dumps(callback))) == vars(callback)


@pytest.mark.parametrize("below", ["", "sub"], ids=["dirpath-is-a-file", "file-above-dirpath"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_dirpath_that_cannot_be_written_fails_before_training(tmp_path, below, async_save):
    """Found at setup with the message a save would give, not a save interval (async: two) later."""
    in_the_way = tmp_path / "taken"
    in_the_way.write_text("a file, not a folder")
    callback = lc.ShardedModelCheckpoint(dirpath=in_the_way / below if below else in_the_way, every_n_train_steps=2)
    seed_everything(0)
    trainer = Trainer(max_epochs=1, callbacks=[callback], plugins=[lc.ShardedCheckpointIO(async_save=async_save)], **trainer_kwargs())
    with pytest.raises(lc.CheckpointWriteError, match=r"cannot be saved in .*taken.*Move that file away.*`dirpath`"):
        trainer.fit(TinyRegressor())
    assert trainer.global_step == 0
    assert in_the_way.read_text() == "a file, not a folder"


def test_a_writable_dirpath_is_not_created_before_the_first_save(tmp_path):
    """The probe leaves nothing behind: no folder for a run that never saves, as ModelCheckpoint."""
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path / "new" / "ckpts", save_top_k=1, every_n_train_steps=10_000)
    _fit(callback, plugins=[lc.ShardedCheckpointIO()], max_steps=2)
    assert not (tmp_path / "new").exists()


def test_in_one_process_the_time_trigger_reads_lightnings_clock(tmp_path):
    """As Lightning's own test mocks it: ``lightning.pytorch.callbacks.model_checkpoint.time``."""
    from datetime import timedelta
    from unittest import mock

    kept = {}
    for name, callback in (("stock", ModelCheckpoint), ("ours", lc.ShardedModelCheckpoint)):
        with mock.patch("lightning.pytorch.callbacks.model_checkpoint.time") as clock:
            clock.monotonic.side_effect = [7.0 * i for i in range(2 * STEPS_PER_EPOCH + 1)]
            folder = tmp_path / name
            _fit(callback(dirpath=folder, train_time_interval=timedelta(seconds=20), save_top_k=-1), epochs=2)
        kept[name] = _checkpoints(folder)
    assert kept["ours"] == kept["stock"] and len(kept["stock"]) >= 2
