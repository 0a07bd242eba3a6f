"""Today's multi-rank writer reproduces ``tests/golden/v3``: 2 CPU ranks (gloo) save the
generator's checkpoint again, and every shard and shared file is byte for byte the committed one,
the manifest up to its version stamps. Slow (a fresh 2-rank run): ``make test-all`` runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from golden.make_v3 import GOLDEN_V3

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _manifest_without_versions(folder: Path) -> dict:
    body = json.loads((folder / "manifest.json").read_text())
    body.pop("created_by")
    body.pop("manifest_crc32")
    return body


def test_two_ranks_reproduce_the_v3_golden_files(tmp_path):
    done = subprocess.run(
        [sys.executable, str(GOLDEN_V3.parent.parent / "make_v3.py"), str(tmp_path)],
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    written = tmp_path / GOLDEN_V3.name
    assert sorted(os.listdir(written)) == sorted(os.listdir(GOLDEN_V3))
    for name in os.listdir(GOLDEN_V3):
        if name != "manifest.json":
            assert (written / name).read_bytes() == (GOLDEN_V3 / name).read_bytes(), f"{name} drifted from format v3"
    assert _manifest_without_versions(written) == _manifest_without_versions(GOLDEN_V3)
