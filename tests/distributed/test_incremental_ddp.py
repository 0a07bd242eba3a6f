"""Incremental saves under DDP on CPU (gloo, 2 ranks): each rank reuses its own unchanged files."""

from __future__ import annotations

import pytest
from helpers import run_script

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_rank_reuses_its_frozen_shards_and_each_checkpoint_stands_alone(tmp_path, mode):
    result = run_script("distributed/incremental_fit.py", mode, tmp_path=tmp_path)
    assert result["world_size"] == 2
    stable = result["stable"]
    names = [f"step={step}.ckpt" for step in range(1, 5)]
    assert sorted(stable) == names
    # Both ranks wrote stable shards (DDP spreads the writes), written at the first save only:
    # every later checkpoint holds the very same files (hard links).
    first = stable[names[0]]
    assert {name.split("-")[1] for name in first} == {"rank00000", "rank00001"}, first
    assert all(stable[name] == first for name in names[1:]), stable
    records = result["records"]
    assert [r["global_step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["reused_bytes"] == 0
    assert all(r["reused_bytes"] > 0.9 * records[0]["nbytes"] for r in records[1:]), records
    assert result["stands_alone"] == dict.fromkeys(names, True)
