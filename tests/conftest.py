from __future__ import annotations

import os
import sys

import pytest

# Shared test helpers (tests/models.py) are importable from every tier.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _quiet_lightning(monkeypatch):
    monkeypatch.setenv("PL_DISABLE_FORK", "1")
    yield
