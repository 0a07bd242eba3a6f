"""How a checkpoint dict's top-level keys name its shard files.

Trainer checkpoints keep the names of every earlier release (``state_dict`` -> ``model``,
``optimizer_states`` -> ``optimizer``, a user's ``model`` key beside them -> ``model_2``); any other
dict, such as Fabric's ``{"model": ..., "optimizer": ...}``, names each file after its key. A Fabric
checkpoint written with the earlier names (``model_2-...``, ``tests/golden/fabric-names-v2``) still
loads and verifies.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from distributed.sharded_fit import states_equal

import lightning_ckpt as lc
from lightning_ckpt.format.plan import component_names

OLD_FABRIC = Path(__file__).parent.parent / "golden" / "fabric-names-v2" / "iter=3.ckpt"


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        # The Trainer's layout: unchanged from every earlier release.
        (["epoch", "state_dict", "optimizer_states", "callbacks"], ["epoch", "model", "optimizer", "callbacks"]),
        (["model", "state_dict", "optimizer"], ["model_2", "model", "optimizer_2"]),
        (["state_dict", "metadata"], ["model", "metadata_2"]),
        # Fabric's layout: named after the keys.
        (["model", "optimizer", "iteration"], ["model", "optimizer", "iteration"]),
        (["teacher", "student", "optimizer"], ["teacher", "student", "optimizer"]),
        (["manifest", "metadata", "model"], ["manifest_2", "metadata_2", "model"]),
        (["a b", "a/b", 3, ""], ["a_b", "a_b_2", "3", "part"]),
    ],
)
def test_components_are_named_after_their_keys(keys, expected):
    assert list(component_names(keys).values()) == expected


def fabric_state() -> dict:
    return {
        "model": {"0.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "0.bias": torch.tensor([0.5, -0.5])},
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), 0.25)},
                1: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([0.125, 0.0625])},
            },
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "iteration": 3,
    }


def test_a_fabric_save_names_its_files_after_its_keys(tmp_path):
    path = tmp_path / "iter=3.ckpt"
    lc.save_checkpoint(fabric_state(), path)
    manifest = lc.verify_checkpoint(path)
    assert manifest.components == {
        "model": ["model-00001-of-00001.safetensors"],
        "optimizer": ["optimizer-00001-of-00001.safetensors"],
    }
    # The model's file is indexed as a Hugging Face checkpoint, keys as the state dict's.
    assert "model.safetensors.index.json" in os.listdir(path)
    from safetensors.torch import load_file

    assert set(load_file(path / "model-00001-of-00001.safetensors")) == {"0.weight", "0.bias"}
    assert states_equal(lc.load_checkpoint(path), fabric_state())


def test_a_fabric_checkpoint_with_the_earlier_names_still_loads():
    assert sorted(lc.verify_checkpoint(OLD_FABRIC).components) == ["model_2", "optimizer_2"]
    assert states_equal(lc.load_checkpoint(OLD_FABRIC), fabric_state())
