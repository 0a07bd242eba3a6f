"""A ShardedTensor sharded over fewer ranks than the save (FSDP1's HYBRID_SHARD without a device
mesh) is refused with the fix, before anything is written: its replicas hold the same pieces."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightning_ckpt as lc


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_tensor_over_part_of_the_ranks_is_refused_with_the_fix(tmp_path, one_rank_group):
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    local = torch.arange(6.0).reshape(2, 3)
    weight = init_from_local_shards([Shard(local, ShardMetadata([0, 0], [2, 3], "rank:0/cpu"))], [2, 3])
    io = lc.ShardedCheckpointIO()
    try:
        # This group is the one rank; the save spans two (the other node's replica).
        with pytest.raises(ValueError, match=r"sharded over 1 of the 2 ranks.*device_mesh=\(replicas, shards\)"):
            io.save_sharded({"state_dict": {"w": weight}}, tmp_path / "c.ckpt", 0, 2, lambda token: token)
        # Over every rank of the save, the same tensor is saved and loads back whole.
        io.save_sharded({"state_dict": {"w": weight}}, tmp_path / "ok.ckpt", 0, 1, lambda token: token)
    finally:
        io.teardown()
    assert not (tmp_path / "c.ckpt").exists()
    assert torch.equal(lc.load_checkpoint(tmp_path / "ok.ckpt")["state_dict"]["w"], local)
