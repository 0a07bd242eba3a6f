"""python -m lightning_ckpt inspect (and --json) | verify | convert: output, exit codes, round trips."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import torch

import lightning_ckpt as lc
from lightning_ckpt import cli
from lightning_ckpt.cli import main
from lightning_ckpt.format.reader import read_manifest


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


def _cli_piped(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m lightning_ckpt *argv`` in a fresh process, its output piped (``COLUMNS=40``: a
    narrow stand-in for the 80 columns rich fits piped output to, unless told otherwise)."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_ckpt", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "40"} if env is None else env,
    )


def test_inspect_piped_cuts_no_file_name(tmp_path):
    # Piped, rich fitted the tables to 80 columns and cut names with "…": a name or a path must
    # come out whole for grep and awk.
    _checkpoint(tmp_path)
    path = str(tmp_path / "c.ckpt")
    proc = _cli_piped("inspect", path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert path in lines and "…" not in proc.stdout, proc.stdout
    for name in read_manifest(path).files:
        assert any(f" {name} " in line for line in lines), (name, proc.stdout)


def test_piped_error_keeps_the_path_on_one_line(tmp_path):
    # Piped, rich wrapped stderr at 80 columns (COLUMNS here) and split the path in two.
    missing = str(tmp_path / ("a-rather-long-folder-name-" * 3) / "missing.ckpt")
    proc = _cli_piped("verify", missing)
    assert proc.returncode == 1
    assert any(missing in line for line in proc.stderr.splitlines()), proc.stderr


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


def test_verify_of_a_missing_path_lists_the_checkpoints_beside_it_and_no_resume_hint(tmp_path, capsys):
    _checkpoint(tmp_path)
    assert main(["verify", str(tmp_path / "c2.ckpt")]) == 1
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "not found" in err and "'c.ckpt'" in err and "ckpt_path" not in err


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


def _inspect_json(path, capsys) -> dict:
    assert main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # the whole of stdout is one document


def test_inspect_json_describes_a_directory_checkpoint(tmp_path, capsys):
    _checkpoint(tmp_path)
    doc = _inspect_json(tmp_path / "c.ckpt", capsys)
    manifest = read_manifest(tmp_path / "c.ckpt")
    assert doc["path"] == str(tmp_path / "c.ckpt")
    assert doc["format"] == "lightning_ckpt" and doc["format_version"] == lc.FORMAT_VERSION
    assert doc["global_step"] == 7 and doc["epoch"] == 2
    assert {f["name"]: (f["bytes"], f["digest"]) for f in doc["files"]} == {
        name: (r.size, r.digest) for name, r in manifest.files.items()
    }
    assert all(f["rank"] == 0 for f in doc["files"])  # single-process save: no rank recorded
    assert doc["total_bytes"] == manifest.total_bytes
    tensors = {tuple(t["path"]): t for t in doc["tensors"]}
    assert tensors[("state_dict", "w")] == {
        "component": "model",
        "path": ["state_dict", "w"],
        "dtype": "float32",
        "shape": [100],
        "file": "model-00001-of-00001.safetensors",
    }
    assert tensors[("state_dict", "b")]["dtype"] == "int64" and tensors[("state_dict", "b")]["shape"] == [3]


def test_inspect_json_gives_the_rank_and_chunks_a_manifest_records(tmp_path, capsys, monkeypatch):
    _checkpoint(tmp_path)
    manifest = read_manifest(tmp_path / "c.ckpt")

    chunks = [
        {"file": "a", "blob": "w.0", "offsets": [0], "shape": [50]},
        {"file": "b", "blob": "w.1", "offsets": [50], "shape": [50]},
    ]
    tensors = [dataclasses.replace(manifest.tensors[0], chunks=chunks), *manifest.tensors[1:]]
    files = {name: dataclasses.replace(r, rank=i) for i, (name, r) in enumerate(sorted(manifest.files.items()))}
    monkeypatch.setattr(cli, "read_manifest", lambda path: dataclasses.replace(manifest, files=files, tensors=tensors))
    doc = _inspect_json(tmp_path / "c.ckpt", capsys)
    assert [f["rank"] for f in doc["files"]] == list(range(len(files)))
    assert doc["tensors"][0]["chunks"] == chunks and "chunks" not in doc["tensors"][1]


def test_inspect_json_describes_a_single_file_checkpoint(tmp_path, capsys):
    state = {"epoch": 1, "global_step": 3, "state_dict": {"w": torch.ones(2, 5, dtype=torch.bfloat16)}, "loops": {}}
    torch.save(state, tmp_path / "single.ckpt")
    doc = _inspect_json(tmp_path / "single.ckpt", capsys)
    size = os.path.getsize(tmp_path / "single.ckpt")
    assert doc["format"] == "torch" and doc["format_version"] is None
    assert doc["global_step"] == 3 and doc["epoch"] == 1
    assert doc["files"] == [{"name": "single.ckpt", "bytes": size, "rank": 0, "digest": None}]
    assert doc["total_bytes"] == size
    assert doc["tensors"] == [
        {"component": "model", "path": ["state_dict", "w"], "dtype": "bfloat16", "shape": [2, 5], "file": "single.ckpt"}
    ]
    assert main(["inspect", str(tmp_path / "single.ckpt")]) == 0
    assert "single-file checkpoint" in capsys.readouterr().out


def test_inspect_json_prints_nothing_on_stdout_for_a_damaged_checkpoint(tmp_path, capsys):
    _checkpoint(tmp_path)
    (tmp_path / "c.ckpt" / "manifest.json").write_text("{")
    assert main(["inspect", str(tmp_path / "c.ckpt"), "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "manifest" in captured.err


def test_convert_to_picks_the_form(tmp_path):
    state = _checkpoint(tmp_path)
    torch.save(state, tmp_path / "single.pt")
    assert main(["convert", str(tmp_path / "single.pt"), str(tmp_path / "copy.pt"), "--to", "file"]) == 0
    assert torch.load(tmp_path / "copy.pt", weights_only=True)["global_step"] == 7
    assert main(["convert", str(tmp_path / "c.ckpt"), str(tmp_path / "d.ckpt"), "--to", "directory"]) == 0
    assert torch.equal(lc.load_checkpoint(tmp_path / "d.ckpt")["state_dict"]["w"], state["state_dict"]["w"])


_IMPORTED = """
import sys
from lightning_ckpt.cli import main
for argv in {argvs!r}:
    assert main(argv) == 0, argv
heavy = ("lightning", "lightning.pytorch", "torch.distributed.checkpoint", "torch.distributed.tensor")
print(sorted(name for name in heavy if name in sys.modules))
"""


def _modules_after(argvs: list[list[str]]) -> list[str]:
    """The heavy modules a fresh interpreter has imported after running the CLI's ``argvs``."""
    code = _IMPORTED.format(argvs=argvs)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_cli_imports_neither_lightning_nor_dcp_for_our_checkpoints_and_single_files(tmp_path):
    # Start-up is import time: DCP and DTensor cost ~0.6 s, Lightning seconds. Our own folders and
    # torch.save files need neither, for any command.
    state = {**_checkpoint(tmp_path), "hyper_parameters": {"config": {"model_type": "custom"}}}
    torch.save(state, tmp_path / "single.ckpt")
    ours, single = str(tmp_path / "c.ckpt"), str(tmp_path / "single.ckpt")
    argvs = [
        ["inspect", ours],
        ["inspect", ours, "--json"],
        ["verify", ours],
        ["inspect", single],
        ["verify", single],
        ["convert", ours, str(tmp_path / "to-file.ckpt")],
        ["convert", single, str(tmp_path / "to-dir.ckpt")],
    ]
    if importlib.util.find_spec("transformers") is None:  # with it, export-hf builds the config through it
        argvs.append(["export-hf", single, str(tmp_path / "hf"), "--prefix", ""])
    assert _modules_after(argvs) == []


def test_cli_imports_dcp_for_a_dcp_folder(tmp_path):
    # The other side of the test above: a stock DCP folder does need DCP's reader.
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"w": torch.randn(4)}}, checkpoint_id=str(tmp_path / "dcp.ckpt"))
    imported = _modules_after([["inspect", str(tmp_path / "dcp.ckpt")]])
    assert "torch.distributed.checkpoint" in imported and "lightning" not in imported


def test_verify_shows_a_progress_bar_on_a_terminal_only(tmp_path):
    # FORCE_COLOR makes rich take stderr for a terminal; piped (the default here), nothing is drawn.
    _checkpoint(tmp_path)
    path = str(tmp_path / "c.ckpt")
    total = sum(r.size for r in read_manifest(path).files.values())  # under 1 kB: in bytes
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    piped = _cli_piped("verify", path, env=env)
    assert piped.returncode == 0 and piped.stderr == ""
    terminal = _cli_piped("verify", path, env={**env, "FORCE_COLOR": "1"})
    assert terminal.returncode == 0 and "verify c.ckpt" in terminal.stderr
    assert f"{total}/{total} bytes" in terminal.stderr  # bytes done of the total


def test_verify_reports_its_progress_up_to_every_byte(tmp_path):
    from lightning_ckpt.format import reader

    _checkpoint(tmp_path)
    seen: list[tuple[int, int]] = []
    reader.verify(tmp_path / "c.ckpt", lambda done, total: seen.append((done, total)))
    total = sum(r.size for r in read_manifest(tmp_path / "c.ckpt").files.values())
    assert seen and seen[-1] == (total, total)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
