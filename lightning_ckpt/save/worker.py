"""The persistent writer process of async saves, and the parent's handle on it.

The child is started with ``python -m lightning_ckpt.save.worker`` (not ``multiprocessing``), so a user's
training script is never re-imported in it; it runs in a session of its own, so a Ctrl-C in the
terminal does not interrupt a write, and at a lower CPU priority than training (``_lower_priority``).
Parent and child talk over a Unix socket pair in the messages of ``protocol``: length-prefixed
pickle frames, with the staging pool's file descriptor passed alongside (``SCM_RIGHTS``) whenever
the pool is replaced.

Jobs run in order, one at a time, so a removal queued after a save runs only once that save has
committed (``ModelCheckpoint`` removes the displaced top-k checkpoint right after asking for the
new one). If the child dies, every job it had is failed with the exit status, its temporary
directories are left unlocked (the next save cleans them), and the next save starts a new child.
Nothing here imports Lightning.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import signal
import site
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from lightning_ckpt.errors import CheckpointWriteError
from lightning_ckpt.remote import RemoteOptions
from lightning_ckpt.save.job import SaveJob, remove
from lightning_ckpt.save.protocol import (
    ImageOffsets,
    Images,
    RemoveRequest,
    Reply,
    Request,
    Response,
    SaveRequest,
    ShardWritten,
    Stop,
    WriterConfig,
    Written,
)
from lightning_ckpt.store.commit import WriteResult
from lightning_ckpt.store.reuse import Reused
from lightning_ckpt.store.shards import ShardWriter

_HEADER = struct.Struct("<Q")


def _send(sock: socket.socket, message: Request | Response, fds: list[int] | None = None) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    if not data:
        raise EOFError
    if len(data) < _HEADER.size:
        data += _recv_exact(sock, _HEADER.size - len(data))
    (length,) = _HEADER.unpack(data)
    return pickle.loads(_recv_exact(sock, length)), list(fds)


@dataclass
class _Job:
    kind: Literal["save", "remove"]
    path: str
    submitted: float = field(default_factory=time.time)  # wall clock (comparable with the child's): when the save was asked for


class WriterProcess:
    """Parent-side handle: start lazily, submit jobs, collect results, detect death, stop.

    Not thread-safe: owned by one ``ShardedCheckpointIO``, used from the training thread.
    """

    def __init__(self, config: WriterConfig) -> None:
        self.config = config
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._pool_generation = 0  # generation of the staging pool the child has mapped
        self._next_id = 0
        self._jobs: dict[int, _Job] = {}
        self._errors: list[CheckpointWriteError] = []
        self._shards_written: deque[int] = deque()  # job id per shard written, in order
        self.last_save_id: int | None = None
        self._failed_saves: set[int] = set()
        self.kept: list[str] = []  # removals the writer skipped because the replacing save failed
        # Completed saves, oldest first (the caller trims): (job id, the result with ``seconds``
        # from the save call until durable).
        self.results: list[tuple[int, WriteResult]] = []

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_ckpt.save.worker", str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=writer_environment(),
        )
        child.close()
        self._sock = parent
        self._pool_generation = 0
        _send(parent, self.config)

    def ensure_started(self) -> None:
        """Start the child if it is not running (failing the jobs of one that died). Called at the
        start of a save, so the child's start-up (importing torch) overlaps the staging copy."""
        if self._proc is not None and self._proc.poll() is not None:
            self._collect(block=False)  # replies it sent before dying
            if self._proc is not None:
                self._died()
        if self._proc is None:
            self._start()

    def submit_save(
        self, path: str, job: SaveJob, images: ImageOffsets, pool: tuple[int, int], submitted: float,
        chunked: bool = False, same_as: int | None = None, copy_same: bool = False,
    ) -> int:
        """Queue a save of ``job`` (its shard images at ``images`` in the staging pool, ``pool``:
        its (fd, generation)); returns its id. ``submitted``: the wall-clock time the save was
        asked for, from which its result's ``seconds`` are measured; ``same_as``, ``copy_same``:
        see ``SaveRequest``."""
        fds = None
        if pool[1] != self._pool_generation:
            fds = [pool[0]]
            self._pool_generation = pool[1]
        job_id = self._queue(_Job("save", path, submitted))
        self.last_save_id = job_id
        self._send_request(SaveRequest(
            id=job_id, path=path, job=job, images=images, chunked=chunked, same_as=same_as, copy_same=copy_same,
        ), fds)
        return job_id

    def submit_remove(self, path: str, after: int | None) -> int:
        """Queue the removal of the checkpoint at ``path``, to run once save ``after`` committed
        (kept if it failed); returns its id."""
        job_id = self._queue(_Job("remove", path))
        self._send_request(RemoveRequest(id=job_id, path=path, after=after))
        return job_id

    def _queue(self, job: _Job) -> int:
        self.ensure_started()
        job_id = self._next_id
        self._next_id += 1
        self._jobs[job_id] = job
        return job_id

    def _send_request(self, request: Request, fds: list[int] | None = None) -> None:
        assert self._sock is not None
        try:
            _send(self._sock, request, fds)
        except OSError:
            self._collect(block=False)  # the child died: fail its jobs (this one included)

    def send_images(self, job_id: int, images: ImageOffsets) -> None:
        """Hand more staged shard images to save ``job_id`` (a pool smaller than the state)."""
        if self._sock is None or job_id not in self._jobs:
            return  # the job already ended (its error, if any, is in take_errors)
        self._send_request(Images(id=job_id, images=images))

    def wait_shard_written(self, job_id: int) -> bool:
        """Block until save ``job_id`` has written one more shard; False if the job ended instead."""
        while True:
            while self._shards_written:
                # Completions of an earlier job (its last shards, after staging ended) are stale.
                if self._shards_written.popleft() == job_id:
                    return True
            if job_id not in self._jobs:
                return False
            self._collect(block=True)

    def poll(self) -> None:
        """Collect whatever finished, without blocking."""
        self._collect(block=False)

    @property
    def busy(self) -> bool:
        """Whether a save is still being written (collects finished jobs first)."""
        self._collect(block=False)
        return any(job.kind == "save" for job in self._jobs.values())

    def in_flight(self) -> list[str]:
        self._collect(block=False)
        return [job.path for job in self._jobs.values() if job.kind == "save"]

    def wait(self) -> None:
        """Block until every queued job finished (or the child died)."""
        while self._jobs:
            self._collect(block=True)

    def take_errors(self) -> list[CheckpointWriteError]:
        """Errors of finished jobs, each handed out once."""
        self._collect(block=False)
        errors, self._errors = self._errors, []
        return errors

    def _collect(self, block: bool) -> None:
        if self._sock is None or not self._jobs:
            return
        while self._jobs:
            readable, _, _ = select.select([self._sock], [], [], 0.5 if block else 0)
            if not readable:
                if block and self._proc is not None and self._proc.poll() is not None:
                    self._died()
                    return
                if block:
                    continue
                return
            try:
                message, _ = _recv(self._sock)
            except (EOFError, OSError):
                self._died()
                return
            if isinstance(message, ShardWritten):
                self._shards_written.append(message.id)
                if block:
                    return
                continue
            assert isinstance(message, Reply), message
            job = self._jobs.pop(message.id, None)
            if message.status == "kept":
                self.kept.append(message.path)
            elif message.status == "ok":
                if job is not None and message.written is not None:
                    # seconds: from the save call until the checkpoint was committed and durable
                    seconds = message.written.durable_at - job.submitted
                    self.results.append((message.id, replace(message.written.result, path=job.path, seconds=seconds)))
            else:
                if job is not None and job.kind == "save":
                    self._failed_saves.add(message.id)
                what = f"Background {job.kind if job else 'job'}"
                self._errors.append(
                    CheckpointWriteError(
                        f"{what}: {message.error}"
                        if message.explained
                        else f"{what} of checkpoint {message.path!r} failed: {message.error}. The checkpoint was"
                        " not committed; earlier checkpoints are intact.",
                        message.path,
                    )
                )
            if block:
                return

    def _died(self) -> None:
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait()
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        for job_id, job in self._jobs.items():
            if job.kind == "save":
                self._failed_saves.add(job_id)
                self._errors.append(
                    CheckpointWriteError(
                        f"The checkpoint writer process {how} while writing {job.path!r}; that checkpoint was"
                        " not committed (earlier checkpoints are intact). A new writer starts with the next save.",
                        job.path,
                    )
                )
        self._jobs.clear()
        self._shards_written.clear()
        self._close_socket()
        self._proc = None

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def stop(self, timeout: float = 60.0) -> None:
        """Finish queued jobs, then end the child."""
        if self._proc is None:
            return
        self.wait()
        if self._sock is not None and self._proc is not None:
            try:
                _send(self._sock, Stop())
                _wait_exit(self._proc, timeout)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._close_socket()
        self._proc = None

    def save_failed(self, job_id: int | None) -> bool:
        """Whether save ``job_id`` failed (as far as is known now)."""
        self._collect(block=False)
        return job_id in self._failed_saves

    def abort(self) -> None:
        """Kill the child mid-job (staging was interrupted): its jobs fail, nothing is committed."""
        self.kill()
        if self._proc is not None:
            self._died()

    def kill(self) -> None:
        """End the child at once (tests, and interpreter exit with saves still queued)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def writer_environment() -> dict[str, str]:
    """The writer's environment: one thread for torch's CPU kernels, and the package this process
    runs importable from anywhere. Where it was found outside the site folders (a source tree on a
    relative ``PYTHONPATH=.``, a ``sys.path`` entry added in code), its folder goes first on the
    child's ``PYTHONPATH``: the writer runs the same code, not a failed import, whatever folder it
    starts in. Installed packages (editable ones too) are found through the site folders as usual."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = str(Path(__file__).resolve().parents[2])
    sites = {str(Path(p).resolve()) for p in (*site.getsitepackages(), site.getusersitepackages())}
    if root not in sites:
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """``proc.wait(timeout)``, woken by the exit itself (a pidfd) rather than Popen's polling
    with sleeps of up to 50 ms, which ``teardown`` would add to its wait."""
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # kernel before 5.3, or already reaped
            pass
        else:
            try:
                if not select.select([fd], [], [], timeout)[0]:
                    raise subprocess.TimeoutExpired(proc.args, timeout)
            finally:
                os.close(fd)
    return proc.wait(timeout=timeout)


# ----------------------------------------------------------------------------------------------
# Child side


class _StagedImages:
    """The child's view of a save's shard images (see ``writer.ImageSource``)."""

    def __init__(self, sock: socket.socket, pool: mmap.mmap, request: SaveRequest, backlog: deque) -> None:
        self.sock, self.pool, self.backlog = sock, pool, backlog
        self.job_id = request.id
        self.images: ImageOffsets = dict(request.images)
        self.chunked = request.chunked

    def image(self, filename: str) -> tuple[mmap.mmap, int, int]:
        while filename not in self.images:  # the parent stages it once an older shard is written
            message, fds = _recv(self.sock)
            if isinstance(message, Images) and message.id == self.job_id:
                self.images.update(message.images)
            else:
                self.backlog.append((message, fds))
        offset, size = self.images.pop(filename)
        return self.pool, offset, size

    def written(self, filename: str) -> None:
        if self.chunked:
            _send(self.sock, ShardWritten(id=self.job_id, filename=filename))


def _serve(sock: socket.socket) -> None:
    writer: ShardWriter | None = None
    options: RemoteOptions | None = None  # the config's
    pool: mmap.mmap | None = None
    backlog: deque[tuple[Request, list[int]]] = deque()
    failed: set[int] = set()  # save jobs that failed: removals waiting on them are skipped
    committed: dict[int, WriteResult] = {}  # the latest saves' results, for ``SaveRequest.same_as``
    while True:
        try:
            message, fds = backlog.popleft() if backlog else _recv(sock)
        except EOFError:
            return  # the training process is gone; nothing more will come
        if fds:
            if pool is not None:
                pool.close()
            pool = mmap.mmap(fds[0], 0)
            os.close(fds[0])
        if isinstance(message, WriterConfig):
            writer = ShardWriter(message.chunk_bytes, message.direct_io, message.max_write_rate)
            options = message.remote
            continue
        if isinstance(message, Stop):
            return
        if isinstance(message, Images):
            continue  # for a save that already failed
        reply = Reply(id=message.id, path=message.path, status="ok")
        try:
            if isinstance(message, SaveRequest):
                assert writer is not None and pool is not None
                started = time.perf_counter()
                job = message.job
                if message.same_as is not None:
                    job = with_files_of(job, committed.get(message.same_as), message.copy_same)
                # Committed locally first, then published (a URL).
                result = job.run(writer, images=_StagedImages(sock, pool, message, backlog))
                committed[message.id] = result
                for old in sorted(committed)[:-_COMMITTED_KEPT]:
                    del committed[old]
                written = Written(result=result, write_seconds=time.perf_counter() - started, durable_at=time.time())
                reply = replace(reply, written=written)
            elif isinstance(message, RemoveRequest):
                if message.after in failed:
                    reply = replace(reply, status="kept")  # the checkpoint meant to replace it was not committed
                else:
                    assert options is not None
                    remove(message.path, options)
            else:
                raise ValueError(f"unknown request {message!r}")
        except EOFError:
            return  # the training process died mid-save; the temporary directory is gone already
        except Exception as err:  # reported to the training process, raised there once
            # A ``CheckpointWriteError`` says what happened and what was kept already: sent as it is.
            explained = isinstance(err, CheckpointWriteError)
            error = str(err) if explained else f"{type(err).__name__}: {err}"
            reply = replace(reply, status="error", error=error, explained=explained)
            if isinstance(message, SaveRequest):
                failed.add(message.id)
        _send(sock, reply)


_COMMITTED_KEPT = 4


def with_files_of(job: SaveJob, earlier: WriteResult | None, copy: bool) -> SaveJob:
    """``job`` taking each shard file it has in common (by name) with the committed save
    ``earlier`` from there (``SaveRequest.same_as``): linked (or copied, as its other reused files
    are), or written from its staged image if that file has gone meanwhile. Local single-process
    saves only; ``job`` as it is when ``earlier`` failed or is not known."""
    if earlier is None or job.destination.is_remote or job.part is not None or not earlier.stored:
        return job
    names = {shard.filename for shard in job.plan.shards}
    taken = {
        s.filename: Reused((os.path.join(earlier.path, s.filename),), s.size, s.digest, s.id, copy=copy, staged=True)
        for s in earlier.stored
        if s.filename in names and s.id is not None
    }
    return replace(job, reuse={**taken, **(job.reuse or {})})


def _lower_priority() -> None:
    """Leave the CPU to training when both want it: nice 5 for the process; its hashing thread
    goes further (``SCHED_IDLE``, see ``shards.ShardWriter``'s digest). The writing thread keeps its
    wake-up preemption (not ``SCHED_BATCH``): it runs for microseconds per write, and a late
    wake-up leaves the disk idle between two synchronous ``O_DIRECT`` writes."""
    try:
        os.nice(5)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process decides when to stop us
    _lower_priority()
    sock = socket.socket(fileno=int(argv[0]))
    try:
        _serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        # Only the socket to the training process raises these here (a job's own I/O errors are
        # replies): it died, e.g. SIGKILLed or OOM-killed, with nobody left to reply to. What the
        # job in hand committed stays; an uncommitted one is a temporary folder the next save removes.
        print(
            f"lightning_ckpt writer process {os.getpid()}: the training process is gone; exiting"
            " (a save it had not committed is removed by the next save into that folder)",
            file=sys.stderr,
        )
        return 1
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    code = main()
    # Every job has replied and what it wrote is durable: skip the interpreter's shutdown (module
    # teardown, torch's exit handlers: ~0.5 s of CPU beside training), which teardown() waits for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
