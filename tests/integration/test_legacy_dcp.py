"""Stock DCP checkpoints (Lightning's ModelParallelStrategy / FSDPStrategy sharded saves) load
through lightning_ckpt: full state, convert to both our forms, inspect; plain ``dcp.save``
folders; damaged and unsafe folders raise the package's errors naming the file."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_script

import lightning_ckpt as lc
from lightning_ckpt.cli import main

DCP_FILES = {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}


def _assert_same(a, b, at=()):
    """Equal nested dicts / lists / tuples / values; tensors plain, same dtype and values."""
    if isinstance(b, torch.Tensor):
        assert type(a) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b), at
    elif isinstance(b, dict):
        assert isinstance(a, dict) and set(a) == set(b), (at, set(a) ^ set(b))
        for key in b:
            _assert_same(a[key], b[key], (*at, key))
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (at, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, (*at, i))
    else:
        assert a == b, (at, a, b)


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """One real 2-rank fit (gloo, FSDP2, AdamW) checkpointed by Lightning's own ModelCheckpoint:
    (the checkpoint folder, the full state gathered after fit)."""
    tmp_path = tmp_path_factory.mktemp("stock")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PL_DISABLE_FORK", "1")
        report = run_script("integration/legacy_dcp_fit.py", tmp_path=tmp_path)
    assert report["world_size"] == 2 and report["global_step"] == 2
    return report["checkpoint"], torch.load(report["full"], weights_only=True)


@pytest.mark.distributed
def test_a_stock_checkpoint_loads_as_the_full_state(stock):
    folder, full = stock
    assert set(os.listdir(folder)) == DCP_FILES
    checkpoint = lc.load_checkpoint(folder)
    _assert_same(checkpoint["state_dict"], full["state_dict"])
    assert len(checkpoint["optimizer_states"]) == 1
    _assert_same(checkpoint["optimizer_states"][0], full["optimizer"])
    assert checkpoint["epoch"] == 0 and checkpoint["global_step"] == 2
    assert {"loops", "callbacks", "pytorch-lightning_version", "hyper_parameters"} <= set(checkpoint)
    assert checkpoint["state_dict"]["net.2.weight"].shape == (1, 16)  # rank 1 held an empty shard of it
    assert all(t.device.type == "cpu" for t in checkpoint["state_dict"].values())
    on_meta = lc.load_checkpoint(folder, map_location="meta")
    assert all(t.device.type == "meta" for t in on_meta["state_dict"].values())


@pytest.mark.distributed
def test_convert_turns_a_stock_checkpoint_into_either_of_our_forms(stock, tmp_path):
    folder, full = stock
    assert main(["convert", folder, str(tmp_path / "ours.ckpt")]) == 0  # default: our directory format
    assert os.path.isfile(tmp_path / "ours.ckpt" / "manifest.json")
    assert main(["convert", folder, str(tmp_path / "single.ckpt"), "--to", "file"]) == 0
    for loaded in (
        lc.load_checkpoint(tmp_path / "ours.ckpt", verify=True),
        torch.load(tmp_path / "single.ckpt", weights_only=True),
    ):
        _assert_same(loaded["state_dict"], full["state_dict"])
        _assert_same(loaded["optimizer_states"][0], full["optimizer"])
        assert loaded["global_step"] == 2
    assert main(["verify", str(tmp_path / "ours.ckpt")]) == 0


@pytest.mark.distributed
def test_inspect_describes_a_stock_checkpoint(stock, capsys):
    folder, _ = stock
    assert main(["inspect", folder]) == 0
    out = " ".join(capsys.readouterr().out.split())  # as words: rich wraps lines to the terminal
    assert "stock DCP checkpoint" in out and "step 2" in out and "__1_0.distcp" in out
    assert main(["verify", folder]) == 0
    assert "no checksums" in " ".join(capsys.readouterr().out.split())
    assert main(["inspect", folder, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "dcp" and doc["path"] == folder and doc["global_step"] == 2 and doc["epoch"] == 0
    files = {f["name"]: f for f in doc["files"]}
    assert set(files) == DCP_FILES
    assert files["__1_0.distcp"]["rank"] == 1 and files["__0_0.distcp"]["rank"] == 0 and files["meta.pt"]["rank"] == 0
    for name, f in files.items():
        assert f["digest"] is None and f["bytes"] == os.path.getsize(os.path.join(folder, name))
    assert doc["total_bytes"] == sum(f["bytes"] for f in files.values())
    tensors = {tuple(t["path"]): t for t in doc["tensors"]}
    weight = tensors[("state_dict", "net.0.weight")]
    assert weight["component"] == "model" and weight["dtype"] == "float32" and weight["shape"] == [16, 8]
    assert weight["file"] == "__0_0.distcp"  # the first piece: its chunks say where each lies
    assert weight["chunks"] == [
        {"file": "__0_0.distcp", "offsets": [0, 0], "shape": [8, 8]},
        {"file": "__1_0.distcp", "offsets": [8, 0], "shape": [8, 8]},
    ]
    assert tensors[("optimizer_states", 0, "state", "net.0.bias", "exp_avg")]["component"] == "optimizer"
    assert any(t["file"] == "meta.pt" for t in doc["tensors"])  # ModelCheckpoint's kth_value


def _plain_state():
    return {
        "model": {"w": torch.randn(3, 4), "b": torch.arange(5)},
        "groups": [{"lr": 0.1, "t": torch.ones(2)}, {"lr": 0.2, "t": torch.zeros(2)}],
        "step": 5,
        "name": "plain",
    }


def _plain(tmp_path, state=None, name="plain"):
    folder = tmp_path / name
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state or _plain_state(), checkpoint_id=folder, no_dist=True)
    return folder


def test_a_plain_dcp_save_without_meta_loads_as_saved(tmp_path):
    state = _plain_state()
    folder = _plain(tmp_path, state)
    assert not (folder / "meta.pt").exists()
    _assert_same(lc.load_checkpoint(folder), state)  # "model" is not renamed: not a Lightning checkpoint


def test_fsdp_strategy_layout_loads_with_optimizers_in_order(tmp_path):
    """FSDPStrategy(state_dict_type="sharded") names the model "model"; optimizers are optimizer_<i>."""
    weights = {"layer.weight": torch.randn(4, 3)}
    optimizers = [
        {"state": {"layer.weight": {"step": torch.tensor(float(i))}}, "param_groups": [{"lr": i}]} for i in range(11)
    ]
    folder = _plain(tmp_path, {"model": weights, **{f"optimizer_{i}": o for i, o in enumerate(optimizers)}}, "fsdp")
    torch.save({"epoch": 3, "global_step": 30, "loops": {"fit_loop": {}}}, folder / "meta.pt")
    checkpoint = lc.load_checkpoint(folder)
    expected = {"epoch": 3, "global_step": 30, "loops": {"fit_loop": {}}, "state_dict": weights}
    _assert_same(checkpoint, {**expected, "optimizer_states": optimizers})


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing"])
def test_a_damaged_metadata_file_is_named(tmp_path, capsys, damage):
    from lightning_ckpt.format import legacy as legacy_dcp

    folder = _plain(tmp_path)
    metadata = folder / ".metadata"
    if damage == "truncated":
        metadata.write_bytes(metadata.read_bytes()[:100])
    elif damage == "garbage":
        metadata.write_bytes(pickle.dumps(["not", "metadata"]))
    else:
        metadata.unlink()
    with pytest.raises(lc.CorruptCheckpointError, match=r"\.metadata") as caught:
        legacy_dcp.load_dcp_checkpoint(str(folder), None, None)
    assert caught.value.file == ".metadata" and caught.value.path == str(folder)
    if damage != "missing":  # without .metadata it is no DCP folder: load_checkpoint says "no manifest"
        assert main(["inspect", str(folder), "--json"]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and ".metadata" in captured.err


@pytest.mark.parametrize("weights_only", [True, False])
def test_metadata_from_a_newer_torch_says_upgrade_not_corrupt(tmp_path, monkeypatch, weights_only):
    """torch 2.15 pickles DCP's TensorProperties with a sixth field (``strides``), which older
    torch's ``__setstate__`` cannot unpack: the real file, rewritten as a 2.15 pickles it."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    folder = _plain(tmp_path)
    metadata = folder / ".metadata"
    written = pickle.loads(metadata.read_bytes())
    fields = TensorProperties.__getstate__
    with monkeypatch.context() as patch:  # only while pickling, as the newer torch would
        patch.setattr(TensorProperties, "__getstate__", lambda self: (*fields(self), None))
        metadata.write_bytes(pickle.dumps(written))
    with pytest.raises(ValueError, match="too many values to unpack"):  # what torch itself says
        pickle.loads(metadata.read_bytes())
    with pytest.raises(lc.UnsupportedFormatError, match=r"newer torch.*TensorProperties has 6 fields.*Upgrade torch") as caught:
        lc.load_checkpoint(folder, weights_only=weights_only)
    assert caught.value.path == str(folder)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_data_file_is_named(tmp_path, damage):
    folder = _plain(tmp_path)
    data = folder / "__0_0.distcp"
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[:-10])
    else:
        data.unlink()
    with pytest.raises(lc.CorruptCheckpointError, match="__0_0.distcp") as caught:
        lc.load_checkpoint(folder)
    assert caught.value.file == "__0_0.distcp"


class _Custom:
    def __eq__(self, other):
        return isinstance(other, _Custom)


class _Hostile:
    def __reduce__(self):
        return (os.getcwd, ())


def test_weights_only_loading_refuses_what_would_run_code(tmp_path):
    folder = _plain(tmp_path, {"w": torch.ones(2), "custom": _Custom()})
    with pytest.raises(lc.UnsafeCheckpointError, match="custom"):
        lc.load_checkpoint(folder)
    assert lc.load_checkpoint(folder, weights_only=False)["custom"] == _Custom()
    # DCP itself unpickles .metadata freely; weights-only loading builds DCP's own classes only.
    (folder / ".metadata").write_bytes(pickle.dumps(_Hostile()))
    with pytest.raises(lc.UnsafeCheckpointError, match="getcwd"):
        lc.load_checkpoint(folder)
