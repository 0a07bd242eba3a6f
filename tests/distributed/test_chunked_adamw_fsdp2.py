"""``ChunkedAdamW`` on FSDP2 parameters, 2 CPU ranks (gloo; the CPU stands in for the device):
each rank steps its own shards on the host, with no collective of its own, equal to
``torch.optim.AdamW(fused=True)`` under the same FSDP2 run; checkpoints through
``ShardedCheckpointIO`` (every rank writing) resume bit-identical, load in one process, and move
between ``ChunkedAdamW`` and torch's AdamW on another world size."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import run_script
from safetensors.torch import load_file
from test_sharded import _single_process_load_equals

import lightning_ckpt as lc
from lightning_ckpt.hostmem import aligned

pytestmark = pytest.mark.distributed


def test_each_rank_steps_its_shards_alone_equal_to_fused_adamw(tmp_path):
    result = run_script("distributed/chunked_adamw_fsdp2.py", tmp_path=tmp_path)
    # clipping, two param groups, accumulation, a scheduler, a worker that starts every chunk late
    assert result["losses_equal"] and result["weights_equal"]
    # bf16 compute (MixedPrecisionPolicy), fp32 sharded master weights: equal here too
    assert result["mixed_losses_close"] and result["mixed_max_abs_difference"] <= 1e-6
    ranks = result["ranks"]
    assert sum(r["local_params"] for r in ranks) == result["total_params"]
    for r in ranks:
        assert r["collectives_in_step"] == []  # FSDP2 reduce-scatters and all-gathers; step() runs none
        assert r["pending_after_step"] > 0  # chunks were still stepping while the next forward began
        # the host state covers the local shards alone: moments only (they are host fp32, stepped in place)
        assert sum(r["chunk_params"]) == r["local_params"] and r["chunks_with_master"] == 0
        assert r["host_bytes"] == sum(2 * aligned(4 * n) for n in r["chunk_params"])


def test_lightning_fsdp2_saves_every_rank_resumes_bit_identical_and_loads_in_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("LCKPT_TEST_CHUNKED", "1")
    result = run_script("distributed/sharded_fit.py", "fit", "2", tmp_path=tmp_path)
    assert result["world_size"] == 2 and result["global_step"] == 8
    assert result["resumed_equals_uninterrupted"] and result["losses_equal"]
    folder = tmp_path / "ckpts-2"
    for name in result["checkpoints"]:
        lc.verify_checkpoint(folder / name)
    # the whole state, read without a process group, equals what DCP's helpers gathered at the save
    _single_process_load_equals(folder / "epoch=1-step=8.ckpt", tmp_path / "full-epoch1.pt")
    # exported from both ranks' shards in one process: the gathered weights, without the prefix
    monkeypatch.setitem(sys.modules, "transformers", None)  # no model class: the single attribute
    out = tmp_path / "hf"
    lc.export_hf(folder / "epoch=1-step=8.ckpt", out, config={"model_type": "sharded-net"})
    exported = load_file(out / "model.safetensors")
    full = torch.load(tmp_path / "full-epoch1.pt", weights_only=True)["model"]
    assert exported.keys() == {k.removeprefix("net.") for k in full}
    assert all(torch.equal(exported[k.removeprefix("net.")], v) for k, v in full.items())


@pytest.mark.parametrize("chunked_first", [True, False], ids=["chunked-to-adamw", "adamw-to-chunked"])
def test_checkpoints_move_between_chunked_and_torch_adamw_on_another_world_size(tmp_path, monkeypatch, chunked_first):
    monkeypatch.setenv("LCKPT_TEST_CHUNKED", "1" if chunked_first else "0")
    run_script("distributed/sharded_fit.py", "fit", "2", tmp_path=tmp_path)
    monkeypatch.setenv("LCKPT_TEST_CHUNKED", "0" if chunked_first else "1")
    checkpoint, full = tmp_path / "ckpts-2" / "epoch=0-step=4.ckpt", tmp_path / "full-epoch0.pt"
    restored = run_script("distributed/sharded_fit.py", "reshard", "1", str(checkpoint), str(full), tmp_path=tmp_path)
    assert restored["world_size"] == 1 and restored["tensors_equal"]
    # ChunkedAdamW's groups name the kernel whose arithmetic it reproduces (`fused=True`) whatever it
    # loaded; torch's AdamW takes the groups as saved
    assert restored["group_differences"] == ([] if chunked_first else ["fused"])


FSDP1 = """
import os, socket, torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
import lightning_ckpt as lc
for orig in (True, False):
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 4)), device_id=torch.device("cpu"), use_orig_params=orig)
    try:
        lc.ChunkedAdamW(model.parameters())
        print("built")
    except ValueError as error:
        print(str(error).replace(chr(10), " "))
dist.destroy_process_group()
"""


def test_fsdp1_parameters_are_refused_at_construction_naming_fsdp2():
    out = subprocess.run([sys.executable, "-c", FSDP1], capture_output=True, text=True, timeout=120, check=True).stdout
    refusals = out.strip().splitlines()
    assert len(refusals) == 2  # flat parameters, and their views (use_orig_params=True)
    for line in refusals:
        assert line.startswith("ChunkedAdamW does not step FSDP (1) parameters") and "fully_shard" in line
