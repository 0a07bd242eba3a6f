"""Checkpoints on a real S3-compatible server (moto's, on 127.0.0.1, see tests/s3_server.py):
a Trainer saving and resuming through ``s3://`` (sync, async, local tier), top-k removal and
``last``, verification of a damaged object, a killed writer, a failing server."""

from __future__ import annotations

import os
import time

import pytest
import torch
from models import fit_regressor
from s3_server import set_environment, start_or_skip

import lightning_ckpt as lc
from lightning_ckpt import remote
from lightning_ckpt.remote import transfer

BUCKET = "ckpts"


@pytest.fixture(scope="module")
def server():
    s3 = start_or_skip()
    s3.filesystem().makedirs(BUCKET, exist_ok=True)
    yield s3
    s3.stop()


@pytest.fixture
def s3(server, monkeypatch, request):
    """The server, its environment set, and a fresh prefix for this test."""
    set_environment(monkeypatch, server)
    server.faults.clear()
    prefix = f"{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"
    yield server, prefix
    server.faults.clear()


def _state_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    want = b.state_dict()
    for key, value in a.state_dict().items():
        assert torch.equal(value, want[key]), key


def _checkpoints(fs, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(prefix, detail=False))


@pytest.mark.parametrize("mode", ["sync", "async", "local_tier"])
def test_trainer_saves_and_resumes_through_s3(s3, tmp_path, mode):
    server, prefix = s3
    fs = server.filesystem()
    dirpath = f"s3://{prefix}/run"

    def plugin():
        if mode == "async":
            return lc.ShardedCheckpointIO(async_save=True)
        if mode == "local_tier":
            return lc.ShardedCheckpointIO(local_dir=tmp_path / "tier")
        return lc.ShardedCheckpointIO()

    full, full_model = fit_regressor(4, plugin=lc.ShardedCheckpointIO())
    first, _ = fit_regressor(2, dirpath=dirpath, plugin=plugin())
    first.strategy.checkpoint_io.teardown()
    names = _checkpoints(fs, f"{prefix}/run")
    assert "last.ckpt" in names and len(names) == 3, names  # top-2 + last: worse ones were removed
    for name in names:
        manifest = lc.verify_checkpoint(f"s3://{prefix}/run/{name}")
        assert manifest.global_step is not None
    resumed, resumed_model = fit_regressor(4, dirpath=dirpath, ckpt_path=f"{dirpath}/last.ckpt", plugin=plugin())
    resumed.strategy.checkpoint_io.teardown()
    _state_equal(resumed_model, full_model)
    assert resumed_model.losses == full_model.losses[len(full_model.losses) - len(resumed_model.losses):]


def test_sharded_model_checkpoint_to_s3(s3, tmp_path):
    server, prefix = s3
    from lightning.pytorch import Trainer, seed_everything
    from models import TinyRegressor, trainer_kwargs

    seed_everything(0)
    io = lc.ShardedCheckpointIO(async_save=True)
    callback = lc.ShardedModelCheckpoint(dirpath=f"s3://{prefix}/run", every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True)
    trainer = Trainer(max_epochs=2, callbacks=[callback], plugins=[io], **trainer_kwargs())
    model = TinyRegressor()
    trainer.fit(model)
    io.teardown()
    loaded = lc.load_checkpoint(f"s3://{prefix}/run/last.ckpt")
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["state_dict"][key], value), key
    assert callback.best_model_path.startswith("s3://")


def test_verify_names_a_corrupted_object(s3):
    server, prefix = s3
    fs = server.filesystem()
    url = f"s3://{prefix}/a.ckpt"
    lc.save_checkpoint({"state_dict": {"w": torch.randn(64, 64)}, "global_step": 1}, url)
    shard = next(p for p in fs.find(f"{prefix}/a.ckpt") if p.endswith(".safetensors"))
    data = bytearray(fs.cat_file(shard))
    data[-1] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(lc.CorruptCheckpointError, match=os.path.basename(shard)):
        lc.verify_checkpoint(url)


def _multipart_uploads(fs, prefix: str) -> list[str]:
    bucket, key = prefix.split("/", 1)
    return [u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key + "/").get("Uploads", [])]


def test_killed_writer_commits_nothing_and_the_next_save_cleans_up(s3):
    server, prefix = s3
    fs = server.filesystem()
    state = {"state_dict": {f"w{i}": torch.randn(2**20) for i in range(6)}, "global_step": 1}  # 24 MiB
    io = lc.ShardedCheckpointIO(async_save=True, max_shard_size="8MiB", upload_part_size="5MiB", upload_concurrency=2)
    server.faults.match = lambda method, path, query: method == "PUT" and "partNumber=2" in query
    server.faults.delay = 30.0  # every object's second part hangs: the upload is mid-way for sure
    io.save_checkpoint(state, f"s3://{prefix}/run/doomed.ckpt")
    deadline = time.monotonic() + 30
    while not _multipart_uploads(fs, prefix) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _multipart_uploads(fs, prefix), "no multipart upload began"
    io.async_saver.worker.kill()  # the writer dies mid-upload
    server.faults.clear()
    with pytest.raises(lc.CheckpointWriteError):
        io.wait()
    assert not remote.exists(f"s3://{prefix}/run/doomed.ckpt", remote.RemoteOptions())
    # The next save (a new writer process) commits, removes the dead one's generation and aborts its uploads.
    io.save_checkpoint({"state_dict": {"w": torch.ones(8)}, "global_step": 2}, f"s3://{prefix}/run/next.ckpt")
    io.wait()
    io.teardown()
    assert _multipart_uploads(fs, prefix) == []
    fs.invalidate_cache()
    assert fs.find(f"{prefix}/run/doomed.ckpt") == []
    assert torch.equal(lc.load_checkpoint(f"s3://{prefix}/run/next.ckpt")["state_dict"]["w"], torch.ones(8))


def test_transient_errors_are_retried(s3):
    server, prefix = s3
    url = f"s3://{prefix}/a.ckpt"
    server.faults.match = lambda method, path, query: method == "PUT"
    server.faults.fail = 6  # more than one request's worth of the client's own retries
    state = {"state_dict": {"w": torch.randn(1000)}, "global_step": 3}
    lc.save_checkpoint(state, url)
    assert server.faults.failed == 6
    assert torch.equal(lc.load_checkpoint(url)["state_dict"]["w"], state["state_dict"]["w"])


def test_a_failing_server_gives_a_clear_error_and_keeps_the_previous_checkpoint(s3, monkeypatch):
    server, prefix = s3
    monkeypatch.setattr(transfer, "_ATTEMPTS", 2)  # keep the test short: 2 of ours, 2 of botocore's each
    storage_options = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}
    url = f"s3://{prefix}/last.ckpt"
    old = {"state_dict": {"w": torch.randn(1000)}, "global_step": 1}
    lc.save_checkpoint(old, url)
    server.faults.match = lambda method, path, query: method in ("PUT", "POST")
    server.faults.fail, server.faults.status, server.faults.code = -1, 500, "InternalError"
    with pytest.raises(lc.CheckpointWriteError, match="Nothing was committed") as raised:
        lc.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}, "global_step": 2}, url, storage_options=storage_options)
    assert url in str(raised.value) and "failed 2 times" in str(raised.value)
    server.faults.clear()
    assert torch.equal(lc.load_checkpoint(url)["state_dict"]["w"], old["state_dict"]["w"])


def test_existing_remote_checkpoints_are_known_to_the_callback(s3):
    """A second run into the same dirpath sees the first run's checkpoints (as Lightning's own
    ModelCheckpoint does through fsspec): a name already taken gets a version suffix."""
    server, prefix = s3
    from lightning.pytorch import Trainer, seed_everything
    from models import TinyRegressor, trainer_kwargs

    def run() -> lc.ShardedModelCheckpoint:
        seed_everything(0)
        callback = lc.ShardedModelCheckpoint(dirpath=f"s3://{prefix}/run", every_n_train_steps=4, save_top_k=-1, filename="{epoch}")
        trainer = Trainer(max_epochs=1, callbacks=[callback], plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs())
        trainer.fit(TinyRegressor())
        return callback

    run()
    second = run()
    assert os.path.basename(second.best_model_path) == "epoch=0-v1.ckpt"
    assert sorted(_checkpoints(server.filesystem(), f"{prefix}/run")) == ["epoch=0-v1.ckpt", "epoch=0.ckpt"]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_multipart_objects_roundtrip(s3, compression):
    """Shards of several parts (5 MiB parts), plain and zstd-compressed, come back bit-identical."""
    if compression is not None:
        pytest.importorskip("zstandard")
    server, prefix = s3
    url = f"s3://{prefix}/big.ckpt"
    generator = torch.Generator().manual_seed(0)
    state = {
        "state_dict": {"w": torch.randn(3 * 2**20, generator=generator)},  # 12 MiB: three parts
        "optimizer_states": [{"state": {0: {"exp_avg_sq": torch.zeros(3 * 2**20)}}, "param_groups": [{"params": [0]}]}],
        "global_step": 1,
    }
    io = lc.ShardedCheckpointIO(upload_part_size="5MiB", upload_concurrency=2, compression=compression)
    io.save_checkpoint(state, url)
    committed = remote.read_committed(url, io.remote)
    assert bool(committed.objects) == (compression is not None)
    loaded = io.load_checkpoint(url)
    assert torch.equal(loaded["state_dict"]["w"], state["state_dict"]["w"])
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["exp_avg_sq"], torch.zeros(3 * 2**20))
    assert _multipart_uploads(server.filesystem(), prefix) == []
    # A damaged byte in the middle part of a large object is caught on the way down.
    fs = server.filesystem()
    (model,) = committed.manifest.components["model"]
    stored, _ = committed.object_of(model)
    data = bytearray(fs.cat_file(stored))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(stored, bytes(data))
    with pytest.raises(lc.CorruptCheckpointError, match=model):
        io.load_checkpoint(url)
    io.teardown()


def test_a_lost_reply_to_the_commit_keeps_the_committed_checkpoint(s3, monkeypatch):
    """CURRENT stored, but every reply to its PUT lost: the save is committed and must not delete
    the generation CURRENT now names."""
    server, prefix = s3
    monkeypatch.setattr(transfer, "_ATTEMPTS", 2)
    storage_options = {"config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}}
    url = f"s3://{prefix}/last.ckpt"
    lc.save_checkpoint({"state_dict": {"w": torch.zeros(10)}, "global_step": 1}, url)
    server.faults.match = lambda method, path, query: method == "PUT" and path.endswith("/CURRENT")
    server.faults.fail, server.faults.status, server.faults.code, server.faults.after = -1, 500, "InternalError", True
    new = {"state_dict": {"w": torch.arange(10.0)}, "global_step": 2}
    lc.save_checkpoint(new, url, storage_options=storage_options)
    server.faults.clear()
    assert torch.equal(lc.load_checkpoint(url)["state_dict"]["w"], new["state_dict"]["w"])


@pytest.mark.parametrize("mode", ["sync", "async", "local_tier"])
def test_incremental_saves_copy_unchanged_objects_on_the_server(s3, tmp_path, mode):
    """A frozen backbone: after the first save, each save uploads only what changed and copies
    the backbone's object on the server; every checkpoint loads alone after the others are gone."""
    from urllib.parse import unquote

    from lightning.pytorch import Trainer, seed_everything
    from models import FrozenBackbone, trainer_kwargs
    from test_incremental_trainer import Capture

    server, prefix = s3
    dirpath = f"s3://{prefix}/run"
    options = {"async_save": True} if mode == "async" else {"local_dir": tmp_path / "tier"} if mode == "local_tier" else {}
    io = lc.ShardedCheckpointIO(**options)
    checkpoint = lc.ShardedModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1, metrics_file=None)
    capture = Capture()
    seed_everything(0)
    start = len(server.requests)
    Trainer(max_steps=4, callbacks=[checkpoint, capture], plugins=[io], **trainer_kwargs()).fit(FrozenBackbone(width=256))
    requests = server.requests[start:]
    stable = "model-stable-00001-of-00001.safetensors"
    backbone = sum(v.nbytes for k, v in capture.states[1].items() if k.startswith("backbone."))

    def uploaded(step: int) -> int:
        return sum(
            r.length for r in requests
            if r.method in ("PUT", "POST") and r.copy_source is None and f"/run/step={step}.ckpt/" in unquote(r.path)
        )  # fmt: skip

    def copied(step: int) -> list[str]:
        return [unquote(r.copy_source) for r in requests if r.copy_source and f"/run/step={step}.ckpt/" in unquote(r.path)]

    assert uploaded(1) > backbone and copied(1) == []
    for step in (2, 3, 4):
        assert uploaded(step) < 0.1 * backbone, (step, uploaded(step))
        # The backbone (and the callbacks' unchanged state) copied from the previous checkpoint.
        assert any(f"/run/step={step - 1}.ckpt/" in c and c.endswith(stable) for c in copied(step)), copied(step)
        assert all(f"/run/step={step - 1}.ckpt/" in c for c in copied(step))
    records = {r["global_step"]: r for r in checkpoint.save_records}
    assert records[1]["reused_bytes"] == 0 and all(records[s]["reused_bytes"] > backbone for s in (2, 3, 4)), records
    for step in (1, 2, 3):
        lc.remove_checkpoint(f"{dirpath}/step={step}.ckpt")
    loaded = lc.load_checkpoint(f"{dirpath}/step=4.ckpt", storage_options=None)
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in capture.states[4].items())
