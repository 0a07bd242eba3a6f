"""ChunkedAdamW under DDP on 2 CPU ranks (gloo): each rank holds its share, results are exact."""

from __future__ import annotations

import pytest
from helpers import run_script

pytestmark = pytest.mark.distributed


def test_chunked_adamw_ddp_on_two_cpu_ranks(tmp_path):
    result = run_script("distributed/chunked_adamw_fit.py", tmp_path=tmp_path)
    assert result["world_size"] == 2
    owned = result["owned_per_rank"]
    assert sum(owned) == result["chunks"] and all(n >= 1 for n in owned)
    # each rank's host memory holds its share of the chunks only (12 B/param in all)
    assert result["host_bytes"] <= 0.5 * result["unsharded_bytes"]
    assert result["equals_adamw_ddp"] and result["losses_equal_adamw_ddp"]
    # one process on the same global batch: the gradients are summed in another order
    assert result["max_diff_single_process"] < 1e-5
    assert result["resumed_equals_uninterrupted"] and result["ranks_agree"]
    assert result["saved_state_params"] == 6 and result["saved_state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
