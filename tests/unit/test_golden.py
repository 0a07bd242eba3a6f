"""Golden files pin the on-disk format in both directions.

* The committed checkpoints under ``tests/golden/v1`` (zlib crc32) and ``tests/golden/v2``
  (XXH3-64, written today) must load and verify into exactly ``golden_checkpoint()`` (old
  checkpoints stay readable and checkable).
* Saving ``golden_checkpoint()`` today must reproduce every file of ``tests/golden/v2`` byte for
  byte, and its manifest up to the version stamps (the writer has not drifted).
* Version 2 changed the manifest only: every other v1 file is byte-identical to its v2 twin.

Never regenerate v1. Regenerate v2 only with a deliberate format change, and a new version
directory with a FORMAT_VERSION bump instead once v2 has been released:
``python tests/unit/test_golden.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import lightning_ckpt as lc
from lightning_ckpt.format import manifest as fmt

GOLDEN_V1 = Path(__file__).parent.parent / "golden" / "v1" / "epoch=1-step=42.ckpt"
GOLDEN = Path(__file__).parent.parent / "golden" / f"v{fmt.FORMAT_VERSION}" / "epoch=1-step=42.ckpt"


def golden_checkpoint() -> dict:
    emb = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    state = OrderedDict(
        [
            ("embed.weight", emb),
            ("head.weight", emb),  # tied
            ("norm.weight", torch.tensor([1.0, 0.5, 0.25], dtype=torch.bfloat16)),
            ("norm.num_batches_tracked", torch.tensor(42)),
            ("mask", torch.tensor([True, False, True])),
            ("half", torch.arange(5, dtype=torch.float16)),
        ]
    )
    state._metadata = OrderedDict([("", {"version": 1}), ("norm", {"version": 2})])
    return {
        "epoch": 1,
        "global_step": 42,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": state,
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 2, "completed": 1}}, "state_dict": {}}},
        "callbacks": {"EMA": {"shadow": {"embed.weight": emb * 0.5}, "decay": 0.999}},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(42.0), "exp_avg": torch.full((4, 3), 0.125)}},
                "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}],
            }
        ],
        "lr_schedulers": [{"last_epoch": 1, "_last_lr": [0.001]}],
        "hyper_parameters": {"hidden": 3, "name": "golden", "ratio": float("inf")},
    }


def _manifest_without_versions(path: Path) -> dict:
    body = json.loads((path / "manifest.json").read_text())
    body.pop("created_by")
    body.pop("manifest_crc32")
    return body


@pytest.mark.parametrize(
    ("golden", "version", "algorithm"), [(GOLDEN_V1, 1, "crc32"), (GOLDEN, 2, "xxh3_64")], ids=["v1", "v2"]
)
def test_golden_checkpoint_loads_and_verifies(golden, version, algorithm):
    manifest = lc.verify_checkpoint(golden)
    assert (manifest.format_version, manifest.checksum) == (version, algorithm)
    expected = golden_checkpoint()
    got = lc.load_checkpoint(golden)  # verifies every file by default
    assert got.keys() == expected.keys()
    assert got["state_dict"]._metadata == expected["state_dict"]._metadata
    for key, value in expected["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value) and got["state_dict"][key].dtype == value.dtype
    assert got["state_dict"]["embed.weight"].data_ptr() == got["state_dict"]["head.weight"].data_ptr()
    assert torch.equal(got["callbacks"]["EMA"]["shadow"]["embed.weight"], expected["callbacks"]["EMA"]["shadow"]["embed.weight"])
    assert torch.equal(got["optimizer_states"][0]["state"][0]["exp_avg"], expected["optimizer_states"][0]["state"][0]["exp_avg"])
    for key in ("epoch", "global_step", "pytorch-lightning_version", "loops", "lr_schedulers", "hyper_parameters"):
        assert got[key] == expected[key], key
    assert got["optimizer_states"][0]["param_groups"] == expected["optimizer_states"][0]["param_groups"]


def test_writer_reproduces_golden_bytes(tmp_path):
    path = tmp_path / GOLDEN.name
    lc.save_checkpoint(golden_checkpoint(), path)
    assert sorted(os.listdir(path)) == sorted(os.listdir(GOLDEN))
    for name in os.listdir(GOLDEN):
        if name != "manifest.json":
            assert (path / name).read_bytes() == (GOLDEN / name).read_bytes(), f"{name} drifted from format v2"
    assert _manifest_without_versions(path) == _manifest_without_versions(GOLDEN)


def test_v2_changed_only_the_manifest():
    assert sorted(os.listdir(GOLDEN_V1)) == sorted(os.listdir(GOLDEN))
    for name in os.listdir(GOLDEN_V1):
        if name != "manifest.json":
            assert (GOLDEN_V1 / name).read_bytes() == (GOLDEN / name).read_bytes(), name
    v1, v2 = _manifest_without_versions(GOLDEN_V1), _manifest_without_versions(GOLDEN)
    assert (v1.pop("format_version"), v1.pop("checksum"), v2.pop("format_version"), v2.pop("checksum")) == (
        1, "crc32", 2, "xxh3_64"
    )
    assert {name: record["size"] for name, record in v1.pop("files").items()} == {
        name: record["size"] for name, record in v2.pop("files").items()
    }
    assert v1 == v2


if __name__ == "__main__":
    assert GOLDEN != GOLDEN_V1, "v1 is released: never rewrite it"
    shutil.rmtree(GOLDEN, ignore_errors=True)
    lc.save_checkpoint(golden_checkpoint(), GOLDEN)
    print("wrote", GOLDEN, sorted(os.listdir(GOLDEN)))
