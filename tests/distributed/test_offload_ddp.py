"""Checkpoints move between ChunkedOffloadStrategy (one process) and a 2-rank DDP Trainer (gloo)."""

from __future__ import annotations

import pytest
from helpers import run_script

pytestmark = pytest.mark.distributed


def test_checkpoints_move_between_the_offload_strategy_and_ddp_both_ways(tmp_path):
    result = run_script("distributed/offload_ddp_resume.py", tmp_path=tmp_path)
    assert result["world_size"] == 2
    # the offload runs streamed: the parameters do not fit the device at once
    assert result["budget"] < result["param_bytes"]
    assert all(n > 0 for n in result["offload_streamed_chunks"]) and result["offload_peak_within_budget"]
    # offload -> DDP: the offload checkpoint is the default strategy's, bit for bit, and the ranks
    # hold exactly its weights and AdamW state after the load (ChunkedAdamW shares, torch's AdamW)
    assert result["offload_ckpt_equals_default_ckpt"]
    assert result["offload_to_ddp_loaded_equals_ckpt"] and result["default_to_ddp_loaded_equals_ckpt"]
    assert result["offload_to_ddp_adamw_loaded_equals_ckpt"]
    # ... and so train alike from there: from either checkpoint, with either optimizer
    assert result["offload_to_ddp_losses_equal_default"] and result["offload_to_ddp_weights_equal_default"]
    assert result["offload_to_ddp_adamw_losses_equal_chunked"]
    assert result["offload_to_ddp_adamw_weights_equal_chunked"]
    assert result["offload_to_ddp_steps"] == result["ddp_to_offload_steps"] == 4  # the second epoch
    assert result["offload_to_ddp_ranks_agree"]
    # against the uninterrupted runs the gradients were summed in another order
    assert result["offload_to_ddp_max_diff_ddp"] < 1e-5
    assert result["offload_to_ddp_max_diff_one_process"] < 1e-5
    # DDP -> offload: each rank wrote its own ChunkedAdamW share; the 2-rank checkpoint loads exactly into the host chunks and trains as under
    # the default strategy
    assert result["ddp_ckpt_moment_writers"] == [0, 1]
    assert result["ddp_to_offload_loaded_equals_ckpt"] and result["ddp_to_default_loaded_equals_ckpt"]
    assert result["ddp_to_offload_losses_equal_default"] and result["ddp_to_offload_weights_equal_default"]
