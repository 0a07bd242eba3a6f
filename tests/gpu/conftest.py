"""The GPU tier runs inside a time-boxed check (``benchmarks/gpu_check.py``) that may stop it
before pytest's end-of-session summary: each failure's traceback is written when it happens, and
each test's duration after it."""

from __future__ import annotations

import pytest

_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    terminal = (
        _config.pluginmanager.get_plugin("terminalreporter")
        if _config is not None
        else None
    )
    write = terminal.write_line if terminal is not None else print
    if report.failed:
        write(
            f"\n--- {report.nodeid} ({report.when}) failed ---\n{report.longreprtext}\n--- end {report.nodeid} ---"
        )
    elif report.when == "call":
        write(f"  ({report.nodeid}: {report.duration:.1f} s)")
