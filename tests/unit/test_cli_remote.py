"""python -m lightning_ckpt inspect | verify | convert on fsspec URLs, in-process on ``memory://``:
manifest-only inspect, streamed verify naming a damaged object, conversions both ways (bit-identical),
``--storage-options``, and the exit codes of usage errors. (A real S3 server: tests/integration/test_s3.py.)"""

from __future__ import annotations

import json
import os
import sys

import fsspec
import pytest
import torch

import lightning_ckpt as lc
from lightning_ckpt import remote
from lightning_ckpt.cli import main

URL = "memory://bucket/run/c.ckpt"
SHARD = "model-00001-of-00001.safetensors"


pytestmark = pytest.mark.usefixtures("memory_fs")  # tests/conftest.py


def _state() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "epoch": 2,
        "global_step": 7,
        "state_dict": {"w": torch.randn(64, 32, generator=generator), "b": torch.arange(3)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(64, 32, generator=generator)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
    }


def _generation(fs) -> str:
    return json.loads(fs.cat_file("/bucket/run/c.ckpt/CURRENT"))["generation"]


def _lightning_file(path, state: dict) -> None:
    """A single-file checkpoint as Lightning's TorchCheckpointIO writes it: torch.save into an open
    file (the archive's inner folder is then "archive", not the file's name)."""
    with open(path, "wb") as f:
        torch.save(state, f)


def test_inspect_reads_the_manifest_only(memory_fs, capsys):
    lc.save_checkpoint(_state(), URL)
    generation = _generation(memory_fs)
    for name in memory_fs.ls(f"/bucket/run/c.ckpt/{generation}", detail=False):
        if not name.endswith("manifest.json"):
            memory_fs.rm_file(name)  # inspect must not need a single shard
    assert main(["inspect", URL]) == 0
    out = capsys.readouterr().out
    assert URL in out and f"generation {generation}" in out and "remote checkpoint" in out
    assert "step 7" in out and SHARD in out and "optimizer" in out


def test_inspect_json_describes_the_committed_generation(memory_fs, capsys):
    lc.save_checkpoint(_state(), URL)
    assert main(["inspect", URL, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # the whole of stdout is one document
    manifest = remote.read_committed(URL, remote.RemoteOptions()).manifest
    assert doc["path"] == URL and doc["generation"] == _generation(memory_fs)
    assert doc["format"] == "lightning_ckpt" and doc["format_version"] == lc.FORMAT_VERSION
    assert doc["global_step"] == 7 and doc["epoch"] == 2 and doc["total_bytes"] == manifest.total_bytes
    assert {f["name"]: (f["bytes"], f["digest"]) for f in doc["files"]} == {
        name: (r.size, r.digest) for name, r in manifest.files.items()
    }
    tensors = {tuple(t["path"]): t for t in doc["tensors"]}
    assert tensors[("state_dict", "w")] == {
        "component": "model", "path": ["state_dict", "w"], "dtype": "float32", "shape": [64, 32], "file": SHARD
    }


def test_verify_ok_and_a_damaged_object_named(memory_fs, capsys):
    lc.save_checkpoint(_state(), URL)
    assert main(["verify", URL]) == 0
    assert "all checksums match" in capsys.readouterr().out
    shard = f"/bucket/run/c.ckpt/{_generation(memory_fs)}/{SHARD}"
    data = bytearray(memory_fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    memory_fs.pipe_file(shard, bytes(data))
    assert main(["verify", URL]) == 1
    captured = capsys.readouterr()
    assert "all checksums match" not in captured.out
    assert "checksum mismatch" in captured.err and f"damaged object: {SHARD}" in captured.err
    assert main(["verify", "memory://bucket/run/missing.ckpt"]) == 1
    assert "no CURRENT object" in capsys.readouterr().err


def test_convert_a_local_file_up_and_back_down_is_bit_identical(tmp_path, capsys):
    state = _state()
    (tmp_path / "up").mkdir()
    (tmp_path / "down").mkdir()
    _lightning_file(tmp_path / "up" / "last.ckpt", state)
    assert main(["convert", str(tmp_path / "up" / "last.ckpt"), URL]) == 0  # a remote destination: a directory
    assert "published remote checkpoint" in capsys.readouterr().out
    assert lc.load_checkpoint(URL)["global_step"] == 7
    assert main(["convert", URL, str(tmp_path / "down" / "last.ckpt")]) == 0  # default: a remote source becomes a file
    assert (tmp_path / "down" / "last.ckpt").read_bytes() == (tmp_path / "up" / "last.ckpt").read_bytes()


def test_convert_a_directory_up_and_down_keeps_every_file(tmp_path):
    lc.save_checkpoint(_state(), tmp_path / "a.ckpt")
    assert main(["convert", str(tmp_path / "a.ckpt"), URL]) == 0
    assert main(["convert", URL, str(tmp_path / "b.ckpt"), "--to", "directory"]) == 0
    names = sorted(os.listdir(tmp_path / "a.ckpt"))
    assert names == sorted(os.listdir(tmp_path / "b.ckpt"))
    for name in names:
        assert (tmp_path / "a.ckpt" / name).read_bytes() == (tmp_path / "b.ckpt" / name).read_bytes(), name


def test_convert_refuses_an_existing_remote_destination_and_a_remote_file(tmp_path, capsys):
    _lightning_file(tmp_path / "x.ckpt", _state())
    assert main(["convert", str(tmp_path / "x.ckpt"), URL]) == 0
    assert main(["convert", str(tmp_path / "x.ckpt"), URL]) == 2
    assert "exists" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "x.ckpt"), "memory://bucket/run/other.ckpt", "--to", "file"]) == 2
    assert "--to file" in capsys.readouterr().out
    assert not remote.exists("memory://bucket/run/other.ckpt", remote.RemoteOptions())


def test_storage_options_reach_the_filesystem_of_every_command(tmp_path, monkeypatch):
    seen = []
    filesystem = remote.RemoteOptions.filesystem

    def spy(self, url):
        seen.append(dict(self.storage_options))
        return filesystem(self, url)

    monkeypatch.setattr(remote.RemoteOptions, "filesystem", spy)
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    flag = ["--storage-options", json.dumps(options)]
    _lightning_file(tmp_path / "x.ckpt", _state())
    assert main(["convert", str(tmp_path / "x.ckpt"), URL, *flag]) == 0
    assert main(["inspect", URL, "--json", *flag]) == 0
    assert main(["verify", URL, *flag]) == 0
    assert main(["convert", URL, str(tmp_path / "y.ckpt"), *flag]) == 0
    assert seen and all(s == options for s in seen)


@pytest.mark.parametrize("value", ["{bad", "[1, 2]", '"s3"'])
def test_bad_storage_options_name_the_option(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["verify", URL, "--storage-options", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--storage-options" in err and ("JSON" in err or "JSON object" in err)


@pytest.mark.skipif("gcsfs" in sys.modules or fsspec.utils.get_package_version_without_import("gcsfs") is not None, reason="gcsfs is installed")
@pytest.mark.parametrize("command", ["inspect", "verify", "convert-down", "convert-up"])
def test_a_missing_fsspec_implementation_is_a_usage_error(command, tmp_path, capsys):
    url = "gs://bucket/run/c.ckpt"
    _lightning_file(tmp_path / "x.ckpt", _state())
    argv = {
        "inspect": ["inspect", url],
        "verify": ["verify", url],
        "convert-down": ["convert", url, str(tmp_path / "y.ckpt")],
        "convert-up": ["convert", str(tmp_path / "x.ckpt"), url],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "'gs' protocol" in err
    assert "pip install 'lightning-ckpt[gcs]'" in " ".join(err.split())  # "[gcs]" printed, not read as markup


def test_a_client_error_is_reported_without_a_traceback(monkeypatch, capsys):
    class NoCredentialsError(Exception):  # the shape of botocore's: not an OSError
        pass

    def refuse(self, url):
        raise NoCredentialsError("Unable to locate credentials")

    monkeypatch.setattr(remote.RemoteOptions, "filesystem", refuse)
    assert main(["verify", URL]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "NoCredentialsError: Unable to locate credentials" in err and "--storage-options" in err


def test_file_urls_are_local_paths(tmp_path, capsys):
    lc.save_checkpoint(_state(), tmp_path / "c.ckpt")
    assert main(["inspect", f"file://{tmp_path / 'c.ckpt'}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["global_step"] == 7
    assert main(["verify", f"file://{tmp_path / 'c.ckpt'}"]) == 0
    assert main(["convert", f"file://{tmp_path / 'c.ckpt'}", f"file://{tmp_path / 'c.pt'}"]) == 0
    assert torch.load(tmp_path / "c.pt", weights_only=True)["global_step"] == 7


def test_inspect_shows_how_compressed_files_are_stored(memory_fs, capsys):
    pytest.importorskip("zstandard")
    url = "memory://bucket/run/z.ckpt"
    state = {
        "state_dict": {"w": torch.randn(64, 64)},
        "optimizer_states": [{"state": {0: {"exp_avg_sq": torch.zeros(64, 64)}}, "param_groups": [{"params": [0]}]}],
        "global_step": 2,
    }
    io = lc.ShardedCheckpointIO(compression={"optimizer": "zstd"})
    io.save_checkpoint(state, url)
    assert main(["inspect", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {f["name"]: f for f in doc["files"]}
    (optimizer,) = doc["components"]["optimizer"]
    assert rows[optimizer]["encoding"] == "zstd" and rows[optimizer]["stored_bytes"] < rows[optimizer]["bytes"]
    (model,) = doc["components"]["model"]
    assert rows[model]["encoding"] is None and rows[model]["stored_bytes"] == rows[model]["bytes"]
    assert doc["stored_bytes"] < doc["total_bytes"]
    assert main(["inspect", url]) == 0
    assert "compressed" in capsys.readouterr().out
    io.teardown()
