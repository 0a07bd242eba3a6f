"""Incremental saves of CUDA state: a frozen backbone under a head trained by fused AdamW (CUDA
kernels that bump no version counter themselves), sync and async."""

from __future__ import annotations

import os

import pytest
import torch

import lightning_ckpt as lc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_frozen_cuda_backbone_is_reused_and_fused_steps_are_written(tmp_path, async_save):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8)).cuda()
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW(model[1].parameters(), fused=True)
    io = lc.ShardedCheckpointIO(async_save=async_save)
    io.track_frozen(model)
    states = {}
    for step in range(3):
        model(torch.randn(16, 1024, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        path = tmp_path / f"{step}.ckpt"
        io.save_checkpoint({"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}, path)
        states[path] = {k: v.clone() for k, v in model.state_dict().items()}
        io.wait()
        stable = os.path.getsize(path / "model-stable-00001-of-00001.safetensors")
        result = io.last_save if not async_save else io.poll()[-1]
        assert result.reused_bytes == (stable if step else 0)
    for path, state in states.items():
        loaded = lc.load_checkpoint(path, map_location="cuda")["state_dict"]
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
    io.teardown()
