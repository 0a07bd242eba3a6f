"""A path to a file that is no checkpoint at all (random bytes, a text file, an empty file) is
called that, with the formats that are read; real ``torch.save`` files keep torch's own errors."""

from __future__ import annotations

import argparse
import pickle
import random

import pytest
import torch
from lightning.pytorch import Trainer
from models import TinyRegressor, trainer_kwargs

import lightning_ckpt as lc

NOT_A_CHECKPOINT = r"is not a checkpoint: .*manifest\.json.*torch\.save.*\(DCP\) folder"


@pytest.fixture(params=["random", "text", "empty"])
def garbage(request, tmp_path):
    path = tmp_path / "model.ckpt"
    if request.param == "random":
        path.write_bytes(random.Random(0).randbytes(1024))
    elif request.param == "text":
        path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 103000000\n")
    else:
        path.write_bytes(b"")
    return path


def test_the_plugin_names_a_file_that_is_not_a_checkpoint(garbage):
    with pytest.raises(lc.UnsupportedFormatError, match=NOT_A_CHECKPOINT) as info:
        lc.ShardedCheckpointIO().load_checkpoint(garbage)
    assert info.value.path == str(garbage) and repr(str(garbage)) in str(info.value)
    assert "Unsupported operand" not in str(info.value) and "Weights only" not in str(info.value)


def test_fit_with_ckpt_path_to_a_file_that_is_not_a_checkpoint(garbage, tmp_path):
    trainer = Trainer(max_epochs=1, plugins=[lc.ShardedCheckpointIO()], default_root_dir=tmp_path, **trainer_kwargs())
    with pytest.raises(lc.UnsupportedFormatError, match=NOT_A_CHECKPOINT):
        trainer.fit(TinyRegressor(), ckpt_path=str(garbage))


def test_real_torch_files_keep_torchs_errors_and_old_formats_load(tmp_path):
    trusted = tmp_path / "namespace.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": argparse.Namespace(a=1)}, trusted)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):  # torch's message, untouched
        lc.ShardedCheckpointIO().load_checkpoint(trusted, weights_only=True)
    assert lc.load_checkpoint(trusted, weights_only=False)["hyper_parameters"] == argparse.Namespace(a=1)
    old = tmp_path / "old-format.ckpt"  # a pickle, not a zip archive
    torch.save({"state_dict": {"w": torch.ones(2)}}, old, _use_new_zipfile_serialization=False)
    assert torch.equal(lc.ShardedCheckpointIO().load_checkpoint(old)["state_dict"]["w"], torch.ones(2))
