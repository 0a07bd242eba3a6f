"""pytest plugin for the parity harness: swaps in our classes, records every test's outcome.

Loaded with ``-p parity_plugin`` (``tests/parity`` on ``PYTHONPATH``) before Lightning's test
modules are imported. Environment: ``PARITY_MODE`` (``stock``, ``callback`` or ``io``) and
``PARITY_OUTCOMES`` (JSON file written at the end of the session: nodeid -> outcome, key line).

What is swapped, and what is not:

* ``callback`` and ``io``: ``ModelCheckpoint`` becomes ``ShardedModelCheckpoint`` wherever one is
  *constructed*: the names on ``lightning.pytorch.callbacks`` and its ``model_checkpoint`` module
  (what the test modules import, and what ``mock.patch("...ModelCheckpoint...")`` resolves) and
  the callback connector's (the Trainer's default checkpoint callback). Lightning modules that only
  *check* ``isinstance(x, ModelCheckpoint)`` (checkpoint connector, migration, loggers) keep the
  real class: ours is a subclass, so both pass those checks, and a real ``ModelCheckpoint`` a test
  builds some other way still counts.
* ``io`` also makes ``ShardedCheckpointIO()`` the default CheckpointIO of every strategy (the
  name ``Strategy.checkpoint_io`` instantiates when no plugin was given). A Trainer given its own
  CheckpointIO plugin keeps it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

MODES = ("stock", "callback", "io")
_outcomes: dict[str, dict[str, str]] = {}


def swap_callback() -> None:
    import lightning.pytorch.callbacks as callbacks
    import lightning.pytorch.callbacks.model_checkpoint as model_checkpoint
    import lightning.pytorch.trainer.connectors.callback_connector as callback_connector

    from lightning_ckpt import (
        ShardedModelCheckpoint,  # subclasses the real class: import first
    )

    for module in (callbacks, model_checkpoint, callback_connector):
        module.ModelCheckpoint = ShardedModelCheckpoint  # type: ignore[attr-defined,misc]


def swap_io() -> None:
    import lightning.pytorch.strategies.strategy as strategy

    from lightning_ckpt import ShardedCheckpointIO

    strategy.TorchCheckpointIO = ShardedCheckpointIO  # type: ignore[attr-defined,misc]


def pytest_configure(config: pytest.Config) -> None:
    mode = os.environ.get("PARITY_MODE", "stock")
    if mode not in MODES:
        raise pytest.UsageError(f"PARITY_MODE={mode!r}: expected one of {MODES}")
    if mode in ("callback", "io"):
        swap_callback()
    if mode == "io":
        swap_io()


def _key_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0][:400] if lines else ""


def _outcome(report: pytest.TestReport) -> str | None:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.skipped:
        return "skipped"
    if report.failed:
        return "failed" if report.when == "call" else "error"  # setup/teardown: error
    return "passed" if report.when == "call" else None  # a passing setup/teardown adds nothing


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    outcome = _outcome(report)
    if outcome is None:
        return
    if report.when == "teardown" and _outcomes.get(report.nodeid, {}).get("outcome") in ("failed", "error"):
        return  # keep the first failure
    entry = {"outcome": outcome}
    if outcome in ("failed", "error", "skipped"):
        entry["message"] = _key_line(report)
    _outcomes[report.nodeid] = entry


def pytest_sessionfinish(session: pytest.Session, exitstatus: Any) -> None:
    path = os.environ.get("PARITY_OUTCOMES")
    if path:
        with open(path, "w") as file:
            json.dump(_outcomes, file, indent=1, sort_keys=True)
