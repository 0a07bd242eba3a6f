"""The checkpointing methods the research training loops save through (``--mode async``,
``--mode train``): Lightning's ``TorchCheckpointIO`` and ``AsyncCheckpointIO``, ``ShardedCheckpointIO``
(as the package's ``--mode async`` calls them: ``lightning_ckpt.bench.async_loop``), DCP's
``async_save`` and ``save``, and ``disk_floor``, a plain write of the same bytes in a helper process.

Every contender is driven the way Lightning drives a ``CheckpointIO``: the loop hands it the
checkpoint dict and a path between steps (``save``), then asks, without blocking, which saves have
become durable (``poll``). Contender objects live in the measurement process; each is built, used
and torn down in one fresh process.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from lightning_ckpt.bench.async_loop import CONTENDERS as LIGHTNING_AND_OURS
from lightning_ckpt.bench.async_loop import fsync_torch_io, sharded_durable
from lightning_ckpt.format.plan import iter_tensors

CONTENDERS = (*LIGHTNING_AND_OURS, "dcp_async", "dcp_sync", "disk_floor")


class Contender:
    """One checkpointing method: ``save`` is the blocking call; ``poll`` returns ``(path, durable_at)``
    (``perf_counter`` time) of the saves durable since the last poll, never blocking."""

    asynchronous = False

    def __init__(self) -> None:
        self.done: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
        self.in_flight: set[str] = set()  # saves not yet reported durable
        self.notes: list[str] = []

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        raise NotImplementedError

    def prepare(self, nbytes: int, on_device: bool) -> None:
        """After the first training step, before any save: the state's size (as ``ShardedModelCheckpoint`` says it)."""

    def before_update(self) -> None:
        """Right before the loop updates the state after a save: a snapshot still in progress finishes here."""

    def poll(self) -> list[tuple[str, float]]:
        finished = []
        while not self.done.empty():
            finished.append(self.done.get())
            self.in_flight.discard(finished[-1][0])
        return finished

    def pending(self) -> bool:
        return bool(self.in_flight)

    def helper_pids(self) -> list[int]:
        """The processes it started (``benchmarks/``' memory and clean-up figures)."""
        return []

    def teardown(self) -> None:
        pass


class TorchIO(Contender):
    """Lightning's ``TorchCheckpointIO`` and an fsync of the file: durable when the call returns."""

    def __init__(self, run_dir: str) -> None:
        super().__init__()
        import tempfile

        # fsspec writes a tempfile.mkstemp() file and moves it into place: on the filesystem under test, a rename
        tempfile.tempdir = run_dir
        self.io = self.wrap(fsync_torch_io(lambda path, at: self.done.put((path, at))))

    def wrap(self, io: Any) -> Any:
        return io

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        self.in_flight.add(path)
        self.io.save_checkpoint(checkpoint, path)


class AsyncIO(TorchIO):
    """Lightning's ``AsyncCheckpointIO`` over :class:`TorchIO`'s: durable when its thread's save and fsync end."""

    asynchronous = True

    def wrap(self, io: Any) -> Any:
        from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

        return AsyncCheckpointIO(io)

    def poll(self) -> list[tuple[str, float]]:
        if (error := getattr(self.io, "_error", None)) is not None:  # a failed save never reports durable: fail now
            raise RuntimeError(f"AsyncCheckpointIO background save failed: {type(error).__name__}: {error}")
        return super().poll()

    def teardown(self) -> None:
        self.io.teardown()


class Sharded(Contender):
    """``ShardedCheckpointIO``, sync or async. An async save is durable at its call's start plus
    ``WriteResult.seconds`` (call -> committed and durable, as the writer process reports it), read
    from ``io.last_save`` after a call and from ``io.poll()`` between steps."""

    def __init__(self, run_dir: str, asynchronous: bool, max_write_rate: str | None = None) -> None:
        super().__init__()
        from lightning_ckpt import ShardedCheckpointIO

        self.asynchronous = asynchronous
        self.io = ShardedCheckpointIO(async_save=asynchronous, max_write_rate=max_write_rate)
        self.called: dict[str, float] = {}  # path -> perf_counter when its save call started

    def prepare(self, nbytes: int, on_device: bool) -> None:
        self.io.prepare_staging(nbytes, on_device)

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        path = os.path.abspath(path)
        self.in_flight.add(path)
        start = time.perf_counter()
        # as ShardedModelCheckpoint saves: device copies may overlap the next forward and backward
        with self.io.overlapping():
            self.io.save_checkpoint(checkpoint, path)
        if not self.asynchronous:
            self.done.put((path, time.perf_counter()))
            return
        self.called[path] = start
        self.harvest([self.io.last_save])  # the call may have collected the previous save's result

    def harvest(self, results: list[Any]) -> None:
        for durable in sharded_durable(results, self.called):
            self.done.put(durable)

    def poll(self) -> list[tuple[str, float]]:
        if self.asynchronous and self.called:
            self.harvest(self.io.poll())  # never blocks
        return super().poll()

    def helper_pids(self) -> list[int]:
        saver = self.io.async_saver if self.asynchronous else None
        return [] if saver is None or saver.worker.pid is None else [saver.worker.pid]  # the writer process, if started

    def teardown(self) -> None:
        self.io.teardown()


def dcp_stager_reusable() -> bool:
    """Whether ``DefaultStager`` can stage more than once.

    torch < 2.13: ``DefaultStager._stage`` ends by closing its ``StateDictStager``, which empties
    the table of staged storages, so the next stage raises ``KeyError``; there ``DcpAsync`` takes a
    fresh stager per save (no warm staging buffers, a measured difference of that torch version).
    """
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return (major, minor) >= (2, 13)


def dcp_process_available() -> bool:
    """Whether this torch has ``async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``."""
    try:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    except ImportError:
        return False
    return hasattr(AsyncCheckpointerType, "PROCESS")


def dcp_staging_options(device: str, process: bool = False, async_staging: bool = False) -> dict[str, bool]:
    """``StagingOptions`` of ``DcpAsync``: DCP's fast path for ``device``.

    ``process``: the staged copy goes to a checkpoint daemon process, so it is put in shared memory
    (handed over without a copy). ``async_staging`` (CUDA only): the device-to-host copy runs in
    the background and the state must not change before it finished (``DcpAsync.before_update``).
    """
    if device == "cuda":
        # Page-locked buffers and non-blocking copies (DCP's fast path for device tensors)
        return {
            "use_pinned_memory": True,
            "use_shared_memory": process,
            "use_async_staging": async_staging,
            "use_non_blocking_copy": True,
        }
    # DefaultStager() with default options raises on a CPU-only build (pinned memory, async
    # staging and non-blocking copies need an accelerator); shared memory works on CPU.
    return {"use_pinned_memory": False, "use_shared_memory": True, "use_async_staging": False, "use_non_blocking_copy": False}


class DcpAsync(Contender):
    """``torch.distributed.checkpoint.async_save`` with one ``DefaultStager`` kept across saves.

    ``checkpointer="process"`` uses DCP's checkpoint daemon process (needs a process group: a
    one-rank gloo group is made here when none exists, and destroyed on ``teardown``).
    """

    asynchronous = True
    exit_timeout = 60.0  # seconds teardown waits for DCP's daemon to exit before killing it

    def __init__(self, run_dir: str, device: str = "cpu", checkpointer: str = "thread", async_staging: bool = False) -> None:
        super().__init__()
        if checkpointer not in ("thread", "process"):
            raise ValueError(f"checkpointer={checkpointer!r}: choose 'thread' or 'process'")
        self.process = checkpointer == "process"
        self.options = dcp_staging_options(device, self.process, async_staging and device == "cuda")
        self.reuse_stager = dcp_stager_reusable()
        if not self.reuse_stager:
            self.notes.append(
                f"torch {torch.__version__}: a fresh DefaultStager per save (this version's stager stages only once)"
            )
        self.owns_group = False
        if self.process:
            import torch.distributed as dist

            if not dist.is_initialized():
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the daemon's TCPStore host
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
                self.owns_group = True
        self.stager = self._new_stager()
        self.used = False
        self.future: Any = None
        self.staging: Any = None  # async staging: the future of the snapshot in progress
        self.waits: list[float] = []
        self.staging_waits: list[float] = []
        self.errors: queue.SimpleQueue[str] = queue.SimpleQueue()

    def _new_stager(self) -> Any:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(**self.options))

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

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
        kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        response = dcp.async_save(checkpoint, checkpoint_id=path, async_stager=self.stager, async_checkpointer_type=kind)
        # async staging returns an AsyncSaveResponse (staging + upload futures), otherwise the upload future
        future = getattr(response, "upload_completion", response)
        self.staging = getattr(response, "staging_completion", None)

        def finished(f: Any, path: str = path) -> None:
            at = time.perf_counter()
            error = f.exception()
            if error is not None:
                self.errors.put(f"{type(error).__name__}: {error}")
            else:
                self.done.put((path, at))

        future.add_done_callback(finished)
        self.future = future

    def before_update(self) -> None:
        if self.staging is not None:
            start = time.perf_counter()
            self.staging.result()
            self.staging_waits.append(time.perf_counter() - start)
            self.staging = None

    def poll(self) -> list[tuple[str, float]]:
        try:
            error = self.errors.get_nowait()
        except queue.Empty:
            return super().poll()
        raise RuntimeError(f"DCP async_save failed: {error}")

    def helper_pids(self) -> list[int]:
        daemon = self._daemon()
        pid = getattr(getattr(daemon, "_save_process", None), "pid", None)
        return [] if pid is None else [pid]

    def _reap(self, process: Any) -> None:
        """Wait for DCP's daemon to exit, SIGKILL it after ``exit_timeout`` seconds, and reap it.

        DCP's ``__del__`` gives up after a 5 s join and leaves the daemon running (or a zombie)
        after its SIGTERM: a loaded machine ends a torch process slower than that. Invariant after
        ``teardown``: no helper process of this contender exists (``helpers_alive_after_teardown``).
        """
        if process is None:
            return
        process.join(timeout=self.exit_timeout)
        if process.is_alive():
            self.notes.append(f"DCP's checkpoint daemon (pid {process.pid}) outlived {self.exit_timeout:.0f} s: SIGKILLed")
            process.kill()
            process.join()

    @staticmethod
    def _daemon() -> Any:
        # DCP keeps its checkpoint daemon in a module global (torch 2.13 internals; None if absent)
        try:
            from torch.distributed.checkpoint import _async_process_executor as executor
        except ImportError:
            return None
        return getattr(executor, "_CHECKPOINT_PROCESS", None)

    def teardown(self) -> None:
        try:
            if self.future is not None:
                self.future.result()
        finally:
            self.stager.close()
            if self.process:
                daemon = self._daemon()
                if daemon is not None:
                    daemon.__del__()  # DCP's own ending: TERMINATE, a join of 5 s, then SIGTERM
                    self._reap(getattr(daemon, "_save_process", None))
                    from torch.distributed.checkpoint import (
                        _async_process_executor as executor,
                    )

                    executor._CHECKPOINT_PROCESS = None
            if self.owns_group:
                import torch.distributed as dist

                dist.destroy_process_group()


class DcpSync(Contender):
    """``torch.distributed.checkpoint.save`` (synchronous, no process group): durable when it returns
    (its ``FileSystemWriter`` fsyncs every file)."""

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(checkpoint, checkpoint_id=path)
        self.done.put((path, time.perf_counter()))


class PlainWrite(Contender):
    """``disk_floor``: the cheapest way to write the checkpoint's bytes in the background. A helper
    process (``plain_writer.py``, standard library only, started with the contender) writes as many
    bytes as the state's tensors hold, sequentially from one reused buffer (``O_DIRECT`` where the
    filesystem takes it), then fsyncs. It copies, serialises and hashes nothing and reads no
    training memory, so what the training loop loses while it writes is what writing those bytes
    to this disk costs on this host, whatever the writer. Its save call only hands over the path;
    durable when the fsync returned."""

    asynchronous = True

    def __init__(self) -> None:
        super().__init__()
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain_writer.py")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.errors: list[str] = []
        self._reader = threading.Thread(target=self._read_replies, name="disk-floor-replies", daemon=True)
        self._reader.start()

    def _read_replies(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, path, value = line.rstrip("\n").split("\t", 2)
            if kind == "done":
                self.done.put((path, float(value)))
            else:
                self.errors.append(f"{path}: {value}")

    def save(self, checkpoint: dict[str, Any], path: str) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in iter_tensors(checkpoint))
        assert self.proc.stdin is not None
        self.in_flight.add(path)
        self.proc.stdin.write(f"{path}\t{nbytes}\n")

    def poll(self) -> list[tuple[str, float]]:
        if self.errors:  # a failed write never reports durable: fail now
            raise RuntimeError(f"disk_floor: the plain write failed: {self.errors[0]}")
        return super().poll()

    def helper_pids(self) -> list[int]:
        return [self.proc.pid]

    def teardown(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the helper ends after the write in progress
        try:
            self.proc.wait(timeout=600)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(timeout=5)


def make_contender(
    name: str, run_dir: str, max_write_rate: str | None = None, device: str = "cpu", dcp: dict[str, Any] | None = None
) -> Contender:
    """The contender ``name``, one of :data:`CONTENDERS`; ``dcp``: keyword arguments of
    :class:`DcpAsync` (checkpointer, async_staging)."""
    if name == "dcp_async":
        return DcpAsync(run_dir, device, **(dcp or {}))
    if name == "dcp_sync":
        return DcpSync()
    if name == "disk_floor":
        return PlainWrite()
    if name in ("sharded_async", "sharded_sync"):
        return Sharded(run_dir, asynchronous=name == "sharded_async", max_write_rate=max_write_rate)
    if name in ("torch_io", "async_io"):
        return TorchIO(run_dir) if name == "torch_io" else AsyncIO(run_dir)
    raise ValueError(f"unknown contender {name!r} (choose from {', '.join(CONTENDERS)})")
