"""The device operations of ``ChunkedOffloadStrategy``: copies between host chunks and device
memory, and the events that order them against the compute stream.

The streamer (``offload/streamer.py``) decides *what* moves and *when*; this layer only does it,
so the same ordering logic runs on CUDA and on the CPU standing in for the device:

- ``copy_in(dst, src, after)``: host chunk -> device memory on the copy stream, after ``after``
  (the event that released ``dst``); returns the copy's event.
- ``wait(event)``: the compute stream waits for ``event`` before the kernels issued next.
- ``record()``: an event on the compute stream after every kernel issued so far (a release).
- ``copy_out(dst, src, after)``: device gradient -> host buffer on the gradient stream after
  ``after``; ``src`` is kept from reuse until the copy is done.
- ``synchronize(event)``: the host waits for ``event``.
- ``resident_buffer(host)``: the device memory of a chunk kept on the device for the whole run.

:class:`CudaStreams`: two side streams (H2D, D2H) and ``torch.cuda.Event`` s. :class:`HostStreams`:
the host thread is the compute stream; copies are synchronous and events complete at once, unless
``copy_delay`` is set: then copies run in order on one background thread that sleeps that long
before each copy (a slow copy stream), so a use that does not wait for its fetch reads stale
memory; once that thread runs, every later copy goes through it, in issue order. A resident
chunk's device memory on the CPU is its host chunk itself (the CPU reads it where it is), so its
fetch is a copy of memory onto itself: issued, ordered and counted like any other (its event, the
wait for it, ``h2d_bytes``), but no bytes move. Both can keep a log of what they did (``log``: a
list, or ``None``), in issue order.
Called from the main thread and from autograd's threads, one at a time. Nothing here imports
Lightning.
"""

from __future__ import annotations

import gc
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

_ids = itertools.count(1)


class HostEvent:
    """An event of :class:`HostStreams`: set when the work before it is done."""

    __slots__ = ("id", "_pending")

    def __init__(self, done: bool) -> None:
        self.id = next(_ids)
        # Most events are complete when made (the host thread's own work, synchronous copies):
        # only one a background copy sets needs a ``threading.Event`` to wait on.
        self._pending: Optional[threading.Event] = None if done else threading.Event()

    def set(self) -> None:
        if self._pending is not None:
            self._pending.set()

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()

    def query(self) -> bool:
        return self._pending is None or self._pending.is_set()


class HostStreams:
    """The CPU standing in for the device (see the module docstring)."""

    def __init__(self) -> None:
        self.copy_delay = 0.0  # seconds each copy waits on the background thread (0: synchronous)
        self.log: Optional[list[tuple[Any, ...]]] = None
        self._jobs: Optional[queue.SimpleQueue[Optional[Callable[[], None]]]] = None
        self._thread: Optional[threading.Thread] = None

    def _note(self, *entry: Any) -> None:
        if self.log is not None:
            self.log.append(entry)

    def _run(self, dst: torch.Tensor, src: torch.Tensor, after: Optional[HostEvent]) -> HostEvent:
        # Source and destination the same memory (a resident chunk: see the module docstring):
        # nothing to move, but the copy keeps its place in the order (waits, event, delay).
        same = dst.data_ptr() == src.data_ptr()
        # Once copies went to the background thread they all do: copies stay in issue order (a
        # later event done means every earlier copy is, as on a CUDA stream).
        if self.copy_delay <= 0 and self._jobs is None:
            if after is not None:
                after.wait()
            if not same:
                dst.copy_(src)
            return HostEvent(done=True)
        event = HostEvent(done=False)
        delay = self.copy_delay

        def job() -> None:
            try:
                if after is not None:
                    after.wait()
                if delay > 0:
                    time.sleep(delay)
                if not same:
                    dst.copy_(src)  # the job holds ``src`` until it is copied
            finally:
                event.set()  # a failed copy still wakes its waiters (they read wrong data: tests see it)

        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=_loop, args=(self._jobs,), name="lightning_ckpt-copy", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return event

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, after: Optional[HostEvent], label: Any = None) -> HostEvent:
        event = self._run(dst, src, after)
        self._note("copy_in", event.id, getattr(after, "id", None), label)
        return event

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, after: Optional[HostEvent], label: Any = None) -> HostEvent:
        event = self._run(dst, src, after)
        self._note("copy_out", event.id, getattr(after, "id", None), label)
        return event

    def resident_buffer(self, host: torch.Tensor) -> torch.Tensor:
        """The host chunk itself: a fetch into it moves no bytes (see the module docstring)."""
        return host

    def record(self, label: Any = None) -> HostEvent:
        event = HostEvent(done=True)  # the host thread is the compute stream: its work is done
        self._note("record", event.id, label)
        return event

    def wait(self, event: HostEvent, label: Any = None) -> None:
        self._note("wait", event.id, label)
        event.wait()

    def synchronize(self, event: HostEvent) -> None:
        event.wait()

    def peak_bytes(self) -> Optional[int]:
        """The device allocator's peak, where there is one."""
        return None

    def reset_peak(self, held: int = 0) -> None:
        pass

    def close(self) -> None:
        if self._jobs is not None:
            done = HostEvent(done=False)
            self._jobs.put(done.set)
            done.wait()  # every queued copy is over before the memory it touches goes
            self._jobs.put(None)
            self._jobs = None


def _loop(jobs: queue.SimpleQueue[Optional[Callable[[], None]]]) -> None:
    while (job := jobs.get()) is not None:
        job()


class CudaStreams:
    """One CUDA device: an H2D stream for fetches, a D2H stream for gradients. The compute stream
    is whatever stream is current where the call is made (autograd runs a node's hooks on the
    stream of its forward)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.copy_delay_cycles = 0  # tests: ``torch.cuda._sleep`` cycles on the copy stream before each copy
        self._baseline = 0
        self.log: Optional[list[tuple[Any, ...]]] = None

    def _note(self, *entry: Any) -> None:
        if self.log is not None:
            self.log.append(entry)

    def _copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Any:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            if self.copy_delay_cycles:
                torch.cuda._sleep(self.copy_delay_cycles)
            dst.copy_(src, non_blocking=True)
            # Memory of the compute stream read or written here: not reused before the copy is done.
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, after: Any, label: Any = None) -> Any:
        event = self._copy(self.h2d, dst, src, after)
        self._note("copy_in", id(event), id(after) if after is not None else None, label)
        return event

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor, after: Any, label: Any = None) -> Any:
        event = self._copy(self.d2h, dst, src, after)
        self._note("copy_out", id(event), id(after) if after is not None else None, label)
        return event

    def resident_buffer(self, host: torch.Tensor) -> torch.Tensor:
        """Device memory of ``host``'s size, filled by the fetches."""
        return torch.empty(host.numel(), dtype=torch.uint8, device=self.device)

    def record(self, label: Any = None) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._note("record", id(event), label)
        return event

    def wait(self, event: Any, label: Any = None) -> None:
        self._note("wait", id(event), label)
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def peak_bytes(self) -> Optional[int]:
        """The allocator's peak since ``reset_peak``, less what was allocated then (another
        model, an earlier run): the device memory of this run."""
        return torch.cuda.max_memory_allocated(self.device) - self._baseline

    def reset_peak(self, held: int = 0) -> None:
        """The peak counts from here. ``held``: bytes already on the device that belong to this
        run (the model's tensors there): counted, not part of the baseline. Garbage of an earlier
        run is collected first: freed later, it would hide this run's memory from the peak."""
        gc.collect()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._baseline = torch.cuda.memory_allocated(self.device) - held

    def close(self) -> None:
        torch.cuda.synchronize(self.device)


Streams = Union[HostStreams, CudaStreams]


def streams_for(device: torch.device) -> Streams:
    """The device operations of ``device`` (``cuda`` or the CPU standing in for it)."""
    return CudaStreams(device) if device.type == "cuda" else HostStreams()
