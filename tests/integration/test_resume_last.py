"""ckpt_path="last" with ShardedModelCheckpoint: a damaged newest checkpoint is skipped, with a
warning naming the damaged file and the checkpoint resumed from; an explicit path still raises."""

from __future__ import annotations

import os
import shutil

import pytest
from helpers import flip_byte
from lightning.pytorch import Trainer, seed_everything
from models import STEPS_PER_EPOCH, TinyRegressor, trainer_kwargs

import lightning_ckpt as lc

SHARD = "model-00001-of-00001.safetensors"


def _fit(dirpath, max_epochs, ckpt_path=None, save_last=True):
    seed_everything(0, workers=True)
    model = TinyRegressor()
    callback = lc.ShardedModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=save_last)
    trainer = Trainer(max_epochs=max_epochs, callbacks=[callback], plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs())
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One epoch: epoch=0-step=2.ckpt, epoch=0-step=4.ckpt and last.ckpt (step 4, saved last)."""
    root = tmp_path_factory.mktemp("saved")
    _fit(root, 1)
    assert sorted(os.listdir(root)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    return root


@pytest.fixture
def run(saved, tmp_path):
    """A copy of the saved run to damage."""
    shutil.copytree(saved, tmp_path / "ckpts", symlinks=True)
    return tmp_path / "ckpts"


def _truncate(file) -> None:
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 7)


def _resumed_losses(path, tmp_path) -> list[float]:
    """The losses of a resume from an intact copy of ``path``, given explicitly."""
    copy = tmp_path / "intact" / os.path.basename(path)
    shutil.copytree(path, copy)
    return _fit(tmp_path / "intact", 2, ckpt_path=copy)[1].losses


def test_a_flipped_byte_in_last_resumes_from_the_newest_checkpoint_that_verifies(run, tmp_path):
    damaged = run / "last.ckpt" / SHARD
    flip_byte(damaged, os.path.getsize(damaged) - 5)
    used = run / "epoch=0-step=4.ckpt"
    with pytest.warns(UserWarning, match="damaged") as caught:
        trainer, model = _fit(run, 2, ckpt_path="last")
    message = " ".join(str(w.message) for w in caught if "damaged" in str(w.message))
    assert str(damaged) in message and "checksum mismatch" in message and f"resuming from {str(used)!r}" in message
    assert trainer.ckpt_path == str(used)  # the run resumed from it: never removed as outdated
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    assert model.losses == _resumed_losses(used, tmp_path)  # bit-identical to resuming from it by name


def test_truncated_shards_are_skipped_before_loading(run, tmp_path):
    for name in ("last.ckpt", "epoch=0-step=4.ckpt"):
        _truncate(run / name / SHARD)
    used = run / "epoch=0-step=2.ckpt"
    with pytest.warns(UserWarning, match="skipped 2 damaged checkpoints") as caught:
        trainer, model = _fit(run, 2, ckpt_path="last")
    message = " ".join(str(w.message) for w in caught if "damaged" in str(w.message))
    for name in ("last.ckpt", "epoch=0-step=4.ckpt"):
        assert str(run / name / SHARD) in message
    assert "truncated" in message and f"resuming from {str(used)!r}" in message
    assert trainer.ckpt_path == str(used)
    assert model.losses == _resumed_losses(used, tmp_path)


def test_a_linked_last_and_its_damaged_target_are_skipped_as_one(tmp_path):
    _fit(tmp_path, 1, save_last="link")
    assert os.path.islink(tmp_path / "last.ckpt")
    damaged = tmp_path / "epoch=0-step=4.ckpt" / SHARD  # what last.ckpt links to
    flip_byte(damaged, os.path.getsize(damaged) - 5)
    with pytest.warns(UserWarning, match="skipped 1 damaged checkpoint "):
        trainer, _ = _fit(tmp_path, 2, ckpt_path="last", save_last="link")
    assert trainer.ckpt_path == str(tmp_path / "epoch=0-step=2.ckpt")


def test_an_uncommitted_last_is_skipped(run):
    # A save that crashed after writing its manifest, before the rename that commits it: newer,
    # complete, and never to be resumed from.
    crashed = run / ".last.ckpt.lckpt-tmp-1-0000"
    shutil.copytree(run / "last.ckpt", crashed)
    os.utime(crashed / "manifest.json")  # written now: the newest manifest of the folder
    os.remove(run / "last.ckpt" / "manifest.json")
    with pytest.warns(UserWarning, match="last.ckpt"):
        trainer, _ = _fit(run, 2, ckpt_path="last")
    assert trainer.ckpt_path == str(run / "epoch=0-step=4.ckpt")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_an_explicit_path_still_raises(run, damage):
    damaged = run / "last.ckpt" / SHARD
    flip_byte(damaged, os.path.getsize(damaged) - 5) if damage == "flip" else _truncate(damaged)
    with pytest.raises(lc.CorruptCheckpointError) as caught:
        _fit(run, 2, ckpt_path=run / "last.ckpt")
    assert caught.value.file == SHARD


def test_every_checkpoint_damaged_raises_on_the_newest(run):
    for name in os.listdir(run):
        _truncate(run / name / SHARD)
    with pytest.raises(lc.CorruptCheckpointError, match="truncated"):
        _fit(run, 2, ckpt_path="last")


def test_an_intact_last_is_used_without_a_warning(run, recwarn):
    trainer, _ = _fit(run, 2, ckpt_path="last")
    assert trainer.ckpt_path == str(run / "last.ckpt")
    assert not [w for w in recwarn if "damaged" in str(w.message)]


@pytest.mark.parametrize(
    ("name", "extension", "folder", "expected"),
    [
        ("last", ".ckpt", {"last", "last.ckpt"}, {"last.ckpt"}),
        ("last", ".ckpt", {"log.txt", "last-v0.ckpt", "last-v1.ckpt"}, {"last-v0.ckpt", "last-v1.ckpt"}),
        ("other", ".pt", {"log.txt", "last-v0.ckpt", "other-v0.pt", "other-v1.pt"}, {"other-v0.pt", "other-v1.pt"}),
    ],
)
def test_find_last_checkpoints_keeps_lightnings_contract(tmp_path, name, extension, folder, expected):
    """Every ``last`` file Lightning finds, unfiltered (the damaged-``last`` fallback happens at the load)."""
    for entry in folder:
        (tmp_path / entry).touch()
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path)
    callback.CHECKPOINT_NAME_LAST, callback.FILE_EXTENSION = name, extension
    trainer = Trainer(plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs())
    assert callback._find_last_checkpoints(trainer) == {str(tmp_path / entry) for entry in expected}
