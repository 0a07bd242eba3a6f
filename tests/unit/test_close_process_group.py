"""The multi-rank scripts' ending (helpers.close_process_group) leaves no gloo thread to the
interpreter's finalization, even when a reference cycle still holds the group, as FSDP (1)
modules inside a Trainer do: there its destruction aborted a rank at exit."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable

import torch.distributed as dist
from helpers import close_process_group

# torch names the worker threads of a gloo backend so; a rename shows as the first assertion failing.
GLOO_WORKER = "pt_gloo_runloop"


def _gloo_workers() -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == GLOO_WORKER
        except FileNotFoundError:  # exited while listed
            pass
    return count


def _gloo_workers_once(done: Callable[[int], bool], timeout: float) -> int:
    """The number of gloo workers once ``done(count)`` holds or ``timeout`` seconds have passed. A
    thread shows in /proc under its name a moment after it starts (it names itself once running,
    which on a loaded machine can be long after ``init_process_group`` returned), and leaves /proc
    a moment after ``join`` returns: sampling once would race both."""
    deadline = time.monotonic() + timeout
    while not done(count := _gloo_workers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


def test_a_group_a_reference_cycle_holds_has_its_threads_joined(tmp_path):
    before = _gloo_workers()
    gc.disable()  # only an explicit collection frees the cycle, as with an old generation
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        holder: dict = {"group": dist.group.WORLD}
        holder["self"] = holder
        assert _gloo_workers_once(lambda count: count > before, timeout=60) > before
        del holder
        close_process_group()
        assert _gloo_workers_once(lambda count: count == before, timeout=60) == before
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
