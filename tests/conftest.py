from __future__ import annotations

import os
import sys

import pytest

# Shared test helpers (tests/models.py) are importable from every tier, and so are the repository's
# research benchmarks (benchmarks/, not part of the package) whatever the working directory.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Every test runs in its own temporary folder: nothing it writes by default lands in the repo."""
    monkeypatch.setenv("PL_DISABLE_FORK", "1")
    monkeypatch.chdir(tmp_path)
    yield


@pytest.fixture
def memory_fs():
    """fsspec's in-process ``memory://`` filesystem, emptied before and after the test."""
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    yield fs
    fs.store.clear()
