"""Verify-on-load is the default: a damaged byte anywhere a load reads raises, naming the file.

The opt-outs (``load_checkpoint(verify=False)``, ``ShardedCheckpointIO(verify_on_load="structure")``)
still load, with presence, sizes, the metadata's digest and the safetensors headers checked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import flip_byte

import lightning_ckpt as lc
from lightning_ckpt.format import reader

MODEL = "model-00001-of-00001.safetensors"
OPTIMIZER = "optimizer-00001-of-00001.safetensors"
GOLDEN_V1 = Path(__file__).parent.parent / "golden" / "v1" / "epoch=1-step=42.ckpt"


def _save(path: Path) -> dict:
    state = {
        "state_dict": {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(8)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.full((4096,), 0.5)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "global_step": 7,
    }
    lc.save_checkpoint(state, path)
    return state


def _flip_in_data(file: Path) -> None:
    """One bit of a tensor's bytes (not the header): only a checksum can notice it."""
    flip_byte(file, os.path.getsize(file) - 100)


@pytest.mark.parametrize("name", [MODEL, OPTIMIZER])
def test_a_flipped_tensor_byte_fails_a_default_load_naming_the_file(tmp_path, name):
    path = tmp_path / "last.ckpt"
    state = _save(path)
    _flip_in_data(path / name)
    with pytest.raises(lc.CorruptCheckpointError, match="checksum mismatch") as info:
        lc.load_checkpoint(path)
    assert info.value.file == name and info.value.path == str(path)
    message = str(info.value)
    assert name in message and "damaged" in message
    assert "verify=False" in message and 'verify_on_load="structure"' in message  # how to opt out
    with pytest.raises(lc.CorruptCheckpointError, match=name):
        lc.ShardedCheckpointIO().load_checkpoint(path)  # the plugin's default as well

    # Opting out loads the damaged bytes (the structure is intact): exactly one value differs.
    for loaded in (lc.load_checkpoint(path, verify=False), lc.ShardedCheckpointIO(verify_on_load="structure").load_checkpoint(path)):
        got = loaded["state_dict"]["w"] if name == MODEL else loaded["optimizer_states"][0]["state"][0]["exp_avg"]
        want = state["state_dict"]["w"] if name == MODEL else state["optimizer_states"][0]["state"][0]["exp_avg"]
        assert (got != want).sum() == 1


def test_a_flipped_metadata_byte_fails_every_mode(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path)
    flip_byte(path / "metadata.json", 3)
    for load in (
        lambda: lc.load_checkpoint(path),
        lambda: lc.load_checkpoint(path, verify=False),  # the metadata decides what is read: always checked
        lambda: lc.ShardedCheckpointIO(verify_on_load="structure").load_checkpoint(path),
    ):
        with pytest.raises(lc.CorruptCheckpointError, match="metadata.json") as info:
            load()
        assert info.value.file == "metadata.json"


def test_a_flipped_model_index_byte_fails_a_default_load(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path)
    flip_byte(path / "model.safetensors.index.json", 5)
    with pytest.raises(lc.CorruptCheckpointError) as info:
        lc.load_checkpoint(path)
    assert info.value.file == "model.safetensors.index.json"
    assert lc.load_checkpoint(path, verify=False)["global_step"] == 7


def test_a_flipped_header_byte_is_a_checksum_mismatch(tmp_path):
    path = tmp_path / "last.ckpt"
    _save(path)
    flip_byte(path / MODEL, 20)  # inside the JSON header
    with pytest.raises(lc.CorruptCheckpointError, match="checksum mismatch") as info:
        lc.load_checkpoint(path)
    assert info.value.file == MODEL


def test_defaults_verify():
    assert lc.ShardedCheckpointIO().verify_on_load == "full"
    import inspect

    assert inspect.signature(lc.load_checkpoint).parameters["verify"].default is True


def test_verify_on_load_values_are_validated():
    for value in ("full", "structure"):
        assert lc.ShardedCheckpointIO(verify_on_load=value).verify_on_load == value
    with pytest.raises(ValueError, match="verify_on_load"):
        lc.ShardedCheckpointIO(verify_on_load="none")  # type: ignore[arg-type]


def test_an_intact_checkpoint_loads_the_same_either_way(tmp_path):
    path = tmp_path / "last.ckpt"
    state = _save(path)
    for verify in (True, False):
        loaded = lc.load_checkpoint(path, verify=verify)
        assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"])
        assert torch.equal(loaded["optimizer_states"][0]["state"][0]["exp_avg"], state["optimizer_states"][0]["state"][0]["exp_avg"])


def test_many_shards_are_all_verified(tmp_path):
    """Shards are hashed on several threads: the damaged one is still named, and nothing leaks."""
    path = tmp_path / "many.ckpt"
    lc.save_checkpoint({"state_dict": {f"w{i}": torch.full((1024,), float(i)) for i in range(8)}}, path, max_shard_size=4096)
    shards = sorted(n for n in os.listdir(path) if n.startswith("model-"))
    assert len(shards) == 8
    assert lc.load_checkpoint(path)["state_dict"]["w5"][0] == 5
    _flip_in_data(path / shards[5])
    with pytest.raises(lc.CorruptCheckpointError) as info:
        lc.load_checkpoint(path)
    assert info.value.file == shards[5]


def test_v1_checkpoints_still_verify_on_load(tmp_path):
    path = tmp_path / GOLDEN_V1.name
    shutil.copytree(GOLDEN_V1, path)
    assert lc.load_checkpoint(path)["global_step"] == 42  # crc32 checked by default
    optimizer = path / "optimizer-00001-of-00001.safetensors"
    flip_byte(optimizer, os.path.getsize(optimizer) - 1)  # the last tensor byte
    with pytest.raises(lc.CorruptCheckpointError, match=r"crc32: expected") as info:
        lc.load_checkpoint(path)
    assert info.value.file == "optimizer-00001-of-00001.safetensors"
    with pytest.raises(lc.CorruptCheckpointError):
        lc.verify_checkpoint(path)
    assert lc.load_checkpoint(path, verify=False)["global_step"] == 42


def test_missing_path_uses_lightnings_wording(tmp_path):
    missing = tmp_path / "nope.ckpt"
    for load in (lambda: lc.load_checkpoint(missing), lambda: lc.ShardedCheckpointIO().load_checkpoint(missing)):
        with pytest.raises(FileNotFoundError) as info:
            load()
        assert isinstance(info.value, lc.CheckpointNotFoundError)
        assert str(info.value).startswith(f"Checkpoint file not found: {missing}")
    assert reader.not_found_message("x").startswith("Checkpoint file not found: x. ")
