"""DDP and FSDP2 on CPU (gloo, 2 ranks) saving to and resuming from a real S3-compatible server."""

from __future__ import annotations

import pytest
from helpers import run_script
from s3_server import set_environment, start_or_skip

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("mode", ["rank0", "local_tier"])
def test_ddp_saves_to_s3_and_resumes(tmp_path, monkeypatch, mode):
    server = start_or_skip()
    try:
        set_environment(monkeypatch, server)
        server.filesystem().makedirs("ddp", exist_ok=True)
        result = run_script("distributed/ddp_s3_fit.py", mode, f"s3://ddp/{mode}/run", tmp_path=tmp_path)
    finally:
        server.stop()
    assert result["world_size"] == 2
    assert "last.ckpt" in result["checkpoints"] and len(result["checkpoints"]) == 3
    assert result["resumed_equals_reference"] and result["ranks_agree"]
    assert result["global_step"] == 8
    # Without a local tier rank 0 writes everything; with one, every rank writes its part.
    assert result["ranks_in_last"] == ([] if mode == "rank0" else [0, 1])


def test_fsdp2_saves_to_s3_through_a_shared_tier_and_resumes_from_the_url(tmp_path, monkeypatch):
    server = start_or_skip()
    try:
        set_environment(monkeypatch, server)
        server.filesystem().makedirs("fsdp", exist_ok=True)
        result = run_script("distributed/sharded_fit.py", "s3", "2", "s3://fsdp/run", tmp_path=tmp_path)
    finally:
        server.stop()
    assert result["world_size"] == 2 and result["global_step"] == 8
    assert result["resumed_equals_uninterrupted"]
    # The fresh tier held nothing: rank 0 downloaded the checkpoint, both ranks read it.
    assert result["downloaded"] == ["s3/fsdp/run/epoch=0-step=4.ckpt"]
    # The resumed run's own (stock, local) checkpoint callback did not remove what it resumed from.
    assert result["remote_after_resume"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
