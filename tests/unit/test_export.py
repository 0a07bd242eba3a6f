"""``export_hf`` without transformers (as `make test` runs): the prefix is the single top-level
attribute, the config dict is written as it is, files split at ``max_shard_size``, tied memory
stored once; several attributes are refused, naming them."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

import lightning_ckpt as lc

CONFIG = {"model_type": "tiny", "hidden_size": 4}


@pytest.fixture(autouse=True)
def no_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError


def test_the_single_attribute_is_stripped_and_files_split_at_the_size(tmp_path):
    embed = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    state = {"net.embed.weight": embed, "net.head.weight": embed, "net.body.weight": torch.ones(4, 4)}  # head tied
    checkpoint = tmp_path / "c.ckpt"
    lc.save_checkpoint({"state_dict": state, "hyper_parameters": {"config": CONFIG, "lr": 0.1}}, checkpoint)
    result = lc.export_hf(checkpoint, tmp_path / "hf", max_shard_size=100, dtype="fp16")  # 128 + 32 bytes in fp16
    assert result["prefix"] == "net." and result["dropped_tied"] == ["head.weight"]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"embed.weight", "body.weight"} and len(set(index["weight_map"].values())) == 2
    loaded = {}
    for file in set(index["weight_map"].values()):
        loaded.update(load_file(tmp_path / "hf" / file))
    assert torch.equal(loaded["embed.weight"], embed.half()) and loaded["body.weight"].dtype == torch.float16
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == CONFIG


def test_several_attributes_are_refused_naming_them(tmp_path):
    state = {"student.w": torch.ones(2), "teacher.w": torch.zeros(2)}
    checkpoint = tmp_path / "c.ckpt"
    lc.save_checkpoint({"state_dict": state, "hyper_parameters": CONFIG}, checkpoint)
    with pytest.raises(lc.ExportError, match="several top-level attributes \\('student', 'teacher'\\)"):
        lc.export_hf(checkpoint, tmp_path / "hf")
    result = lc.export_hf(checkpoint, tmp_path / "hf", prefix="student")
    assert result["files"] == ["model.safetensors"]
    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")["w"], torch.ones(2))
