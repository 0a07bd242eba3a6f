"""Fabric on 2 CPU ranks (gloo): ``fabric.save`` / ``fabric.load`` through ``ShardedCheckpointIO``.

FSDP2 (``ShardedFabricModelParallelStrategy``) and FSDP (``ShardedFabricFSDPStrategy``) write from
every rank and reshard on load (2 -> 1 ranks); DDP works with Fabric's own strategy (rank 0
writes) and with ``ShardedFabricDDPStrategy`` (every rank writes, async saves load once
committed). Every rank checks that the restored state equals the saved one and that training on
from it ends bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import json

import pytest
from helpers import run_script

import lightning_ckpt as lc

pytestmark = pytest.mark.distributed


def _writers(checkpoint) -> set[int]:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    return {record.get("rank", 0) for name, record in manifest["files"].items() if name.endswith(".safetensors")}


def _train(tmp_path, strategy: str) -> dict:
    result = run_script("distributed/fabric_fit.py", "train", strategy, "2", tmp_path=tmp_path)
    assert result["world_size"] == 2 and result["step"] == 3 and result["remainder"] == {"note": "fabric"}
    assert result["restored_equals_saved"] == [True, True]
    assert result["resumed_equals_uninterrupted"] == [True, True]
    assert result["model_only_equals_saved"] == [True, True]
    assert result["filtered_load"] == [True, True]
    lc.verify_checkpoint(tmp_path / "step=3.ckpt")
    return result


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_sharded_strategies_write_from_every_rank_and_reshard_to_one(tmp_path, strategy):
    result = _train(tmp_path, strategy)
    checkpoint = tmp_path / "step=3.ckpt"
    assert _writers(checkpoint) == {0, 1}
    # The model alone: the optimizer's (sharded) state is neither read nor returned.
    assert result["partial_remainder"] == ["note", "step"]
    # Onto one rank, into FSDP2 (an FSDP checkpoint too).
    resharded = run_script(
        "distributed/fabric_fit.py", "reshard", "fsdp2", "1", str(checkpoint), str(tmp_path / "full-3.pt"), tmp_path=tmp_path
    )
    assert resharded == {"world_size": 1, "step": 3, "restored_equals_saved": True}


def test_fsdp2_async(tmp_path, monkeypatch):
    monkeypatch.setenv("LCKPT_TEST_ASYNC", "1")
    _train(tmp_path, "fsdp2")
    assert _writers(tmp_path / "step=3.ckpt") == {0, 1}


def test_fabrics_own_ddp_saves_from_rank_0_and_every_rank_loads(tmp_path):
    result = _train(tmp_path, "ddp")
    assert _writers(tmp_path / "step=3.ckpt") == {0}
    assert result["partial_remainder"] == ["note", "optimizer", "step"]  # replicated: returned whole


def test_sharded_ddp_spreads_writes_and_loads_an_async_save_once_committed(tmp_path, monkeypatch):
    monkeypatch.setenv("LCKPT_TEST_ASYNC", "1")
    _train(tmp_path, "sharded-ddp")
    assert _writers(tmp_path / "step=3.ckpt") == {0, 1}
