"""CUDA paths: device tensors stream to disk chunk by chunk and load back onto the device."""

from __future__ import annotations

import pytest
import torch

import lightning_ckpt as lc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_tensors_roundtrip_and_map_location(tmp_path):
    state = {
        "state_dict": {"w": torch.randn(1000, 1000, device="cuda"), "h": torch.randn(10, device="cuda").half()},
        "optimizer_states": [{"state": {0: {"m": torch.ones(7, device="cuda")}}}],
    }
    io = lc.ShardedCheckpointIO(buffer_size="1MiB")  # the 4 MB tensor crosses several buffers
    io.save_checkpoint(state, tmp_path / "c.ckpt")
    on_cpu = io.load_checkpoint(tmp_path / "c.ckpt")
    assert on_cpu["state_dict"]["w"].device.type == "cpu"
    assert torch.equal(on_cpu["state_dict"]["w"], state["state_dict"]["w"].cpu())
    on_gpu = lc.load_checkpoint(tmp_path / "c.ckpt", map_location="cuda:0", verify=True)
    assert on_gpu["state_dict"]["w"].device.type == "cuda"
    assert torch.equal(on_gpu["state_dict"]["w"], state["state_dict"]["w"])
    back = lc.load_checkpoint(tmp_path / "c.ckpt", map_location={"cuda:0": "cuda:0"})
    assert back["optimizer_states"][0]["state"][0]["m"].device.type == "cuda"


def test_tied_cuda_weights_stay_tied(tmp_path):
    emb = torch.randn(64, 8, device="cuda")
    lc.save_checkpoint({"state_dict": {"a": emb, "b": emb}}, tmp_path / "t.ckpt")
    out = lc.load_checkpoint(tmp_path / "t.ckpt", map_location="cuda")["state_dict"]
    assert out["a"].data_ptr() == out["b"].data_ptr() and torch.equal(out["a"], emb)
