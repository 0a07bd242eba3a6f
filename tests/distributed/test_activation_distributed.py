"""ActivationCheckpointing with DDP, ModelParallelStrategy (FSDP2) and FSDPStrategy (FSDP1) on 2 CPU
ranks (gloo): bit-identical losses and full weights, unchanged keys, recompute observed, removed
after fit."""

from __future__ import annotations

import pytest
from helpers import run_script

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1"])
def test_two_cpu_ranks_train_bit_identically_with_activation_checkpointing(tmp_path, strategy):
    result = run_script("distributed/activation_fit.py", strategy, tmp_path=tmp_path)
    assert result["world_size"] == 2
    assert "blocks.0.fc1.weight" in result["keys"]  # no "_checkpoint_wrapped_module" anywhere
    assert result["plain_block_runs"] == [3, 3]
    # The callback applies after the strategy's setup (FSDP2: after fully_shard); the helper in
    # configure_model applies before fully_shard. Both train exactly as without checkpointing.
    for run in ["callback", "helper"] if strategy == "fsdp2" else ["callback"]:
        assert result[run]["losses_equal"] and result[run]["weights_equal"], run
        assert result[run]["keys_equal"], run
        # FSDP1: each block sits inside its FSDP unit, where the callback finds and wraps it.
        inner = "._fsdp_wrapped_module" if strategy == "fsdp1" else ""
        assert result[run]["checkpointed"] == [f"blocks.0{inner}", f"blocks.1{inner}"], run
        assert result[run]["block_runs"] == [6, 6], run  # forward + recompute, every step
    assert result["callback"]["removed_after_fit"]
    assert result["all_ranks_equal"]
