"""ChunkedAdamW under DDP on 2 CPU ranks (gloo): each rank holds its share, results are exact."""

from __future__ import annotations

import pytest
from helpers import run_script

pytestmark = pytest.mark.distributed


def test_chunked_adamw_ddp_on_two_cpu_ranks(tmp_path):
    result = run_script("distributed/chunked_adamw_fit.py", tmp_path=tmp_path)
    assert result["world_size"] == 2
    assert result["exchange_backend"] == "gloo"  # "auto": the host exchange
    owned = result["owned_per_rank"]
    assert sum(owned) == result["chunks"] and all(n >= 1 for n in owned)
    # each rank's host memory holds its share of the chunks only (12 B/param in all)
    assert result["host_bytes"] <= 0.5 * result["unsharded_bytes"]
    assert result["equals_adamw_ddp"] and result["losses_equal_adamw_ddp"]
    # one process on the same global batch: the gradients are summed in another order
    assert result["max_diff_single_process"] < 1e-5
    assert result["resumed_equals_uninterrupted"] and result["ranks_agree"]
    assert result["saved_state_params"] == 6 and result["saved_state_keys"] == ["exp_avg", "exp_avg_sq", "step"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_rank_writes_its_own_share_and_the_checkpoint_loads_anywhere(tmp_path, mode):
    result = run_script("distributed/chunked_adamw_shares.py", mode, tmp_path=tmp_path)
    assert result["world_size"] == 2
    # each moment is written once, by the rank owning its chunk; both ranks write; no gather at the save
    assert result["writers"] == {f"{k}/{m}": [owner] for k, owner in result["owner"].items() for m in ("exp_avg", "exp_avg_sq")}
    assert set(result["owner"].values()) == {0, 1}
    assert result["gathered_at_save"] == 0
    # async: each rank's arena copied exactly its own moments into its staging pool (sync: nothing)
    expected = [[owned if mode == "async" else 0, owned] for _, owned in result["arena_staged_and_owned_bytes"]]
    assert result["arena_staged_and_owned_bytes"] == expected and all(owned > 0 for _, owned in expected)
    # what was written is torch's full AdamW state; it resumes on 2 ranks bit for bit, on 1 rank
    # alike with ChunkedAdamW and torch.optim.AdamW (gradients summed in another order than on 2)
    assert result["saved_equals_full_state"]
    assert result["resumed_equals_uninterrupted"] and result["ranks_agree"]
    assert result["one_rank_chunked_equals_adamw"] and result["one_rank_max_diff"] < 1e-5
