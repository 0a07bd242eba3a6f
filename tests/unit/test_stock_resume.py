"""How ``ShardedModelCheckpoint.setup`` gives a stock strategy instance our resume
and save (``strategies.enable_sharded_checkpoints``); the loads themselves run in tests/distributed."""

from __future__ import annotations

from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)

import lightning_ckpt as lc
from lightning_ckpt.lightning.strategies import enable_sharded_checkpoints


class UserFSDPStrategy(FSDPStrategy):
    """A user's subclass with its own load for checkpoints that are not ours."""

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        return {"loaded_by": "user", "path": str(checkpoint_path)}


def test_only_the_instance_load_changes_once_and_the_class_stays():
    strategy = ModelParallelStrategy()
    assert enable_sharded_checkpoints(strategy)
    installed = strategy.__dict__["load_checkpoint"]
    assert enable_sharded_checkpoints(strategy)  # a second setup (or a second callback): the same wrapper
    assert strategy.__dict__["load_checkpoint"] is installed
    assert type(strategy) is ModelParallelStrategy
    assert "load_checkpoint" not in ModelParallelStrategy().__dict__  # other instances untouched


def test_a_user_subclass_keeps_its_load_for_checkpoints_that_are_not_ours(tmp_path):
    strategy = UserFSDPStrategy()
    assert enable_sharded_checkpoints(strategy)
    assert type(strategy) is UserFSDPStrategy
    assert strategy.load_checkpoint(tmp_path / "lightning.ckpt") == {"loaded_by": "user", "path": str(tmp_path / "lightning.ckpt")}


def test_strategies_that_save_and_resume_already_are_left_alone():
    for strategy in (lc.ShardedModelParallelStrategy(), lc.ShardedFSDPStrategy(), DDPStrategy()):
        assert not enable_sharded_checkpoints(strategy)
        assert "load_checkpoint" not in strategy.__dict__ and "save_checkpoint" not in strategy.__dict__


def test_the_instance_save_goes_through_the_plugin_and_stays_stock_otherwise(tmp_path):
    # Stock FSDP / ModelParallel saves refuse an existing directory (full state) or write DCP files
    # (sharded state); with the callback, ``Trainer.save_checkpoint`` reaches our plugin instead.
    strategy = ModelParallelStrategy()
    assert enable_sharded_checkpoints(strategy)
    installed = strategy.__dict__["save_checkpoint"]
    assert enable_sharded_checkpoints(strategy)
    assert strategy.__dict__["save_checkpoint"] is installed
    assert "save_checkpoint" not in ModelParallelStrategy().__dict__
