"""Save -> load gives back the exact structure: every dtype, container, view and alias."""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict

import pytest
import torch
from safetensors.torch import load_file

import lightning_ckpt as lc
from lightning_ckpt.format.plan import make_plan, parse_size

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
    torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.complex64, torch.complex128, torch.complex32,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        real = torch.randn(*shape, 2, generator=gen)
        return torch.view_as_complex(real).to(dtype) if dtype != torch.complex32 else real.half().view(torch.complex32).squeeze(-1)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Compare bit patterns (NaN-safe, works for dtypes without arithmetic)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _roundtrip(checkpoint: dict, tmp_path, **kwargs) -> dict:
    path = tmp_path / "ck.ckpt"
    lc.save_checkpoint(checkpoint, path, **kwargs)
    return lc.load_checkpoint(path, verify=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_roundtrips_bit_for_bit(dtype, tmp_path):
    t = _sample(dtype)
    out = _roundtrip({"state_dict": {"w": t}, "optimizer_states": [{"state": {0: {"m": t.clone()}}}]}, tmp_path)
    for got in (out["state_dict"]["w"], out["optimizer_states"][0]["state"][0]["m"]):
        assert got.dtype == dtype and got.shape == t.shape
        assert torch.equal(_bits(got), _bits(t))


def test_safetensors_reads_model_shards_without_lightning_ckpt(tmp_path):
    weights = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)} | {"bf": torch.randn(8).bfloat16()}
    path = tmp_path / "m.ckpt"
    lc.save_checkpoint({"state_dict": dict(weights)}, path, max_shard_size=40_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    loaded = {}
    for name in files:
        loaded.update(load_file(path / name))
    assert loaded.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(loaded[key], value) and loaded[key].dtype == value.dtype
        assert index["weight_map"][key] in files


def test_shards_respect_max_shard_size(tmp_path):
    state = {f"t{i}": torch.randn(1000) for i in range(20)}  # 4000 bytes each
    plan = make_plan({"state_dict": state}, max_shard_size=10_000)
    assert len(plan.shards) == 10
    assert all(shard.nbytes <= 10_000 for shard in plan.shards)
    big = make_plan({"state_dict": {"big": torch.randn(5000), "small": torch.randn(10)}}, max_shard_size=1000)
    assert [len(s.blobs) for s in big.shards] == [1, 1]  # an oversized tensor gets a shard of its own


def test_nested_structures_and_python_values(tmp_path):
    sd = OrderedDict(a=torch.randn(2))
    sd._metadata = OrderedDict({"": {"version": 1}, "layer": {"version": 2}})
    checkpoint = {
        "epoch": 3,
        "global_step": 12,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": sd,
        "nested": {"list": [1, 2.5, None, "s", [True, False]], "tuple": (1, (2, 3)), "empty": {}, "empty_list": []},
        "int_keys": {0: "a", 1: {2: "b"}},
        "odd_keys": {(1, 2): 1, 3.5: 2, None: 3, True: 4},
        "dollar": {"$tensor": 1, "$x": "y"},
        "floats": [math.inf, -math.inf, 1e-300, -0.0],
        "nan": math.nan,
        "big_int": 2**80,
        "bytes": b"\x00\xffbin",
        "sets": ({1, 2}, frozenset({"a"})),
        "torch_values": (torch.Size([2, 3]), torch.float16, torch.device("cpu")),
        "complex": 1 + 2j,
        "zero_dim": torch.tensor(7),
        "empty_tensor": torch.empty(0, 4),
        "requires_grad": torch.nn.Parameter(torch.randn(3)),
    }
    out = _roundtrip(checkpoint, tmp_path)
    assert out.keys() == checkpoint.keys()
    assert type(out["state_dict"]) is OrderedDict and out["state_dict"]._metadata == sd._metadata
    for key in ("epoch", "global_step", "pytorch-lightning_version", "nested", "int_keys", "odd_keys", "dollar",
                "big_int", "bytes", "sets", "torch_values", "complex"):
        assert out[key] == checkpoint[key], key
        assert type(out[key]) is type(checkpoint[key]), key
    assert type(out["nested"]["tuple"][1]) is tuple
    assert out["floats"][:3] == checkpoint["floats"][:3] and math.copysign(1, out["floats"][3]) == -1
    assert math.isnan(out["nan"])
    assert out["zero_dim"].shape == () and out["zero_dim"].item() == 7
    assert out["empty_tensor"].shape == (0, 4)
    assert isinstance(out["requires_grad"], torch.nn.Parameter) and out["requires_grad"].requires_grad
    assert type(out["odd_keys"]) is dict and list(out["odd_keys"]) == list(checkpoint["odd_keys"])


def test_views_and_tied_weights_come_back_shared(tmp_path):
    base = torch.randn(6, 4)
    sd = {
        "embed.weight": base,
        "head.weight": base,  # tied (identical view)
        "transposed": base.t(),  # non-contiguous view of the same storage
        "row": base[2],
        "every_other": base[::2, 1],
        "alone_noncontig": torch.randn(4, 6).t(),
    }
    out = _roundtrip({"state_dict": sd}, tmp_path)["state_dict"]
    for key, value in sd.items():
        assert torch.equal(out[key], value), key
        assert out[key].shape == value.shape
    assert out["embed.weight"].data_ptr() == out["head.weight"].data_ptr()
    storage = out["embed.weight"].untyped_storage().data_ptr()
    assert all(out[k].untyped_storage().data_ptr() == storage for k in ("transposed", "row", "every_other"))
    out["embed.weight"][2, 0] = 123.0
    assert out["row"][0] == 123.0 and out["transposed"][0, 2] == 123.0


def test_identical_tied_weights_stored_once(tmp_path):
    base = torch.randn(256, 64)
    path = tmp_path / "tied.ckpt"
    lc.save_checkpoint({"state_dict": {"a": base, "b": base}}, path)
    weights = load_file(path / "model-00001-of-00001.safetensors")
    assert list(weights) == ["a"]  # like Hugging Face: the tie is restored on load, not duplicated on disk


def test_loaded_tensors_do_not_share_one_file_wide_storage(tmp_path):
    out = _roundtrip({"state_dict": {"a": torch.randn(10), "b": torch.arange(4)}}, tmp_path)
    a, b = out["state_dict"]["a"], out["state_dict"]["b"]
    assert a.untyped_storage().nbytes() == 40 and b.untyped_storage().nbytes() == 32
    torch.save(out, tmp_path / "resaved.pt")  # mixed dtypes over one storage would make torch.save refuse


def test_loaded_tensors_are_writable_without_touching_the_file(tmp_path):
    path = tmp_path / "w.ckpt"
    lc.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}}, path)
    out = lc.load_checkpoint(path)
    out["state_dict"]["w"].add_(1)
    assert lc.load_checkpoint(path, verify=True)["state_dict"]["w"].sum() == 0


def test_map_location(tmp_path):
    path = tmp_path / "m.ckpt"
    lc.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    assert lc.load_checkpoint(path, map_location="meta")["state_dict"]["w"].device.type == "meta"
    assert lc.load_checkpoint(path, map_location=torch.device("cpu"))["state_dict"]["w"].device.type == "cpu"
    assert lc.load_checkpoint(path, map_location={"cpu": "meta"})["state_dict"]["w"].device.type == "meta"
    moved = lc.load_checkpoint(path, map_location=lambda storage, loc: storage)["state_dict"]["w"]
    assert moved.device.type == "cpu" and torch.equal(moved, torch.ones(3))


def test_legacy_single_file_checkpoint_loads(tmp_path):
    checkpoint = {"state_dict": {"w": torch.randn(3)}, "epoch": 1}
    torch.save(checkpoint, tmp_path / "old.ckpt")
    out = lc.load_checkpoint(tmp_path / "old.ckpt")
    assert torch.equal(out["state_dict"]["w"], checkpoint["state_dict"]["w"]) and out["epoch"] == 1
    assert torch.equal(lc.ShardedCheckpointIO().load_checkpoint(tmp_path / "old.ckpt")["state_dict"]["w"], checkpoint["state_dict"]["w"])


@pytest.mark.parametrize("direct_io", [True, False])
def test_direct_and_buffered_writes_give_identical_files(direct_io, tmp_path):
    state = {"state_dict": {"w": torch.randn(100_003), "b": torch.arange(7, dtype=torch.int8)}}
    io = lc.ShardedCheckpointIO(direct_io=direct_io, buffer_size=8192)
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    lc.save_checkpoint(state, tmp_path / "b.ckpt")
    for name in os.listdir(tmp_path / "b.ckpt"):
        if name != "manifest.json":
            assert (tmp_path / "a.ckpt" / name).read_bytes() == (tmp_path / "b.ckpt" / name).read_bytes(), name
    assert torch.equal(lc.load_checkpoint(tmp_path / "a.ckpt", verify=True)["state_dict"]["w"], state["state_dict"]["w"])


def test_tensors_larger_than_the_buffer_stream_through(tmp_path):
    w = torch.randn(300_000)  # 1.2 MB through 64 KiB buffers
    io = lc.ShardedCheckpointIO(buffer_size="64KiB")
    io.save_checkpoint({"state_dict": {"w": w}}, tmp_path / "s.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "s.ckpt")["state_dict"]["w"], w)
    io.teardown()


@pytest.mark.parametrize(
    ("text", "expected"),
    [(1234, 1234), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("1.5 kb", 1500), ("10", 10), ("3gib", 3 * 2**30)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "two GB", "5XB", 0, -3, "0MB", True, 1.5])
def test_parse_size_rejects_with_argument_name(bad):
    with pytest.raises(ValueError, match="max_shard_size"):
        lc.ShardedCheckpointIO(max_shard_size=bad)


def test_plugin_pickles_for_spawn_strategies(tmp_path):
    import pickle

    io = lc.ShardedCheckpointIO(max_shard_size="1MB", direct_io=False)
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, tmp_path / "a.ckpt")  # buffers allocated
    clone = pickle.loads(pickle.dumps(io))
    assert clone.max_shard_size == 10**6 and clone._writer.direct_io is False
    clone.save_checkpoint({"state_dict": {"w": torch.zeros(4)}}, tmp_path / "b.ckpt")
    assert clone.load_checkpoint(tmp_path / "b.ckpt")["state_dict"]["w"].sum() == 0
