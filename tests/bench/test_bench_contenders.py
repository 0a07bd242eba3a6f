"""The research benchmarks' contenders (``benchmarks.common.contenders``), one by one: what their
``teardown`` leaves behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from benchmarks.common.contenders import DcpAsync, dcp_process_available


@pytest.mark.skipif(not dcp_process_available(), reason="this torch has no process-based DCP async_save")
def test_dcp_async_teardown_reaps_a_daemon_slower_than_dcps_own_join(tmp_path, monkeypatch):
    # ``helpers_alive_after_teardown`` of --mode train / async samples right after teardown: DCP's
    # own ending (a 5 s join, then an unawaited SIGTERM) left its daemon alive on a loaded machine.
    # A stopped daemon stands in for one slower than 5 s: it cannot act on TERMINATE or SIGTERM.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    contender = DcpAsync(str(tmp_path), "cpu", checkpointer="process")
    contender.exit_timeout = 1.0
    pid = None
    try:
        contender.save({"w": torch.randn(1000)}, str(tmp_path / "a"))
        deadline = time.monotonic() + 300
        while contender.pending():  # durable: the daemon is idle
            assert time.monotonic() < deadline, "the DCP save did not finish within 300 s"
            contender.poll()
            time.sleep(0.05)
        (pid,) = contender.helper_pids()
        os.kill(pid, signal.SIGSTOP)
        contender.teardown()
        assert not os.path.exists(f"/proc/{pid}")  # neither running nor an unreaped zombie
        assert any(f"pid {pid}" in note and "SIGKILLed" in note for note in contender.notes), contender.notes
    finally:
        if pid is not None and os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)  # only when the assertion above failed
