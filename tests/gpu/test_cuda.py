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


def test_loading_a_sharded_save_onto_the_gpu_holds_the_state_once(tmp_path):
    from helpers import save_sharded_weight

    full = torch.randn(64 * 2**20 // 4, 4)  # 256 MiB in 8 pieces
    save_sharded_weight(tmp_path / "c.ckpt", full, 8)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loaded = lc.load_checkpoint(tmp_path / "c.ckpt", map_location="cuda")["state_dict"]["w"]
    assert loaded.is_cuda and torch.equal(loaded.cpu(), full)
    # The pieces are copied from the mapped file into the assembled tensor, not staged on the GPU.
    assert torch.cuda.max_memory_allocated() - before <= full.nbytes + 2**20


def _bn_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 8)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(16, 512, device="cuda")).sum().backward()
    optimizer.step()
    return model, optimizer


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()]}


def _host_copy(state: dict) -> dict:
    return {
        "model": {k: v.detach().cpu().clone() for k, v in state["state_dict"].items()},
        "optim": {(i, k): v.cpu().clone() for i, s in state["optimizer_states"][0]["state"].items() for k, v in s.items()},
    }


def _assert_saved(path, expected: dict) -> None:
    saved = lc.load_checkpoint(path, verify=True)
    for key, value in expected["model"].items():
        assert torch.equal(saved["state_dict"][key], value), key
    for (i, key), value in expected["optim"].items():
        assert torch.equal(saved["optimizer_states"][0]["state"][i][key].cpu(), value), (i, key)


@pytest.mark.parametrize("closure", [False, True], ids=["step", "step-with-closure"])
def test_async_copies_overlap_forward_backward_and_are_handed_over_before_the_step(tmp_path, closure):
    io = lc.ShardedCheckpointIO(async_save=True)  # first: it sees the optimizer step in _bn_model
    model, optimizer = _bn_model()
    try:
        state = _snapshot(model, optimizer)
        expected = _host_copy(state)
        io.prepare_staging(64 * 2**20, on_device=True)
        io.async_saver.pool.preparer.wait_for(io.async_saver.pool.nbytes)  # no page-locking inside this save
        torch.cuda.synchronize()
        # Keep the training stream busy for a while: the copies (ordered after it) are still in
        # flight when the step comes, so the hand-over is exercised whatever the GPU's speed.
        torch.cuda._sleep(int(2e9))
        with io.overlapping():
            io.save_checkpoint(state, tmp_path / "gpu.ckpt")
        assert io.async_saver.pool.pinned_bytes > 0  # page-locked staging
        pending = io.async_saver.pending
        assert pending is not None  # the host did not wait for the device-to-host copies
        handed = []

        def forward_backward():
            handed.append(pending.copies._handed)
            # Training mode: BatchNorm updates its running statistics in place during the forward:
            # they were copied first and waited for at once, so this must not leak into the save.
            model(torch.randn(16, 512, device="cuda")).sum().backward()
            handed.append(pending.copies._handed)

        if closure:  # Lightning's automatic optimization: forward and backward run inside step()
            optimizer.step(lambda: forward_backward())
        else:
            forward_backward()
            optimizer.step()  # the pre-step hook orders the in-place update after the copies
        assert handed == [False, False]  # the copies were not waited for before or during backward
        assert pending.copies._handed or pending.copies.landed()  # ordered after them, or no need
        io.wait()
        assert io.async_saver.pending is None
        torch.cuda.synchronize()
        assert io.copy_wait_seconds(tmp_path / "gpu.ckpt") >= 0.0
    finally:
        io.teardown()
    _assert_saved(tmp_path / "gpu.ckpt", expected)


def test_async_save_of_non_contiguous_cuda_tensors_is_exact(tmp_path):
    # channels_last weights and their AdamW moments are not contiguous: each is packed for the
    # copy on the side stream, after its wait, not in a temporary the training stream reuses.
    io = lc.ShardedCheckpointIO(async_save=True)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 64, 3), torch.nn.Conv2d(64, 64, 3)).cuda()
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 16, 32, 32, device="cuda").to(memory_format=torch.channels_last)
    model(x).sum().backward()
    optimizer.step()
    try:
        state = _snapshot(model, optimizer)
        assert not state["state_dict"]["0.weight"].is_contiguous()
        expected = _host_copy(state)
        torch.cuda._sleep(int(1e9))  # the copies queue behind a busy training stream
        with io.overlapping():
            io.save_checkpoint(state, tmp_path / "cl.ckpt")
        for _ in range(3):  # allocations that would reuse a freed temporary's memory
            model(torch.randn_like(x)).sum().backward()
        optimizer.step()
        io.wait()
    finally:
        io.teardown()
    _assert_saved(tmp_path / "cl.ckpt", expected)


def test_async_copies_outside_overlapping_are_waited_for_at_once(tmp_path):
    model, optimizer = _bn_model()
    io = lc.ShardedCheckpointIO(async_save=True)
    try:
        state = _snapshot(model, optimizer)
        expected = _host_copy(state)
        io.save_checkpoint(state, tmp_path / "gpu.ckpt")
        pending = io.async_saver.pending
        assert pending is None or pending.copies._handed  # the training stream already waits for them
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # in place, outside optimizer.step(): ordered after the copies
        io.wait()
    finally:
        io.teardown()
    _assert_saved(tmp_path / "gpu.ckpt", expected)


def test_staging_pool_is_pinned_in_the_background_before_the_first_save(tmp_path):
    model, optimizer = _bn_model()
    io = lc.ShardedCheckpointIO(async_save=True)
    try:
        io.prepare_staging(600 * 2**20, on_device=True)  # more than one PIN_CHUNK
        pool = io.async_saver.pool
        assert pool.nbytes > 600 * 2**20
        pool.preparer.wait_for(pool.nbytes)
        assert pool.pinned_bytes == pool.nbytes
        generation = pool.generation
        state = _snapshot(model, optimizer)
        expected = _host_copy(state)
        io.save_checkpoint(state, tmp_path / "gpu.ckpt")
        assert pool.generation == generation  # the prepared pool was used, not replaced
        io.wait()
    finally:
        io.teardown()
    _assert_saved(tmp_path / "gpu.ckpt", expected)


def test_release_memory_empties_the_cache_only_under_allocator_pressure():
    import gc

    from lightning_ckpt.lightning.release import memory_stats, release_memory

    gc.collect()
    torch.cuda.empty_cache()
    # A plain loop: the same activation sizes every step. Reserved-but-free memory is the next
    # step's, no allocation retries: the cache is left alone.
    for _ in range(3):
        activations = [torch.empty(8 << 20, device="cuda") for _ in range(8)]
        del activations
    since = memory_stats()
    report = release_memory("on_pressure", since)
    assert report.before.cuda_reserved > report.before.cuda_allocated  # cached, free memory...
    assert not report.cuda_cache_emptied  # ...kept for the next step
    # Real pressure: under a memory cap, cached blocks of one size cannot serve a larger request,
    # so the allocator frees its cache and retries (num_alloc_retries grows).
    total = torch.cuda.get_device_properties(0).total_memory
    free_now = total - torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + (1 << 30)) / total))
    try:
        small = [torch.empty(96 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]  # 768 MiB cached
        del small
        big = torch.empty(700 << 20, dtype=torch.uint8, device="cuda")  # does not fit the 96 MiB blocks
        del big
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert free_now > 2 << 30
    report = release_memory("on_pressure", since)
    assert report.before.cuda_alloc_retries > since.cuda_alloc_retries
    assert report.cuda_cache_emptied
    assert report.after.cuda_allocated == report.before.cuda_allocated  # nothing live was touched


def test_trainer_async_saves_with_overlapped_copies_hold_the_state_of_their_step(tmp_path):
    """Lightning's automatic optimization runs forward and backward inside ``optimizer.step``: the
    copies overlap them and the update waits; every checkpoint holds its own step's state."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback

    class Net(LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(64, 256), batch_size=8)

    class Expect(Callback):  # runs before the checkpoint callback (Lightning orders those last)
        states: dict[int, dict] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step % 2 == 0:
                self.states[trainer.global_step] = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}

    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = Trainer(
        accelerator="cuda", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        callbacks=[Expect(), callback], plugins=[lc.ShardedCheckpointIO(async_save=True)],
    )
    trainer.fit(Net())
    assert sorted(Expect.states) == [2, 4, 6, 8]
    for step, expected in Expect.states.items():
        saved = lc.load_checkpoint(tmp_path / f"step={step}.ckpt", verify=True)["state_dict"]
        for key, value in expected.items():
            assert torch.equal(saved[key], value), (step, key)
    records = callback.save_records
    assert all(isinstance(r["copy_wait_s"], float) and r["durable_s"] >= r["call_s"] for r in records)


def test_a_stage_that_fails_midway_leaves_no_copy_running_and_the_next_save_is_exact(tmp_path, monkeypatch):
    """Copies queued before the failure are finished with it: none lands over the next save's bytes,
    and the next save's copies wait for the training stream again."""
    from lightning_ckpt.save import staging

    model, optimizer = _bn_model()
    io = lc.ShardedCheckpointIO(async_save=True, max_shard_size="64KB")  # several shards
    stage_shard = staging.StagingPool.stage_shard
    calls = []

    def failing_after_the_first(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected staging failure")
        return stage_shard(self, *args, **kwargs)

    try:
        monkeypatch.setattr(staging.StagingPool, "stage_shard", failing_after_the_first)
        with pytest.raises(RuntimeError, match="injected"):
            io.save_checkpoint(_snapshot(model, optimizer), tmp_path / "failed.ckpt")
        monkeypatch.setattr(staging.StagingPool, "stage_shard", stage_shard)
        assert not io.async_saver.pool._queued
        torch.cuda._sleep(100_000_000)  # the training stream lags: the next copies must wait for it
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3.0)
        state = _snapshot(model, optimizer)
        expected = _host_copy(state)
        io.save_checkpoint(state, tmp_path / "gpu.ckpt")
        io.wait()
    finally:
        io.teardown()
    _assert_saved(tmp_path / "gpu.ckpt", expected)
    assert not (tmp_path / "failed.ckpt").exists()
