"""Fabric on one device: ``Fabric(plugins=[ShardedCheckpointIO()])`` with ``fabric.save`` /
``fabric.load``, synchronous and async, with Fabric's own loading semantics (partial state,
``strict``, the remainder it returns)."""

from __future__ import annotations

import os

import pytest
import torch
from distributed.sharded_fit import states_equal as _same
from lightning.fabric import Fabric

import lightning_ckpt as lc


def _setup(fabric: Fabric, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return fabric.setup(model, optimizer)


def _train(fabric: Fabric, model, optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()


def _snapshot(model, optimizer) -> dict:
    clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": {
            "state": {i: {k: clone(v) for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()},
            "param_groups": optimizer.state_dict()["param_groups"],
        },
    }


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def io(request):
    io = lc.ShardedCheckpointIO(async_save=request.param)
    yield io
    io.teardown()


def test_save_and_load_restore_model_and_optimizer_bit_identically(io, tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, 3)
    saved = _snapshot(model, optimizer)
    path = tmp_path / "iter=3.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "iteration": 3, "note": "fabric"})
    _train(fabric, model, optimizer, 2, seed=2)  # an async save holds the state at its call
    io.wait()

    # Named after Fabric's keys, the model file indexed as a Hugging Face checkpoint.
    manifest = lc.verify_checkpoint(path)
    assert sorted(manifest.components) == ["model", "optimizer"]
    assert sorted(os.listdir(path)) == [
        "manifest.json",
        "metadata.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "optimizer-00001-of-00001.safetensors",
    ]

    fabric2 = Fabric(accelerator="cpu", devices=1, plugins=[lc.ShardedCheckpointIO()])
    model2, optimizer2 = _setup(fabric2, seed=7)
    state = {"model": model2, "optimizer": optimizer2, "iteration": 0}
    remainder = fabric2.load(path, state)
    assert state["iteration"] == 3 and remainder == {"note": "fabric"}
    assert _same(_snapshot(model2, optimizer2), saved)
    # Training on from the restored state matches training on from the state that was saved.
    model3, optimizer3 = _setup(fabric2, seed=7)
    model3.load_state_dict(saved["model"])
    optimizer3.load_state_dict(saved["optimizer"])
    _train(fabric2, model2, optimizer2, 2, seed=2)
    _train(fabric2, model3, optimizer3, 2, seed=2)
    assert _same(_snapshot(model2, optimizer2), _snapshot(model3, optimizer3))


def test_load_follows_fabrics_partial_and_strict_semantics(tmp_path):
    io = lc.ShardedCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, 1)
    path = tmp_path / "a.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "iteration": 1})

    # Without a state: the whole checkpoint, as saved (state dicts, not objects).
    whole = fabric.load(path)
    assert set(whole) == {"model", "optimizer", "iteration"}
    assert _same(whole["model"], model.state_dict())

    # A partial state: the model alone; what was not asked for comes back.
    fresh, _ = _setup(fabric, seed=3)
    remainder = fabric.load(path, {"model": fresh})
    assert set(remainder) == {"optimizer", "iteration"}
    assert _same(fresh.state_dict(), model.state_dict())

    # A key the checkpoint lacks: an error with strict=True, left as it is with strict=False.
    fresh, _ = _setup(fabric, seed=3)
    with pytest.raises(KeyError, match="epoch"):
        fabric.load(path, {"model": fresh, "epoch": 0})
    state = {"model": fresh, "epoch": 5}
    fabric.load(path, state, strict=False)
    assert state["epoch"] == 5 and _same(fresh.state_dict(), model.state_dict())

    # A model with a parameter the checkpoint lacks: strict=True refuses, strict=False loads the rest.
    bigger = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2), torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="Missing key"):
        fabric.load(path, {"model": bigger})
    fabric.load(path, {"model": bigger}, strict=False)
    assert torch.equal(bigger[2].weight, model.state_dict()["2.weight"])

    # A bare module: Fabric expects a raw state dict at the path (``fabric.load_raw``).
    raw = tmp_path / "raw.ckpt"
    io.save_checkpoint(model.state_dict(), raw)
    fresh, _ = _setup(fabric, seed=3)
    fabric.load_raw(raw, fresh)
    assert _same(fresh.state_dict(), model.state_dict())
    io.teardown()


def test_a_fabric_checkpoint_with_the_earlier_file_names_loads(tmp_path):
    # Written before components were named after their keys (model_2-..., optimizer_2-...).
    from pathlib import Path

    old = Path(__file__).parent.parent / "golden" / "fabric-names-v2" / "iter=3.ckpt"
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[lc.ShardedCheckpointIO()])
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "iteration": 0}
    assert fabric.load(old, state) == {}
    assert state["iteration"] == 3
    assert torch.equal(model.state_dict()["0.weight"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], torch.full((2, 3), 0.25))


def test_the_sharded_strategies_take_only_our_plugin_and_default_to_it():
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.fabric.strategies import ModelParallelStrategy

    stock = ModelParallelStrategy(lambda model, mesh: model)
    with pytest.raises(NotImplementedError, match="does not support setting a `CheckpointIO`"):
        stock.checkpoint_io = lc.ShardedCheckpointIO()  # why the subclasses exist
    for strategy in (
        lc.ShardedFabricModelParallelStrategy(lambda model, mesh: model),
        lc.ShardedFabricFSDPStrategy(),
        lc.ShardedFabricDDPStrategy(),
    ):
        assert isinstance(strategy.checkpoint_io, lc.ShardedCheckpointIO)
        io = lc.ShardedCheckpointIO()
        strategy.checkpoint_io = io
        assert strategy.checkpoint_io is io
        with pytest.raises(TypeError, match=r"saves through `lightning_ckpt.ShardedCheckpointIO`, got `TorchCheckpointIO`"):
            strategy.checkpoint_io = TorchCheckpointIO()
    assert lc.ShardedFabricFSDPStrategy()._state_dict_type == "sharded"


def test_an_async_plugin_is_warmed_up_by_the_first_optimizer_steps_before_any_save(tmp_path):
    """The writer process starts at the first step and the staging pool holds the parameters and
    optimizer state after the second, so Fabric's first save (and the load after it) does not pay
    for the writer's start-up or a fresh pool."""
    io = lc.ShardedCheckpointIO(async_save=True)
    try:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
        model, optimizer = _setup(fabric)
        assert io.async_saver.worker.pid is None and io.async_saver.pool.nbytes == 0
        _train(fabric, model, optimizer, 1)
        assert io.async_saver.worker.pid is not None and io.async_saver.pool.nbytes == 0
        _train(fabric, model, optimizer, 1)
        state_bytes = sum(p.nbytes * 3 for p in model.parameters())  # parameters and AdamW's two moments
        assert io.async_saver.pool.nbytes >= state_bytes
        saved = _snapshot(model, optimizer)
        fabric.save(tmp_path / "warm.ckpt", {"model": model, "optimizer": optimizer})
        model2, optimizer2 = _setup(fabric, seed=5)
        fabric.load(tmp_path / "warm.ckpt", {"model": model2, "optimizer": optimizer2})
        assert _same(_snapshot(model2, optimizer2), saved)
    finally:
        io.teardown()


def test_a_sync_plugin_starts_nothing_at_optimizer_steps():
    io = lc.ShardedCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, 2)
    assert io.async_saver is None  # the async machinery is built only with async_save=True
