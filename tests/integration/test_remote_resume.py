"""Resuming from a remote checkpoint never deletes it, nor the earlier run's other checkpoints.

Lightning 2.6's ``ModelCheckpoint`` keeps a local checkpoint the run resumed from, or one outside
its ``dirpath``, but removes any remote one it tracked (Lightning issue #21813): a run resuming
from ``memory://run1/...`` into a new ``dirpath`` deleted run 1's checkpoint at its first save.
``ShardedModelCheckpoint`` applies both guards to URLs; ``ShardedCheckpointIO`` keeps a remote
checkpoint it loaded whichever callback asks to remove it.
"""

from __future__ import annotations

import types

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from models import TinyRegressor, trainer_kwargs

import lightning_ckpt as lc


def _fit(callback, max_epochs: int, ckpt_path: str | None = None, tmp_path=None) -> Trainer:
    seed_everything(0)
    trainer = Trainer(
        max_epochs=max_epochs,
        callbacks=[callback],
        plugins=[lc.ShardedCheckpointIO()],
        **trainer_kwargs(default_root_dir=tmp_path),
    )
    trainer.fit(TinyRegressor(), ckpt_path=ckpt_path)
    return trainer


def _names(fs, folder: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(folder, detail=False)) if fs.exists(folder) else []


def _first_run(memory_fs) -> str:
    _fit(lc.ShardedModelCheckpoint(dirpath="memory://bucket/run1", every_n_train_steps=2, save_top_k=1), 1)
    (name,) = _names(memory_fs, "/bucket/run1")
    return f"memory://bucket/run1/{name}"


def test_sharded_model_checkpoint_resuming_into_a_new_remote_dirpath_keeps_the_first_runs(memory_fs, tmp_path):
    resumed_from = _first_run(memory_fs)
    callback = lc.ShardedModelCheckpoint(dirpath="memory://bucket/run2", every_n_train_steps=2, save_top_k=1)
    _fit(callback, 3, ckpt_path=resumed_from, tmp_path=tmp_path)
    assert _names(memory_fs, "/bucket/run1") == [resumed_from.rsplit("/", 1)[1]]
    assert len(_names(memory_fs, "/bucket/run2")) == 1  # top-1 in its own dirpath still rotates
    lc.verify_checkpoint(resumed_from)


def test_stock_model_checkpoint_cannot_make_the_io_delete_the_checkpoint_resumed_from(memory_fs, tmp_path):
    resumed_from = _first_run(memory_fs)
    # The stock callback takes over the first run's record (ShardedModelCheckpoint shares its state
    # key) and, in Lightning 2.6, asks to remove that remote checkpoint at its first save.
    stock = ModelCheckpoint(dirpath=tmp_path / "local", every_n_train_steps=2, save_top_k=1)
    with pytest.warns(UserWarning, match="this run loaded \\(resumed from\\) it"):
        _fit(stock, 3, ckpt_path=resumed_from, tmp_path=tmp_path)
    assert _names(memory_fs, "/bucket/run1") == [resumed_from.rsplit("/", 1)[1]]
    lc.verify_checkpoint(resumed_from)


def test_remote_removal_guards_of_the_callback():
    callback = lc.ShardedModelCheckpoint(dirpath="s3://bucket/run")
    trainer = types.SimpleNamespace(ckpt_path="s3://bucket/run//epoch=0.ckpt")
    should = callback._should_remove_checkpoint
    assert should(trainer, "s3://bucket/run/epoch=1.ckpt", "s3://bucket/run/epoch=2.ckpt")  # top-k in its dirpath
    assert not should(trainer, "s3://bucket/run/epoch=0.ckpt", "s3://bucket/run/epoch=2.ckpt")  # resumed from
    assert not should(trainer, "s3://bucket/other/epoch=1.ckpt", "s3://bucket/run/epoch=2.ckpt")  # outside dirpath
    assert not should(trainer, "s3://bucket/running/epoch=1.ckpt", "s3://bucket/run/epoch=2.ckpt")  # a prefix, not a folder
    assert not should(trainer, "s3://bucket/run/a.ckpt", "s3://bucket/run/./a.ckpt")  # the same checkpoint
