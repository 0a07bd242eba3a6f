"""Multi-rank saves on CPU (gloo): FSDP2 under ShardedModelParallelStrategy, DDP spread writes.

Every rank writes its own shards into one checkpoint; resuming is bit-identical on the same world
size and reshards on another; one process without a process group reads the whole state.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import run_script

import lightning_ckpt as lc

pytestmark = pytest.mark.distributed


def _same(a, b) -> bool:
    from distributed.sharded_fit import states_equal

    return states_equal(a, b)


def _ranks(checkpoint) -> set[int]:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    return {record["rank"] for name, record in manifest["files"].items() if name.endswith(".safetensors")}


def _single_process_load_equals(checkpoint, full) -> None:
    loaded = lc.load_checkpoint(checkpoint)
    saved = torch.load(full, weights_only=True)
    assert _same(loaded["state_dict"], saved["model"])
    optimizer = loaded["optimizer_states"][0]
    assert _same(optimizer["state"], saved["optimizer"]["state"])
    assert optimizer["param_groups"] == saved["optimizer"]["param_groups"]


@pytest.mark.parametrize("mode", ["fit", "fsdp1"], ids=["fsdp2", "fsdp1"])
def test_two_ranks_every_rank_writes_and_resume_is_bit_identical(tmp_path, mode):
    # fsdp1: ShardedFSDPStrategy (sharded state dicts hold ShardedTensors) resumes by loading
    # through DCP's state-dict API; a plain load_state_dict refused the sharded values.
    result = run_script("distributed/sharded_fit.py", mode, "2", tmp_path=tmp_path)
    assert result["world_size"] == 2 and result["global_step"] == 8
    assert result["checkpoints"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert result["resumed_equals_uninterrupted"] and result["losses_equal"]
    folder = tmp_path / "ckpts-2"
    for name in result["checkpoints"]:
        assert _ranks(folder / name) == {0, 1}
        lc.verify_checkpoint(folder / name)
    _single_process_load_equals(folder / "epoch=1-step=8.ckpt", tmp_path / "full-epoch1.pt")
    # ``last`` follows in the same step: under FSDP2 every rank reuses its files of the epoch
    # checkpoint (incremental saves follow a DTensor's own version counter, not its local
    # shard's); FSDP1's ShardedTensor pieces have no counter to trust: written again.
    _single_process_load_equals(folder / "last.ckpt", tmp_path / "full-epoch1.pt")
    shards = [n for n in os.listdir(folder / "last.ckpt") if n.endswith(".safetensors")]
    linked = {
        n: os.stat(folder / "last.ckpt" / n).st_ino == os.stat(folder / "epoch=1-step=8.ckpt" / n).st_ino for n in shards
    }
    # Files without "-shared-" hold this rank's own pieces: the sharded ones.
    expected = {n: True for n in shards} if mode == "fit" else {n: False for n in shards if "-shared-" not in n}
    assert shards and {n: linked[n] for n in expected} == expected, linked
    assert [n for n in os.listdir(folder) if n.startswith(".")] == []
    if mode == "fsdp1":  # an FSDP1 checkpoint resumes under FSDP2 on another world size
        checkpoint, full = folder / "epoch=0-step=4.ckpt", tmp_path / "full-epoch0.pt"
        resharded = run_script("distributed/sharded_fit.py", "reshard", "1", str(checkpoint), str(full), tmp_path=tmp_path)
        assert resharded["world_size"] == 1 and resharded["restored_equals_saved"]


def test_fsdp2_async_on_four_ranks_reshards_to_two_and_to_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LCKPT_TEST_ASYNC", "1")
    result = run_script("distributed/sharded_fit.py", "fit", "4", tmp_path=tmp_path)
    assert result["world_size"] == 4 and result["resumed_equals_uninterrupted"]
    checkpoint = tmp_path / "ckpts-4" / "epoch=0-step=2.ckpt"
    assert _ranks(checkpoint) == {0, 1, 2, 3}
    resharded = run_script(
        "distributed/sharded_fit.py", "reshard", "2", str(checkpoint), str(tmp_path / "full-epoch0.pt"), tmp_path=tmp_path
    )
    assert resharded["world_size"] == 2 and resharded["restored_equals_saved"]
    _single_process_load_equals(checkpoint, tmp_path / "full-epoch0.pt")


def test_ddp_spread_writes_balance_bytes_and_keep_the_same_checkpoints(tmp_path):
    spread = run_script("distributed/sharded_fit.py", "ddp", "2", "True", tmp_path=tmp_path)
    rank0_only = run_script("distributed/sharded_fit.py", "ddp", "2", "False", tmp_path=tmp_path)
    assert spread["kept"] == rank0_only["kept"] == ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
    assert spread["best_k"] == rank0_only["best_k"]
    assert spread["resumed_equals_uninterrupted"] and rank0_only["resumed_equals_uninterrupted"]
    written = {int(rank): nbytes for rank, nbytes in spread["bytes_by_rank"].items()}
    assert set(written) == {0, 1}
    assert abs(written[0] - written[1]) <= 0.25 * max(written.values())
    assert set(rank0_only["bytes_by_rank"]) == {"0"}
    for name in spread["kept"]:
        a = lc.load_checkpoint(tmp_path / "ddp-True" / name)
        b = lc.load_checkpoint(tmp_path / "ddp-False" / name)
        assert _same(a["state_dict"], b["state_dict"]) and _same(a["optimizer_states"], b["optimizer_states"])


def test_tensor_parallel_layouts_save_reload_and_reshard_to_data_parallel(tmp_path):
    from distributed.tp_save import FULL

    result = run_script("distributed/tp_save.py", tmp_path=tmp_path)
    assert result["ranks"] == [{"same_layout": True, "data_parallel": True}] * 2
    loaded = lc.load_checkpoint(tmp_path / "tp.ckpt")
    assert loaded["epoch"] == 3
    assert all(torch.equal(loaded["state_dict"][k], v) and loaded["state_dict"][k].dtype == v.dtype for k, v in FULL.items())
    assert _ranks(tmp_path / "tp.ckpt") == {0, 1}
