"""A DDP resume on 2 CPU ranks that Lightning sees as 2 nodes (read_once_fit.py): each shard file
is read from storage by one rank and broadcast, so both ranks together read the checkpoint about
once (not twice), every loaded tensor is the saved one, and a flipped byte fails the resume on
both ranks naming the file."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read_once_fit.py")


def _run_two_nodes(tmp_path, how: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_RANK="0", PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, str(tmp_path), str(tmp_path / "ckpts"), how],
            cwd=tmp_path,
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    failed = [f"rank {r}:\n{out[-4000:]}" for r, (proc, out) in enumerate(zip(procs, outputs)) if proc.returncode]
    assert not failed, "\n".join(failed)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ranks_on_two_nodes_read_the_checkpoint_once_between_them(tmp_path):
    ranks = _run_two_nodes(tmp_path, "once")
    assert [(r["world_size"], r["num_nodes"]) for r in ranks] == [(2, 2)] * 2
    assert all(r["global_step"] == 4 for r in ranks)  # resumed at 2, trained on
    total = ranks[0]["total_bytes"]
    assert ranks[0]["shard_files"] >= 4 and all(r["total_bytes"] == total for r in ranks)
    assert all(r["read_once"] for r in ranks)
    read = [r["bytes_read"] for r in ranks]
    assert sum(read) <= 1.1 * total, (read, total)  # every rank reading it all would be 2x
    assert all(0.25 * total < n < 0.75 * total for n in read), (read, total)  # spread by bytes
    # What the read system calls returned agrees (the other reads of a load are small).
    assert all(n <= r["rchar"] <= n + 2**20 for n, r in zip(read, ranks)), [(n, r["rchar"]) for n, r in zip(read, ranks)]
    # Every tensor each rank loaded is the saved one (loaded alone, from the files).
    assert all(r["loaded_digest"] == r["saved_digest"] for r in ranks)
    assert set(ranks[0]["metrics"]) == {"ckpt/load_s", "ckpt/load_gbps", "ckpt/load_read_gb"}
    assert ranks[0]["first_load"] == {}  # the first fit restored nothing


def test_a_flipped_byte_fails_the_resume_on_both_ranks_naming_the_file(tmp_path):
    ranks = _run_two_nodes(tmp_path, "flip")
    flipped = ranks[0]["flipped"]
    for r in ranks:
        assert r["error_file"] == flipped, r
        assert "checksum mismatch" in r["error"] and flipped in r["error"]
