"""The checkpointing methods a training loop saves through (``--mode async`` and ``--mode train``).

Every contender is driven the way Lightning drives a ``CheckpointIO``: the loop hands it the
checkpoint dict and a path between steps (``save``), then asks, without blocking, which saves have
become durable (``poll``). Contender objects live in the measurement process; each is built,
used and torn down in one fresh process.
"""

from __future__ import annotations

import os
import queue
import time
from typing import Any

import torch

from lightning_ckpt.bench.files import fsync_file

class Contender:
    """One checkpointing method, seen by the training loop.

    ``save`` is the blocking call; ``poll`` returns ``(path, durable_at)`` (``perf_counter`` time)
    for saves that became durable since the last poll, without blocking; ``pending`` says whether
    a save is still being written.
    """

    asynchronous = False

    def __init__(self) -> None:
        self.done: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
        self.in_flight: set[str] = set()
        self.notes: list[str] = []

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        raise NotImplementedError

    def poll(self) -> list[tuple[str, float]]:
        finished = []
        while True:
            try:
                path, at = self.done.get_nowait()
            except queue.Empty:
                break
            self.in_flight.discard(path)
            finished.append((path, at))
        return finished

    def pending(self) -> bool:
        return bool(self.in_flight)

    def helper_pids(self) -> list[int]:
        return []

    def teardown(self) -> None:
        pass


def fsync_torch_io(done: queue.SimpleQueue[tuple[str, float]]) -> Any:
    """A ``TorchCheckpointIO`` whose save fsyncs the file and reports when it was durable."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class FsyncTorchCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            fsync_file(os.fspath(path))
            done.put((os.fspath(path), time.perf_counter()))

    return FsyncTorchCheckpointIO()


class TorchIO(Contender):
    def __init__(self, run_dir: str) -> None:
        super().__init__()
        # fsspec's transaction writes a tempfile.mkstemp() file and moves it into place; keep it on
        # the filesystem under test, so the move is a rename (as py does).
        import tempfile

        tempfile.tempdir = run_dir
        self.io = fsync_torch_io(self.done)

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        self.in_flight.add(path)
        self.io.save_checkpoint(checkpoint, path)


class AsyncIO(Contender):
    asynchronous = True

    def __init__(self, run_dir: str) -> None:
        super().__init__()
        import tempfile

        from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

        tempfile.tempdir = run_dir
        self.io = AsyncCheckpointIO(fsync_torch_io(self.done))

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        self.in_flight.add(path)
        self.io.save_checkpoint(checkpoint, path)

    def poll(self) -> list[tuple[str, float]]:
        error = getattr(self.io, "_error", None)
        if error is not None:  # a failed background save never reports durable: fail now
            raise RuntimeError(f"AsyncCheckpointIO background save failed: {type(error).__name__}: {error}")
        return super().poll()

    def teardown(self) -> None:
        self.io.teardown()


def dcp_stager_reusable() -> bool:
    """Whether ``DefaultStager`` can stage more than once (torch >= 2.13; see the module docstring)."""
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 13)


def dcp_staging_options(device: str) -> dict[str, bool]:
    if device == "cuda":
        # Page-locked buffers and non-blocking copies (DCP's fast path for device tensors); staging
        # is synchronous, so the state may be updated as soon as async_save returns.
        return {"use_pinned_memory": True, "use_shared_memory": False, "use_async_staging": False, "use_non_blocking_copy": True}
    # DefaultStager() with default options raises on a CPU-only build (pinned memory, async
    # staging and non-blocking copies need an accelerator); shared memory works on CPU.
    return {"use_pinned_memory": False, "use_shared_memory": True, "use_async_staging": False, "use_non_blocking_copy": False}


class DcpAsync(Contender):
    asynchronous = True

    def __init__(self, run_dir: str, device: str = "cpu") -> None:
        super().__init__()
        self.options = dcp_staging_options(device)
        self.reuse_stager = dcp_stager_reusable()
        if not self.reuse_stager:
            self.notes.append(
                f"torch {torch.__version__}: a fresh DefaultStager per save (this version's stager stages only once)"
            )
        self.stager = self._new_stager()
        self.used = False
        self.future: Any = None
        self.waits: list[float] = []
        self.errors: queue.SimpleQueue[str] = queue.SimpleQueue()

    def _new_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(**self.options))

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        import torch.distributed.checkpoint as dcp

        if self.future is not None and not self.future.done():
            # The stager reuses its buffers: the previous write must finish before they are restaged.
            start = time.perf_counter()
            self.future.exception()
            self.waits.append(time.perf_counter() - start)
        if self.used and not self.reuse_stager:
            self.stager.close()  # its save completed above
            self.stager = self._new_stager()
        self.used = True
        self.in_flight.add(path)
        future = dcp.async_save(checkpoint, checkpoint_id=path, async_stager=self.stager)

        def finished(f: Any, path: str = path) -> None:
            at = time.perf_counter()
            error = f.exception()
            if error is not None:
                self.errors.put(f"{type(error).__name__}: {error}")
            else:
                self.done.put((path, at))

        future.add_done_callback(finished)
        self.future = future

    def poll(self) -> list[tuple[str, float]]:
        try:
            error = self.errors.get_nowait()
        except queue.Empty:
            return super().poll()
        raise RuntimeError(f"DCP async_save failed: {error}")

    def teardown(self) -> None:
        try:
            if self.future is not None:
                self.future.result()
        finally:
            self.stager.close()


class Sharded(Contender):
    def __init__(self, run_dir: str, asynchronous: bool, max_write_rate: str | None = None) -> None:
        super().__init__()
        from lightning_ckpt import ShardedCheckpointIO

        self.asynchronous = asynchronous
        self.io = ShardedCheckpointIO(async_save=asynchronous, max_write_rate=max_write_rate)
        self._handed_off: dict[str, float] = {}  # path -> perf_counter when save_checkpoint returned
        # path -> perf_counter when the job went to the writer: after save_checkpoint returned when
        # device copies deferred the hand-off to the next optimizer step (CUDA)
        self._submitted: dict[str, float] = {}
        submit = self.io._submit

        def timed_submit(prepared: Any, path: str, images: Any) -> None:
            self._submitted[path] = time.perf_counter()
            submit(prepared, path, images)

        self.io._submit = timed_submit  # type: ignore[method-assign]

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        path = os.path.abspath(path)
        self.in_flight.add(path)
        self.io.save_checkpoint(checkpoint, path)
        end = time.perf_counter()
        if not self.asynchronous:
            self.done.put((path, end))
            return
        self._handed_off[path] = end
        self._harvest()  # the call may have collected the previous save's result

    def _harvest(self) -> None:
        last = self.io.last_save
        if last is not None and last.path in self._handed_off:
            # last_save.seconds: from the job's submission to the writer until committed and durable;
            # counted from the end of save_checkpoint, or from a later (deferred) submission
            start = max(self._handed_off.pop(last.path), self._submitted.pop(last.path, 0.0))
            self.done.put((last.path, start + last.seconds))

    def poll(self) -> list[tuple[str, float]]:
        if self.asynchronous and self._handed_off and self.io._deferred is None and not self.io._worker.busy:
            # nothing in flight (and no hand-off waiting for device copies, which wait() would
            # flush and then block on): returns at once, raises a background error, sets last_save
            self.io.wait()
            self._harvest()
        return super().poll()

    def helper_pids(self) -> list[int]:
        pid = self.io._worker.pid
        return [] if pid is None else [pid]

    def teardown(self) -> None:
        self.io.teardown()


def make_contender(name: str, run_dir: str, max_write_rate: str | None = None, device: str = "cpu") -> Contender:
    if name == "torch_io":
        return TorchIO(run_dir)
    if name == "async_io":
        return AsyncIO(run_dir)
    if name == "dcp_async":
        return DcpAsync(run_dir, device)
    if name == "sharded_async":
        return Sharded(run_dir, asynchronous=True, max_write_rate=max_write_rate)
    if name == "sharded_sync":
        return Sharded(run_dir, asynchronous=False)
    raise ValueError(f"unknown contender {name!r}")
