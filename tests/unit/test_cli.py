"""python -m lightning_ckpt inspect | verify | convert: output, exit codes, round trips."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import lightning_ckpt as lc
from lightning_ckpt.cli import main


def _checkpoint(tmp_path):
    state = {"epoch": 2, "global_step": 7, "state_dict": {"w": torch.randn(100), "b": torch.arange(3)}}
    lc.save_checkpoint(state, tmp_path / "c.ckpt")
    return state


def test_inspect_and_verify(tmp_path, capsys):
    _checkpoint(tmp_path)
    assert main(["inspect", str(tmp_path / "c.ckpt")]) == 0
    out = capsys.readouterr().out
    assert "model" in out and "step 7" in out and "float32" in out
    assert main(["verify", str(tmp_path / "c.ckpt")]) == 0
    assert "all checksums match" in capsys.readouterr().out


def test_verify_names_the_damaged_file_and_exits_non_zero(tmp_path, capsys):
    _checkpoint(tmp_path)
    shard = tmp_path / "c.ckpt" / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "c.ckpt")]) == 1
    err = capsys.readouterr().err
    assert "model-00001-of-00001.safetensors" in err and "checksum mismatch" in err
    assert main(["verify", str(tmp_path / "missing.ckpt")]) == 1


def test_convert_both_ways(tmp_path):
    state = _checkpoint(tmp_path)
    assert main(["convert", str(tmp_path / "c.ckpt"), str(tmp_path / "single.ckpt")]) == 0
    single = torch.load(tmp_path / "single.ckpt", weights_only=True)
    assert torch.equal(single["state_dict"]["w"], state["state_dict"]["w"]) and single["global_step"] == 7
    assert main(["convert", str(tmp_path / "single.ckpt"), str(tmp_path / "back.ckpt")]) == 0
    back = lc.load_checkpoint(tmp_path / "back.ckpt", verify=True)
    assert torch.equal(back["state_dict"]["b"], state["state_dict"]["b"])
    assert main(["convert", str(tmp_path / "c.ckpt"), str(tmp_path / "back.ckpt")]) == 2  # refuses to overwrite


def test_module_entry_point(tmp_path):
    _checkpoint(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "lightning_ckpt", "verify", str(tmp_path / "c.ckpt")], capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert os.path.isdir(tmp_path / "c.ckpt")
