"""A real Trainer on CPU: save with ShardedCheckpointIO, resume, and get bit-identical training."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from models import STEPS_PER_EPOCH, TinyRegressor, trainer_kwargs

import lightning_ckpt as lc

TOTAL_EPOCHS = 4


def _fit(max_epochs, callbacks=(), ckpt_path=None, plugins=None, model=None):
    seed_everything(0, workers=True)
    model = model or TinyRegressor()
    trainer = Trainer(
        max_epochs=max_epochs,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        plugins=plugins if plugins is not None else [lc.ShardedCheckpointIO()],
        **trainer_kwargs(),
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted run every resumed run must match."""
    trainer, model = _fit(TOTAL_EPOCHS, plugins=[])
    return trainer, model


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Two epochs with top-k + save_last, and every 4th step kept, then 'interrupted'."""
    root = tmp_path_factory.mktemp("run")
    topk = ModelCheckpoint(
        dirpath=root / "topk", every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True
    )
    every = ModelCheckpoint(dirpath=root / "every", every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1, filename="{step}")
    trainer, model = _fit(2, callbacks=[topk, every])
    return root, trainer, model


def _assert_same_training_state(resumed: Trainer, reference: Trainer) -> None:
    got, want = resumed.lightning_module.state_dict(), reference.lightning_module.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    opt_got, opt_want = resumed.optimizers[0].state_dict(), reference.optimizers[0].state_dict()
    assert opt_got["param_groups"] == opt_want["param_groups"]
    for index, state in opt_want["state"].items():
        for name, value in state.items():
            assert torch.equal(opt_got["state"][index][name], value), (index, name)
    assert resumed.lr_scheduler_configs[0].scheduler.state_dict() == reference.lr_scheduler_configs[0].scheduler.state_dict()
    assert resumed.global_step == reference.global_step and resumed.current_epoch == reference.current_epoch


def test_checkpoints_are_directories_and_topk_removal_removes_them(interrupted):
    root, trainer, _ = interrupted
    topk = sorted(os.listdir(root / "topk"))
    assert "last.ckpt" in topk and len(topk) == 3, topk  # 2 best + last; the rest were removed
    assert sorted(os.listdir(root / "every")) == ["step=4.ckpt", "step=8.ckpt"]
    for folder in ("topk", "every"):
        for name in os.listdir(root / folder):
            path = root / folder / name
            assert path.is_dir() and (path / "manifest.json").exists()
            lc.verify_checkpoint(path)
    assert lc.load_checkpoint(root / "topk" / "last.ckpt")["global_step"] == 2 * STEPS_PER_EPOCH
    best = trainer.checkpoint_callback.best_model_path
    assert os.path.isdir(best)


def test_resume_from_last_is_bit_identical(interrupted, reference, tmp_path):
    root, _, first = interrupted
    ref_trainer, ref_model = reference
    topk = ModelCheckpoint(dirpath=root / "topk", every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True)
    trainer, model = _fit(TOTAL_EPOCHS, callbacks=[topk], ckpt_path="last")
    assert first.losses == ref_model.losses[: len(first.losses)]
    assert model.losses == ref_model.losses[2 * STEPS_PER_EPOCH :]
    _assert_same_training_state(trainer, ref_trainer)


def test_resume_from_a_named_checkpoint_is_bit_identical(interrupted, reference, tmp_path):
    root, _, _ = interrupted
    ref_trainer, ref_model = reference
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1, filename="{step}")
    trainer, model = _fit(TOTAL_EPOCHS, callbacks=[every], ckpt_path=root / "every" / "step=4.ckpt")
    assert model.losses == ref_model.losses[STEPS_PER_EPOCH:]
    _assert_same_training_state(trainer, ref_trainer)


def test_lightning_module_from_a_directory_checkpoint(interrupted):
    root, trainer, model = interrupted
    path = root / "every" / "step=8.ckpt"  # the interrupted run's final state (last.ckpt moves on in other tests)
    with pytest.raises(IsADirectoryError):
        TinyRegressor.load_from_checkpoint(path)  # Lightning's own loader bypasses CheckpointIO
    loaded = lc.load_from_checkpoint(TinyRegressor, path)
    assert isinstance(loaded, TinyRegressor) and loaded.hparams.hidden == 16
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    bigger = lc.load_from_checkpoint(TinyRegressor, path, lr=0.5)
    assert bigger.hparams.lr == 0.5


def test_manual_save_and_validate_from_directory(tmp_path):
    trainer, model = _fit(1)
    path = tmp_path / "manual.ckpt"
    trainer.save_checkpoint(path)
    assert lc.load_checkpoint(path, verify=True)["global_step"] == STEPS_PER_EPOCH
    validator = Trainer(plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs(limit_val_batches=1.0))
    results = validator.validate(TinyRegressor(), ckpt_path=path, verbose=False)
    assert results and results[0]["val_loss"] > 0


def test_legacy_checkpoint_resumes_through_the_plugin(tmp_path, reference):
    ref_trainer, ref_model = reference
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1, filename="{step}")
    _fit(1, callbacks=[cb], plugins=[])  # stock TorchCheckpointIO: single files
    assert (tmp_path / "step=4.ckpt").is_file()
    trainer, model = _fit(TOTAL_EPOCHS, ckpt_path=tmp_path / "step=4.ckpt")
    assert model.losses == ref_model.losses[STEPS_PER_EPOCH:]
    _assert_same_training_state(trainer, ref_trainer)
