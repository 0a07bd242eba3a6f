"""Async saves: a staging pool in shared memory and a persistent writer process (real processes)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from models import STEPS_PER_EPOCH, TinyRegressor, fit_regressor, trainer_kwargs

import lightning_ckpt as lc
from lightning_ckpt.format.plan import iter_tensors


@pytest.fixture
def async_io():
    io = lc.ShardedCheckpointIO(async_save=True)
    yield io
    io.teardown()
    assert io.async_saver.worker.pid is None


def _state(scale: int = 1) -> dict:
    emb = torch.randn(100, 16)
    return {
        "global_step": 1,
        "state_dict": {
            "emb": emb,
            "tied": emb,
            "half": torch.randn(7, 3).bfloat16(),
            "t": torch.randn(8, 4).t(),  # non-contiguous
            "count": torch.tensor(3),
            "big": torch.randn(scale * 250_000),
        },
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(50, 50), "step": torch.tensor(5.0)}}}],
    }


def test_snapshot_holds_the_state_at_save_time(async_io, tmp_path):
    state = _state()
    expected = {id(t): t.clone() for t in iter_tensors(state)}
    async_io.save_checkpoint(state, tmp_path / "a.ckpt")
    for t in iter_tensors(state):  # training goes on and mutates everything in place
        t.add_(1) if t.dtype != torch.bool else t.logical_not_()
    async_io.wait()
    loaded = lc.load_checkpoint(tmp_path / "a.ckpt", verify=True)
    flat_saved = list(iter_tensors(loaded))
    flat_expected = [expected[id(t)] for t in iter_tensors(state)]
    assert len(flat_saved) == len(flat_expected)
    for got, want in zip(flat_saved, flat_expected):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert loaded["state_dict"]["emb"].data_ptr() == loaded["state_dict"]["tied"].data_ptr()


def test_async_and_sync_write_identical_files(async_io, tmp_path):
    state = _state()
    async_io.save_checkpoint(state, tmp_path / "async.ckpt")
    lc.save_checkpoint(state, tmp_path / "sync.ckpt")
    async_io.wait()
    names = sorted(os.listdir(tmp_path / "sync.ckpt"))
    assert sorted(os.listdir(tmp_path / "async.ckpt")) == names
    for name in names:
        if name != "manifest.json":
            assert (tmp_path / "async.ckpt" / name).read_bytes() == (tmp_path / "sync.ckpt" / name).read_bytes(), name


def test_staging_pool_is_reused_and_grows_only_with_the_state(async_io, tmp_path):
    for i in range(4):
        async_io.save_checkpoint(_state(), tmp_path / f"s{i}.ckpt")
        if i == 0:
            generation, size = async_io.async_saver.pool.generation, async_io.async_saver.pool.nbytes
    async_io.wait()
    assert (async_io.async_saver.pool.generation, async_io.async_saver.pool.nbytes) == (generation, size)
    async_io.save_checkpoint(_state(scale=3), tmp_path / "bigger.ckpt")
    assert async_io.async_saver.pool.generation == generation + 1 and async_io.async_saver.pool.nbytes > size
    async_io.wait()
    for name in ("s0.ckpt", "s3.ckpt", "bigger.ckpt"):
        lc.verify_checkpoint(tmp_path / name)


def test_removal_waits_for_the_replacing_save(async_io, tmp_path):
    async_io.save_checkpoint(_state(), tmp_path / "old.ckpt")
    async_io.wait()
    async_io.save_checkpoint(_state(scale=100), tmp_path / "new.ckpt")
    async_io.remove_checkpoint(tmp_path / "old.ckpt")  # what ModelCheckpoint does right after a save
    # Invariant at every instant: the old checkpoint is gone only once the new one is committed.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        old_there = (tmp_path / "old.ckpt").exists()
        new_committed = (tmp_path / "new.ckpt" / "manifest.json").exists()
        assert old_there or new_committed
        if new_committed and not old_there:
            break
    async_io.wait()
    assert sorted(os.listdir(tmp_path)) == ["new.ckpt"]


def test_load_waits_for_a_save_in_flight(async_io, tmp_path):
    async_io.save_checkpoint(_state(scale=20), tmp_path / "x.ckpt")
    loaded = async_io.load_checkpoint(tmp_path / "x.ckpt")  # the writer is still starting up here
    assert loaded["global_step"] == 1


def test_when_busy_skip_counts_warns_and_protects_the_displaced_checkpoint(tmp_path):
    io = lc.ShardedCheckpointIO(async_save=True, when_busy="skip")
    try:
        io.save_checkpoint(_state(), tmp_path / "first.ckpt")  # the writer process is still starting
        with pytest.warns(UserWarning, match="still being written"):
            io.save_checkpoint(_state(), tmp_path / "second.ckpt")
        assert io.skipped_saves == 1
        with pytest.warns(UserWarning, match="was skipped"):
            io.remove_checkpoint(tmp_path / "first.ckpt")
        io.wait()
        assert sorted(os.listdir(tmp_path)) == ["first.ckpt"]
    finally:
        io.teardown()


def test_background_error_is_raised_once_then_cleared(async_io, tmp_path):
    async_io.save_checkpoint(_state(), tmp_path / "good.ckpt")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where a folder should be")
    async_io.save_checkpoint(_state(), blocker / "bad.ckpt")
    with pytest.raises(lc.CheckpointWriteError, match="bad.ckpt") as info:
        async_io.wait()
    assert info.value.path == str(blocker / "bad.ckpt")
    async_io.wait()  # cleared: not raised again
    async_io.save_checkpoint(_state(), tmp_path / "after.ckpt")
    async_io.wait()
    lc.verify_checkpoint(tmp_path / "good.ckpt")
    lc.verify_checkpoint(tmp_path / "after.ckpt")


def test_background_error_surfaces_at_the_next_save(async_io, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    async_io.save_checkpoint(_state(), blocker / "bad.ckpt")
    async_io.async_saver.worker.wait()
    with pytest.raises(lc.CheckpointWriteError, match="bad.ckpt"):
        async_io.save_checkpoint(_state(), tmp_path / "next.ckpt")
    async_io.save_checkpoint(_state(), tmp_path / "next.ckpt")
    async_io.wait()
    lc.verify_checkpoint(tmp_path / "next.ckpt")


def test_on_error_warn_lets_training_go_on(tmp_path):
    io = lc.ShardedCheckpointIO(async_save=True, on_error="warn")
    try:
        blocker = tmp_path / "file"
        blocker.write_text("")
        io.save_checkpoint(_state(), blocker / "bad.ckpt")
        with pytest.warns(UserWarning, match="bad.ckpt"):
            io.wait()
    finally:
        io.teardown()


def test_writer_killed_mid_save_is_detected_and_restarted(async_io, tmp_path):
    async_io.save_checkpoint(_state(), tmp_path / "good.ckpt")
    async_io.wait()
    first_pid = async_io.async_saver.worker.pid
    async_io.save_checkpoint(_state(scale=200), tmp_path / "doomed.ckpt")  # 200 MB: still writing
    os.kill(first_pid, signal.SIGKILL)
    started = time.perf_counter()
    with pytest.raises(lc.CheckpointWriteError, match="killed by signal 9"):
        async_io.wait()
    assert time.perf_counter() - started < 30  # detected, not hung
    assert not (tmp_path / "doomed.ckpt").exists()
    async_io.save_checkpoint(_state(), tmp_path / "after.ckpt")
    async_io.wait()
    assert async_io.async_saver.worker.pid not in (None, first_pid)
    assert sorted(os.listdir(tmp_path)) == ["after.ckpt", "good.ckpt"]  # leftovers cleaned
    lc.verify_checkpoint(tmp_path / "good.ckpt")


def test_teardown_leaves_no_process_and_no_shared_memory(tmp_path):
    io = lc.ShardedCheckpointIO(async_save=True)
    io.save_checkpoint(_state(), tmp_path / "a.ckpt")
    pid = io.async_saver.worker.pid
    io.teardown()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert lc.load_checkpoint(tmp_path / "a.ckpt", verify=True)["global_step"] == 1
    if os.path.isdir("/dev/shm"):
        assert not [n for n in os.listdir("/dev/shm") if "lightning_ckpt" in n]
    io.save_checkpoint(_state(), tmp_path / "b.ckpt")  # usable again after teardown (fit -> validate -> fit)
    io.teardown()
    lc.verify_checkpoint(tmp_path / "b.ckpt")


def test_async_trainer_saves_every_step_and_resumes_bit_identically(tmp_path):
    def fit(max_epochs, ckpt_path=None, checkpointing=True):
        return fit_regressor(
            max_epochs,
            dirpath=tmp_path if checkpointing else None,
            every_n_train_steps=1,
            ckpt_path=ckpt_path,
            plugin=lc.ShardedCheckpointIO(async_save=True),
        )

    _, reference = fit(4, checkpointing=False)
    fit(2)
    names = [n for n in os.listdir(tmp_path) if not n.startswith(".")]
    assert "last.ckpt" in names and len(names) == 3, names
    for name in names:
        lc.verify_checkpoint(tmp_path / name)
    assert lc.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 2 * STEPS_PER_EPOCH
    trainer, resumed = fit(4, ckpt_path="last")
    assert resumed.losses == reference.losses[2 * STEPS_PER_EPOCH :]
    for key, value in reference.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_state_larger_than_the_pool_cap_is_staged_in_chunks(tmp_path):
    state = {"state_dict": {f"w{i}": torch.randn(64_000) for i in range(12)}, "global_step": 7}  # 3 MB
    expected = {k: v.clone() for k, v in state["state_dict"].items()}
    io = lc.ShardedCheckpointIO(async_save=True, max_shard_size="300KB", staging_pool_size="1MB")
    try:
        io.save_checkpoint(state, tmp_path / "chunked.ckpt")
        assert io.async_saver.pool.nbytes == 10**6  # never grew beyond the cap
        for t in state["state_dict"].values():
            t.zero_()  # everything was staged (or written) before save_checkpoint returned
        io.save_checkpoint(state, tmp_path / "zeros.ckpt")
        io.wait()
    finally:
        io.teardown()
    loaded = lc.load_checkpoint(tmp_path / "chunked.ckpt", verify=True)
    for key, value in expected.items():
        assert torch.equal(loaded["state_dict"][key], value)
    lc.save_checkpoint({"state_dict": expected, "global_step": 7}, tmp_path / "sync.ckpt", max_shard_size="300KB")
    for name in os.listdir(tmp_path / "sync.ckpt"):
        if name != "manifest.json":
            assert (tmp_path / "sync.ckpt" / name).read_bytes() == (tmp_path / "chunked.ckpt" / name).read_bytes()
    assert lc.load_checkpoint(tmp_path / "zeros.ckpt")["state_dict"]["w0"].abs().sum() == 0


def test_a_shard_larger_than_the_pool_cap_is_a_clear_error(tmp_path):
    io = lc.ShardedCheckpointIO(async_save=True, staging_pool_size="100KB")
    try:
        with pytest.raises(ValueError, match="staging_pool_size"):
            io.save_checkpoint({"state_dict": {"w": torch.randn(100_000)}}, tmp_path / "x.ckpt")
    finally:
        io.teardown()
    assert not (tmp_path / "x.ckpt").exists()


def test_rate_capped_writer_writes_the_same_bytes(tmp_path):
    state = _state(scale=4)
    io = lc.ShardedCheckpointIO(async_save=True, max_write_rate="2GB", buffer_size="1MiB")
    try:
        io.save_checkpoint(state, tmp_path / "capped.ckpt")
        io.wait()
    finally:
        io.teardown()
    lc.save_checkpoint(state, tmp_path / "sync.ckpt")
    for name in os.listdir(tmp_path / "sync.ckpt"):
        if name != "manifest.json":
            assert (tmp_path / "capped.ckpt" / name).read_bytes() == (tmp_path / "sync.ckpt" / name).read_bytes()
    lc.verify_checkpoint(tmp_path / "capped.ckpt")
    with pytest.raises(ValueError, match="max_write_rate"):
        lc.ShardedCheckpointIO(async_save=True, max_write_rate="fast")


def test_a_failed_save_never_removes_the_checkpoint_it_replaces(async_io, tmp_path):
    async_io.save_checkpoint(_state(), tmp_path / "old.ckpt")
    async_io.wait()
    blocker = tmp_path / "file"
    blocker.write_text("")
    # Removal requested right after the failing save: queued behind it and skipped (if the save
    # is still in flight) or refused (if its failure is already known). Either way: kept.
    async_io.save_checkpoint(_state(scale=20), blocker / "new.ckpt")
    with pytest.warns(UserWarning, match="Kept"):
        async_io.remove_checkpoint(tmp_path / "old.ckpt")
        with pytest.raises(lc.CheckpointWriteError):
            async_io.wait()
    assert (tmp_path / "old.ckpt").exists()
    # Removal requested once the failure is known: refused.
    async_io.save_checkpoint(_state(), blocker / "again.ckpt")
    async_io.async_saver.worker.wait()
    with pytest.warns(UserWarning, match="Kept"):
        async_io.remove_checkpoint(tmp_path / "old.ckpt")
    assert (tmp_path / "old.ckpt").exists()
    lc.verify_checkpoint(tmp_path / "old.ckpt")
    with pytest.raises(lc.CheckpointWriteError):
        async_io.wait()


def test_second_save_of_the_same_step_reuses_the_staged_bytes(async_io, tmp_path, monkeypatch):
    state = _state(scale=20)
    async_io.save_checkpoint(state, tmp_path / "epoch=0-step=4.ckpt")
    staged = []
    monkeypatch.setattr(async_io.async_saver.pool, "stage", lambda *a: staged.append(a))
    monkeypatch.setattr(async_io.async_saver.worker, "wait", lambda: pytest.fail("the second save waited"))
    state["epoch"] = 0  # the metadata of the second save differs, its tensors do not
    async_io.save_checkpoint(state, tmp_path / "last.ckpt")  # what save_last does in the same step
    assert staged == []
    monkeypatch.undo()
    async_io.wait()
    a = lc.load_checkpoint(tmp_path / "epoch=0-step=4.ckpt", verify=True)
    b = lc.load_checkpoint(tmp_path / "last.ckpt", verify=True)
    assert torch.equal(a["state_dict"]["big"], b["state_dict"]["big"]) and b["epoch"] == 0 and "epoch" not in a
    # An in-place change in between (an optimizer step) makes the next save stage again.
    state["state_dict"]["big"].add_(1)
    async_io.save_checkpoint(state, tmp_path / "after.ckpt")
    async_io.wait()
    assert torch.equal(lc.load_checkpoint(tmp_path / "after.ckpt")["state_dict"]["big"], state["state_dict"]["big"])


def test_interrupted_chunked_save_does_not_hang_teardown(tmp_path, monkeypatch):
    import threading

    io = lc.ShardedCheckpointIO(async_save=True, max_shard_size="300KB", staging_pool_size="1MB")
    state = {"state_dict": {f"w{i}": torch.randn(64_000) for i in range(12)}}
    calls = []
    original = io.async_saver.pool.stage_shard

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        original(*args)

    monkeypatch.setattr(io.async_saver.pool, "stage_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint(state, tmp_path / "x.ckpt")
    done = threading.Event()

    def teardown():
        try:
            io.teardown()
        except lc.CheckpointWriteError:
            pass  # the interrupted save is reported as failed
        done.set()

    threading.Thread(target=teardown, daemon=True).start()
    assert done.wait(60), "teardown hung after an interrupted save"
    assert not (tmp_path / "x.ckpt").exists()


@pytest.mark.parametrize("callback", ["ours", "stock"])
def test_a_pool_too_small_for_the_largest_shard_is_refused_at_the_first_steps_not_the_first_save(tmp_path, callback):
    # With a 500-step interval, failing at the first save would lose 500 steps: the warm-up after
    # the first optimizer step (ours), or before the second one (stock ModelCheckpoint: the plugin's
    # optimizer hook), refuses it with the numbers and the fix.
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoint_class = lc.ShardedModelCheckpoint if callback == "ours" else ModelCheckpoint
    io = lc.ShardedCheckpointIO(async_save=True, staging_pool_size="1KB")
    steps: list[int] = []

    class Counting(Callback):
        def on_train_batch_start(self, trainer, *args):
            steps.append(trainer.global_step)

    trainer = Trainer(
        max_epochs=200,
        plugins=[io],
        callbacks=[checkpoint_class(dirpath=tmp_path, every_n_train_steps=500), Counting()],
        **trainer_kwargs(),
    )
    try:
        with pytest.raises(ValueError) as info:
            trainer.fit(TinyRegressor())
    finally:
        io.teardown()
    message = str(info.value)
    assert "staging_pool_size" in message and "1,000 bytes" in message and "max_shard_size" in message
    assert max(steps) <= 1 and not os.listdir(tmp_path)


def test_a_torn_down_plugin_does_not_warm_up_at_other_optimizers_steps(tmp_path):
    # The step hook is process-wide: a plugin torn down before its warm-up must not start its writer
    # (or check its pool) when another training's optimizer steps later in the same process.
    io = lc.ShardedCheckpointIO(async_save=True, staging_pool_size="1KB")
    io.teardown()
    param = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.AdamW([param])
    for _ in range(2):  # the second step has optimizer state: where a warm-up would check the pool
        param.grad = torch.ones(4)
        optimizer.step()
    assert io.async_saver.worker.pid is None
