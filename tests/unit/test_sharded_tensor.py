"""ShardedTensors (FSDP1's sharded state dicts) through the multi-rank save, on a real one-rank
gloo group: pieces saved and assembled on load; one sharded over fewer ranks than the save
(FSDP1's HYBRID_SHARD without a device mesh) refused with the fix before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import one_rank_group, save_sharded_weight, sharded_tensor

import lightning_ckpt as lc


def test_local_pieces_are_saved_apart_and_assembled_on_load(tmp_path):
    full = torch.arange(24.0).reshape(6, 4)
    save_sharded_weight(tmp_path / "c.ckpt", full, 3)
    (record,) = json.loads((tmp_path / "c.ckpt" / "manifest.json").read_text())["tensors"]
    assert [chunk["offsets"] for chunk in record["chunks"]] == [[0, 0], [2, 0], [4, 0]]
    assert torch.equal(lc.load_checkpoint(tmp_path / "c.ckpt", verify=True)["state_dict"]["w"], full)


def test_a_sharded_tensor_over_part_of_the_ranks_is_refused_with_the_fix(tmp_path):
    with one_rank_group(tmp_path):
        io = lc.ShardedCheckpointIO()
        try:
            # This tensor is sharded over the group's one rank; the save spans two (the other
            # node's replica of the same pieces).
            with pytest.raises(ValueError, match=r"sharded over 1 of the 2 ranks.*device_mesh=\(replicas, shards\)"):
                state = {"state_dict": {"w": sharded_tensor(torch.ones(4, 2), 2)}}
                io.save_sharded(state, tmp_path / "c.ckpt", 0, 2, lambda token: token)
        finally:
            io.teardown()
    assert not (tmp_path / "c.ckpt").exists()
