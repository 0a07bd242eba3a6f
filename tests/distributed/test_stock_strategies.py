"""The three lines with Lightning's own sharded strategies on CPU (gloo, 2 ranks): the plugin and
``ShardedModelCheckpoint`` make a stock ``ModelParallelStrategy`` / ``FSDPStrategy`` (a user's
subclass of it) save in our format and resume from it, bit-identical, and reshard 2 -> 1.
"""

from __future__ import annotations

import json

import pytest
from helpers import run_script

import lightning_ckpt as lc

pytestmark = pytest.mark.distributed


def _ranks(checkpoint) -> set[int]:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    return {record.get("rank", 0) for name, record in manifest["files"].items() if name.endswith(".safetensors")}


@pytest.mark.parametrize(
    ("strategy", "class_name", "writers"),
    [
        ("fsdp2", "ModelParallelStrategy", {0, 1}),
        ("fsdp1", "UserFSDPStrategy", {0, 1}),
        # Full-state saves: rank 0 writes what the strategy gathered, optimizer states keyed by
        # parameter index (as Lightning re-keys them); saving last.ckpt again replaces it.
        ("fsdp2-full", "ModelParallelStrategy", {0}),
    ],
)
def test_stock_strategy_resumes_bit_identical_and_reshards_to_one_rank(tmp_path, strategy, class_name, writers):
    result = run_script("distributed/stock_fit.py", "fit", strategy, "2", tmp_path=tmp_path)
    assert result["world_size"] == 2 and result["strategy"] == class_name  # the instance keeps its class
    assert result["checkpoints"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert result["resumed_steps"] == [5, 6, 7, 8] and result["global_step"] == 8
    assert result["losses_equal"] and result["resumed_equals_uninterrupted"]
    folder = tmp_path / f"ckpts-{strategy}"
    for name in result["checkpoints"]:
        assert _ranks(folder / name) == writers
        lc.verify_checkpoint(folder / name)
    checkpoint, full = folder / "epoch=0-step=4.ckpt", tmp_path / "full-epoch0.pt"
    resharded = run_script("distributed/stock_fit.py", "reshard", strategy, "1", str(checkpoint), str(full), tmp_path=tmp_path)
    assert resharded == {"world_size": 1, "restored_equals_saved": True}


def test_full_state_saves_in_one_process_replace_last_and_resume_bit_identical(tmp_path):
    # One process saves through the same path (the stock save_checkpoint refused last.ckpt's
    # second save: an existing directory at the path).
    result = run_script("distributed/stock_fit.py", "fit", "fsdp2-full", "1", tmp_path=tmp_path)
    assert result["world_size"] == 1 and result["strategy"] == "ModelParallelStrategy"
    assert result["checkpoints"] == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"]
    assert result["losses_equal"] and result["resumed_equals_uninterrupted"]
