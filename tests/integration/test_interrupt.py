"""Ctrl-C during training with async saves: no orphan writer process, no broken checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import process_alive, wait_until_gone

import lightning_ckpt as lc


def test_ctrl_c_stops_the_writer_and_leaves_only_complete_checkpoints(tmp_path):
    out, pid_file = tmp_path / "ckpts", tmp_path / "writer.pid"
    script = os.path.join(os.path.dirname(__file__), "interrupt_fit.py")
    proc = subprocess.Popen(
        [sys.executable, script, str(out), str(pid_file)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 300  # start-up alone takes tens of seconds on a loaded machine
        while not pid_file.exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "training never reached step 3 within 300 s"
            time.sleep(0.1)
        writer_pid = int(pid_file.read_text())
        assert process_alive(writer_pid)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends to the training process
        output = proc.communicate(timeout=300)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "KeyboardInterrupt" in output or proc.returncode != 0, output[-3000:]
    # Gone, not "gone within 0.2 s": how soon a stopped process disappears depends on the load.
    assert wait_until_gone(writer_pid, 60), "the writer process outlived the interrupted training"
    names = sorted(os.listdir(out))
    assert "last.ckpt" in names and not [n for n in names if n.startswith(".")], names
    for name in names:
        lc.verify_checkpoint(out / name)
