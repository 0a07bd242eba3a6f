"""A real resume (`Trainer.fit(ckpt_path=...)`) refuses a damaged checkpoint by default."""

from __future__ import annotations

import os

import pytest
from models import STEPS_PER_EPOCH, fit_regressor

import lightning_ckpt as lc


def _flip_tensor_byte(file: str) -> None:
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) - 1)  # the last byte of the last tensor: not the header
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("component", ["model", "optimizer"])
def test_resume_from_a_corrupted_checkpoint_raises(tmp_path, component):
    fit_regressor(1, dirpath=tmp_path, every_n_train_steps=STEPS_PER_EPOCH, plugin=lc.ShardedCheckpointIO())
    path = tmp_path / "last.ckpt"
    shard = next(n for n in sorted(os.listdir(path)) if n.startswith(f"{component}-"))
    _flip_tensor_byte(str(path / shard))
    with pytest.raises(lc.CorruptCheckpointError, match="checksum mismatch") as info:
        fit_regressor(2, ckpt_path=path, plugin=lc.ShardedCheckpointIO())
    assert info.value.file == shard and info.value.path == str(path)
    # The documented opt-out resumes from the damaged bytes.
    trainer, _ = fit_regressor(2, ckpt_path=path, plugin=lc.ShardedCheckpointIO(verify_on_load="structure"))
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
