"""The async writer process of a training process that was SIGKILLed (OOM killer, a job scheduler)
mid-save: it finishes or drops the save in hand, then ends quietly (one line on stderr at most,
never a traceback on the user's terminal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import wait_until_gone

import lightning_ckpt as lc

# The training process: one async save, rate-capped so the writer is still writing it when this
# process dies (8 MB at 4 MB/s: ~2 s), then the writer's pid in READY, then it waits to be killed.
# The writer inherits its stderr: LOG, opened on fd 2 before the writer starts.
TRAINING = """
import os, sys, time, warnings
warnings.simplefilter("ignore")
folder, ready, log = sys.argv[1:]
os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)
import torch
import lightning_ckpt as lc
io = lc.ShardedCheckpointIO(async_save=True, max_write_rate="4MB", buffer_size="1MiB")
io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.randn(2_000_000)}}, os.path.join(folder, "a.ckpt"))
with open(ready + ".tmp", "w") as f:
    f.write(str(io.async_saver.worker.pid))
os.replace(ready + ".tmp", ready)
time.sleep(300)
"""


def test_the_writer_of_a_killed_training_process_exits_without_a_traceback(tmp_path):
    folder, ready, log = tmp_path / "ckpts", tmp_path / "ready", tmp_path / "stderr.log"
    folder.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINING, str(folder), str(ready), str(log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300  # start-up alone takes seconds, more on a loaded machine
        while not ready.exists():
            assert proc.poll() is None, log.read_text() if log.exists() else "the training process died"
            assert time.monotonic() < deadline, "no save handed to the writer within 300 s"
            time.sleep(0.02)
        writer = int(ready.read_text())
        os.killpg(proc.pid, signal.SIGKILL)  # the training process only: the writer has a session of its own
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert wait_until_gone(writer, 120), "the writer process outlived its training process by 120 s"
    stderr = log.read_text()
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 1, stderr
    # What the writer had in hand is committed whole or not at all (nothing half-written is shown).
    if (folder / "a.ckpt").exists():
        assert lc.verify_checkpoint(folder / "a.ckpt").global_step == 1
