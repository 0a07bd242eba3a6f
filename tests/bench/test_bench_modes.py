"""Where each benchmark mode lives: the package's own lean ``save`` and ``async`` and the
repository's (benchmarks/, ``python -m benchmarks``: their research versions and the research-only
modes, which ``python -m lightning_ckpt bench`` names with where to get them): the installed package
never imports the repository's code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks
from lightning_ckpt import bench

ROOT = Path(__file__).resolve().parents[2]


def test_benchmarks_has_every_mode_and_only_the_package_modes_are_in_the_package() -> None:
    # benchmarks/: the research versions of the package's modes, and the modes only it has
    assert set(benchmarks.MODES) == set(bench.MODES) | set(bench.REPOSITORY_MODES)
    assert not set(bench.MODES) & set(bench.REPOSITORY_MODES)
    package = ROOT / "lightning_ckpt" / "bench"
    for mode, (module, _) in benchmarks.MODES.items():
        assert (ROOT / "benchmarks" / f"{module}.py").is_file()
        if mode in bench.REPOSITORY_MODES:
            assert not (package / f"{module}.py").exists(), f"{module}.py is in both lightning_ckpt/bench and benchmarks"
    for mode, (module, _) in bench.MODES.items():
        assert (package / f"{module}.py").is_file() and benchmarks.MODES[mode][0] == module


def test_python_m_benchmarks_lists_the_modes_and_requires_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        benchmarks.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert all(mode in help_text for mode in benchmarks.MODES)
    with pytest.raises(SystemExit) as exit_info:
        benchmarks.main([])
    assert exit_info.value.code == 2 and "--mode" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["installed", "checkout"])
def test_a_repository_mode_says_where_it_lives(tmp_path: Path, where: str) -> None:
    """An installed package (a copy of lightning_ckpt/ without benchmarks/ next to it) and the checkout alike."""
    shutil.copytree(ROOT / "lightning_ckpt", tmp_path / "site" / "lightning_ckpt", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site" if where == "installed" else ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_ckpt", "bench", "--mode", "offload", "--steps", "1"],
        cwd=tmp_path if where == "installed" else ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "benchmarks/ folder" in done.stderr and "python -m benchmarks --mode offload" in done.stderr
