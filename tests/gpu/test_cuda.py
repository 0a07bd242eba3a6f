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


def test_async_cuda_snapshot_pinned_pool_and_handoff_before_optimizer_step(tmp_path):
    model = torch.nn.Linear(512, 512).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512, device="cuda")).sum().backward()
    optimizer.step()
    io = lc.ShardedCheckpointIO(async_save=True)
    try:
        state = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        io.save_checkpoint(state, tmp_path / "gpu.ckpt")
        assert io._pool._pinned  # page-locked staging
        assert io._deferred is not None  # the host did not wait for the device-to-host copies
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # queued on the training stream after the copies: must not leak into them
        model(torch.randn(4, 512, device="cuda")).sum().backward()
        optimizer.step()  # the pre-step hook hands the staged checkpoint to the writer
        assert io._deferred is None
        io.wait()
    finally:
        io.teardown()
    saved = lc.load_checkpoint(tmp_path / "gpu.ckpt", verify=True)["state_dict"]
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key


def test_release_memory_empties_a_fragmented_cuda_cache():
    import gc

    from lightning_ckpt.memory import release_memory

    # release_memory() starts with gc.collect(): collect first whatever earlier tests in this
    # process left in reference cycles (it can hold CUDA tensors), so that the allocated bytes
    # compared below are this test's live tensors alone.
    gc.collect()
    keep = [torch.empty(1 << 20, device="cuda") for _ in range(64)]
    del keep[::2]  # half of the blocks freed: reserved >> allocated
    report = release_memory(cuda_fragmentation_threshold=0.1)
    assert report.before.cuda_fragmentation > 0.1
    assert report.cuda_cache_emptied and report.after.cuda_reserved <= report.before.cuda_reserved
    assert report.after.cuda_allocated == report.before.cuda_allocated  # nothing live was touched
