"""Golden files of format version 3 (``SHARDED_FORMAT_VERSION``): the 2-rank save committed under
``tests/golden/v3`` (made by ``tests/golden/make_v3.py``: parameters and AdamW moments sharded on
dim 0 over 2 ranks, replicated tensors spread over their holders) loads in one process, without a
process group, bit for bit into what the generator saved; its merged manifest keeps its fields;
verification passes, and fails naming a damaged part of either rank.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from golden.make_v3 import GOLDEN_V3, SHARDED, WORLD_SIZE, golden_sharded_checkpoint
from helpers import flip_byte

import lightning_ckpt as lc
from lightning_ckpt.format import manifest as fmt


def _tensors(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint tree by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def test_golden_v3_verifies_and_its_manifest_is_the_merged_one():
    manifest = lc.verify_checkpoint(GOLDEN_V3)
    assert manifest.format_version == fmt.SHARDED_FORMAT_VERSION == 3
    assert manifest.checksum == "xxh3_64" and manifest.extra == {"world_size": WORLD_SIZE}
    assert (manifest.epoch, manifest.global_step) == (0, 3)
    assert manifest.metadata_file == fmt.METADATA_FILE and manifest.model_index_file == fmt.MODEL_INDEX_FILE
    on_disk = {p.name for p in GOLDEN_V3.iterdir()}
    assert on_disk == set(manifest.files) | {fmt.MANIFEST_FILE}
    # every shard file is owned by the rank its name says; rank 0 owns the shared files it committed
    for name, record in manifest.files.items():
        if name.endswith(".safetensors"):
            assert f"rank{record.rank:05d}" in name, name
        else:
            assert record.rank == 0, name
    assert {r.rank for n, r in manifest.files.items() if n.endswith(".safetensors")} == {0, 1}
    assert set(manifest.components) == {"model", "optimizer", "callbacks"}
    assert {n for names in manifest.components.values() for n in names} == {n for n in on_disk if n.endswith(".safetensors")}


def test_golden_v3_sharded_tensors_are_chunks_of_both_ranks_and_replicated_ones_whole():
    manifest = lc.verify_checkpoint(GOLDEN_V3)
    records, files = {"/".join(map(str, r.path)): r for r in manifest.tensors}, manifest.files
    for name in SHARDED:
        record = records[f"state_dict/{name}"]
        assert record.chunks is not None and [files[c["file"]].rank for c in record.chunks] == [0, 1]
        rows = [c["shape"][0] for c in record.chunks]
        assert sum(rows) == record.shape[0] and [c["offsets"][0] for c in record.chunks] == [0, rows[0]]
    assert [c["shape"] for c in records["state_dict/encoder.bias"].chunks] == [[3], [2]]  # uneven
    for name in ("norm.weight", "norm.num_batches_tracked"):
        assert records[f"state_dict/{name}"].chunks is None
    for moments in ("exp_avg", "exp_avg_sq"):
        assert all(records[f"optimizer_states/0/state/{i}/{moments}"].chunks for i in range(len(SHARDED)))


def test_golden_v3_loads_bit_exact_in_one_process():
    expected = golden_sharded_checkpoint()
    got = lc.load_checkpoint(GOLDEN_V3)  # verifies every file by default
    assert got.keys() == expected.keys()
    want, have = _tensors(expected), _tensors(got)
    assert have.keys() == want.keys()
    for path, value in want.items():
        assert have[path].dtype == value.dtype and have[path].shape == value.shape, path
        assert torch.equal(have[path], value), path
    assert list(got["state_dict"]) == list(expected["state_dict"])
    for key in ("epoch", "global_step", "pytorch-lightning_version", "loops", "lr_schedulers", "hyper_parameters"):
        assert got[key] == expected[key], key
    assert got["optimizer_states"][0]["param_groups"] == expected["optimizer_states"][0]["param_groups"]
    assert got["callbacks"]["EMA"]["decay"] == expected["callbacks"]["EMA"]["decay"]


@pytest.mark.parametrize("rank", [0, 1])
def test_golden_v3_verify_names_a_damaged_part_of_either_rank(tmp_path, rank):
    copy = tmp_path / GOLDEN_V3.name
    shutil.copytree(GOLDEN_V3, copy)
    damaged = f"optimizer-rank{rank:05d}-00001-of-00001.safetensors"
    header = int.from_bytes((copy / damaged).read_bytes()[:8], "little")
    flip_byte(copy / damaged, 8 + header)  # the first data byte
    with pytest.raises(lc.CorruptCheckpointError, match=damaged):
        lc.verify_checkpoint(copy)
