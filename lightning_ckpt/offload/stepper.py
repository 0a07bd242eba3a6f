"""The worker side of ``ChunkedAdamW``: a chunk's runtime state, a queued step, the worker thread
and what it does to one chunk (gradients to the host, torch's fused CPU AdamW kernel, write-back).

Threads: ``Worker`` owns one daemon thread; everything in ``Stepper.__call__`` runs there. The main
thread touches a chunk's state, gradients or parameters only while its ``done`` event is set.
Nothing here imports Lightning.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.distributed.tensor import DTensor

from lightning_ckpt.offload.chunks import MASTER_DTYPE, ChunkSpec, HostArena


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part of ``t``: the local shard of a ``DTensor`` (an FSDP2 parameter or its
    gradient; a view of the memory FSDP2 all-gathers from, so writes to it are what the next
    all-gather reads), else ``t`` itself. Resolved at each use: FSDP2 may swap a parameter's local
    tensor (its lazy initialization does), never the parameter object. Any thread."""
    if isinstance(t, DTensor):
        with torch.no_grad():  # a plain view, never an autograd node (the worker thread has grad mode on)
            return t.to_local()
    return t


def stamp(p: torch.Tensor) -> tuple[int, int]:
    """What tells that ``p`` (a local tensor) was written from outside since it was last seen (see ``Chunk.versions``)."""
    return p.data_ptr(), p._version


@dataclass(eq=False, kw_only=True)
class Chunk:
    """Runtime side of a :class:`ChunkSpec`. ``done`` is set while no step of the chunk is queued
    or running: only then may the main thread touch its state, gradients or parameters.

    ``params_are_master``: the parameters are fp32 host memory of an owner that lets the optimizer
    step it (:mod:`lightning_ckpt.offload.inplace`: ``ChunkedOffloadStrategy``'s host chunks), so
    the chunk has no master weights in the arena (``master_flat`` and ``master`` empty): each job
    carries the parameters as they are at its ``step()`` (``masters_of``), and the kernel updates
    them in place, wherever they are then. Nothing here keeps a view of them between steps (it
    would keep memory their owner has let go of, e.g. the host chunks before the warm-up's
    re-layout, alive for as long as a parameter gets no gradient).
    """

    spec: ChunkSpec
    params: list[torch.Tensor]  # as the optimizer's groups hold them (FSDP2: DTensors; see ``local``)
    # Flat, on the parameters' device, in their dtype: allocated when the first gradient is moved
    # in (``grad_views``); never, when every gradient arrives as host memory of its own (a CPU
    # step reads those in place: ``ChunkedOffloadStrategy``'s host gradient buffers).
    grad_buffer: torch.Tensor | None
    grads: list[torch.Tensor]  # views of grad_buffer with the parameters' shapes (empty until then)
    master_flat: torch.Tensor  # the chunk's fp32 master weights in the arena (empty: not owned, or none)
    master: list[torch.Tensor]  # views of master_flat / the moments with the parameters' shapes
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
    # each parameter's (data pointer, ``_version``) when master last matched it: an in-place write
    # bumps the version, ``p.data = ...`` changes the pointer (and keeps the version)
    versions: list[tuple[int, int] | None]
    owner: int = 0  # the rank holding and stepping this chunk's state (sharded mode)
    owned: bool = True
    done: threading.Event = field(default_factory=threading.Event)
    synchronous: bool = True  # holds a parameter not seen in a module's forward: step() waits
    cuda_done: Any = None  # torch.cuda.Event after the last write-back (CUDA only)
    device: torch.device = torch.device("cpu")  # the parameters' device (of the gradient buffer)

    def __post_init__(self) -> None:
        self.done.set()

    def local(self, i: int) -> torch.Tensor:
        """Parameter ``i`` as this rank holds it: what the chunk's slot lays out (``local_of``)."""
        return local_of(self.params[i])

    @property
    def params_are_master(self) -> bool:
        """See the class docstring: the chunk's spec has no master region (never on CUDA, never sharded)."""
        return not self.spec.master

    def grad_views(self) -> list[torch.Tensor]:
        """``grads``, allocating the gradient buffer (zeros) on first use."""
        if self.grad_buffer is None:
            self.grad_buffer = torch.zeros(self.spec.numel, dtype=self.spec.dtype, device=self.device)
            self.grads = slot_views(self.spec, [self.local(i) for i in range(len(self.params))], self.grad_buffer)
        return self.grads

    def aliased(self, i: int) -> bool:
        """Is parameter ``i`` a view of its master weights (CPU, fp32: the kernel updates it in place)?
        Checked each time: something may have pointed the parameter elsewhere since (``p.data = ...``)."""
        if self.params_are_master:
            return True
        return self.owned and self.local(i).data_ptr() == self.master[i].data_ptr()

    def masters_of(self, members: list[int]) -> list[torch.Tensor]:
        """What the kernel steps for ``members``: their master weights, or (``params_are_master``)
        the parameters as they are now, wherever their owner has put them since the last step (so
        never stale memory, and a value written from outside is what the step starts from).
        Raises before anything is queued if one can no longer be stepped in place. Main thread."""
        if not self.owned:  # sharded mode: the owner steps it
            return []
        if not self.params_are_master:
            return [self.master[i] for i in members]
        for i in members:
            p = self.local(i)
            shape = self.exp_avg[i].shape
            if p.device.type != "cpu" or p.dtype != MASTER_DTYPE or not p.is_contiguous() or p.shape != shape:
                raise ValueError(
                    f"ChunkedAdamW steps this parameter (shape {tuple(shape)}) in place, as its fp32"
                    f" master weights, but it now is a {'' if p.is_contiguous() else 'non-contiguous '}{p.dtype}"
                    f" tensor of shape {tuple(p.shape)} on {p.device}. Change its values in place instead of"
                    " assigning `p.data` (`with torch.no_grad(): p.copy_(value)`); no step was taken."
                )
        return [self.local(i).detach() for i in members]  # the kernel does not bump versions: the write-back does


def slot_views(spec: ChunkSpec, params: list[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's view (its shape) of ``flat``, a tensor laid out as the chunk; none of an
    empty one (state a rank does not own)."""
    if flat.numel() == 0:
        return []
    return [flat[s.offset : s.offset + s.numel].view(p.shape) for s, p in zip(spec.slots, params)]


@dataclass(eq=False, kw_only=True)
class Job:
    """One chunk's step, queued for the worker thread (built by keyword)."""

    chunk: Chunk
    members: list[int]  # positions in the chunk of the parameters that have a gradient
    steps: list[torch.Tensor]  # their ``step`` state tensors
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grads_ready: Any = None  # torch.cuda.Event on the training stream (CUDA only)
    grads: list[torch.Tensor] = field(default_factory=list)  # the members' (local) ``.grad`` at ``step()``
    # CUDA: the gradients are views of the chunk's gradient buffer (one copy to the host); else
    # each is copied on its own (FSDP2's sharded gradients, which stay where FSDP2 put them)
    grads_in_buffer: bool = True
    masters: list[torch.Tensor] = field(default_factory=list)  # what the kernel steps (``Chunk.masters_of``)


class Worker:
    """One daemon thread stepping queued chunks in order. It holds no reference to the optimizer,
    so an unused optimizer (and its arena) is collected; ``stop`` ends the thread."""

    def __init__(self, run: Callable[[Job], None]) -> None:
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.error: tuple[Job, BaseException] | None = None
        self.run = run  # what the thread does to each job (tests wrap it to inject delays)
        self._thread = threading.Thread(target=self._loop, name="lightning_ckpt-adamw", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                if self.error is None:  # after a failure, later chunks are released unstepped
                    self.run(job)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
                self.error = (job, exc)
            finally:
                job.chunk.done.set()  # every waiter wakes up, failed or not: nothing hangs

    def stop(self) -> None:
        self.jobs.put(None)

    def join(self) -> None:
        if threading.current_thread() is not self._thread:
            self._thread.join()


class Stepper:
    """What the worker thread does to one chunk: gradients to the host, the kernel, write-back.

    Owns the transfer buffers: one host fp32 gradient buffer (used when gradients are on CUDA or
    not fp32) and, on CUDA, one device fp32 buffer for the write-back and the two side streams.
    One buffer each is enough: the worker steps one chunk at a time, and a CUDA chunk's copies are
    synchronized (D2H) or stream-ordered (H2D) before the next chunk reuses them.
    """

    def __init__(
        self, arena: HostArena, largest: int, device: torch.device, group: Any = None, device_group: Any = None
    ) -> None:
        self.arena = arena
        # Sharded mode: the owner of each chunk sends its updated fp32 values to the other ranks,
        # over ``group`` (gloo: from the host arena into each rank's pinned buffer), or, on CUDA
        # with ``device_group`` (NCCL), from the owner's device buffer straight into the others'.
        # Every rank steps the chunks in the same order in this thread alone, so the broadcasts of
        # either group pair up whatever the training thread's collectives do meanwhile.
        self.group = group
        self.device_group = device_group
        self.last_write: Any = None  # CUDA: the event after the last write-back
        self.cuda = device.type == "cuda"
        self.host_grad = torch.empty(largest, dtype=MASTER_DTYPE, pin_memory=self.cuda)
        if self.cuda:
            self.device = device
            self.device_master = torch.empty(largest, dtype=MASTER_DTYPE, device=device)
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def _host_grads(self, job: Job) -> list[torch.Tensor]:
        c = job.chunk
        if not self.cuda and c.spec.dtype == MASTER_DTYPE:
            return job.grads  # already host memory (the chunk's views, or a buffer of their own): read in place
        flat = self.host_grad[: c.spec.numel]
        slots = c.spec.slots
        views = [flat[slots[i].offset : slots[i].offset + slots[i].numel].view_as(c.local(i)) for i in job.members]
        if self.cuda:
            with torch.cuda.device(self.device), torch.cuda.stream(self.d2h):
                self.d2h.wait_event(job.grads_ready)
                if job.grads_in_buffer:
                    flat.copy_(c.grad_buffer, non_blocking=True)
                else:
                    for view, grad in zip(views, job.grads):
                        view.copy_(grad, non_blocking=True)
            self.d2h.synchronize()
        else:
            for view, grad in zip(views, job.grads):
                view.copy_(grad)  # bf16 / fp16 gradients upcast
        return views

    def _write_back(self, job: Job, source: torch.Tensor | None) -> None:
        """Updated fp32 values of the chunk (``source``: host, flat; ``None``: a chunk another rank
        owns, arriving over ``device_group``) into its parameters; where the
        kernel updated a parameter in place (``Chunk.params_are_master``, an aliased parameter)
        only its version counter is bumped (state-dict entries share it; saves tell unchanged
        tensors by it). Chunks whose parameters are their master weights are host memory, so the
        optimizer's device is the CPU: they never take the CUDA branch."""
        c = job.chunk
        slots = c.spec.slots
        with torch.no_grad():
            if self.cuda:
                with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
                    # After the step's gradients (and, through the training stream's order, a
                    # pending save's copies of these parameters): a chunk another rank owns
                    # arrives by broadcast, with no device wait of its own before this write.
                    self.h2d.wait_event(job.grads_ready)
                    flat = self.device_master[: c.spec.numel]
                    if source is not None:
                        flat.copy_(source, non_blocking=True)
                    if self.device_group is not None:
                        # Issued with h2d current, so it is ordered on h2d after the copy above
                        # and before the parameter copies below that read ``flat`` (NCCL runs on,
                        # or is joined to, the caller's current stream).
                        torch.distributed.broadcast(flat, src=c.owner, group=self.device_group)
                    for i in job.members:
                        p = c.local(i)
                        p.copy_(flat[slots[i].offset : slots[i].offset + slots[i].numel].view_as(p))
                    event = torch.cuda.Event()
                    event.record(self.h2d)
                # Until ``event`` the copy reads ``source``: the next job waits for it first.
                c.cuda_done = self.last_write = event
            else:
                for i in job.members:
                    p = c.local(i)
                    if source is c.master_flat and c.aliased(i):  # ``aliased`` holds for ``params_are_master``
                        increment_version(p)
                    else:
                        p.copy_(source[slots[i].offset : slots[i].offset + slots[i].numel].view_as(p))
        for i in job.members:
            c.versions[i] = stamp(c.local(i))
            if isinstance(c.params[i], DTensor):
                # A DTensor's counter is its own (saves compare it): the writes above were to its shard.
                increment_version(c.params[i])

    def __call__(self, job: Job) -> None:
        c = job.chunk
        if self.last_write is not None:
            self.last_write.synchronize()  # host buffers read by the last H2D copy are free again
        if not c.owned:  # sharded mode: the owner steps it; its updated values arrive here
            torch._foreach_add_(job.steps, 1)
            if self.device_group is not None:
                self._write_back(job, None)
                return
            received = self.host_grad[: c.spec.numel]
            torch.distributed.broadcast(received, src=c.owner, group=self.group)
            self._write_back(job, received)
            return
        self.arena.writable(c.spec)
        grads = self._host_grads(job)
        # As torch.optim.AdamW(fused=True) does: steps first, then the kernel, one call per chunk
        # with the parameters' own views (the kernel's vector body and scalar tail then cover the
        # same elements as for separate tensors: a flat call would differ in the tails).
        torch._foreach_add_(job.steps, 1)
        torch._fused_adamw_(
            job.masters,
            grads,
            [c.exp_avg[i] for i in job.members],
            [c.exp_avg_sq[i] for i in job.members],
            [],
            job.steps,
            lr=job.lr,
            beta1=job.beta1,
            beta2=job.beta2,
            weight_decay=job.weight_decay,
            eps=job.eps,
            amsgrad=False,
            maximize=False,
        )
        # The fused kernel bumps no version counter: saves tell changed state by them (and the
        # optimizer's post-step hooks, run when ``step()`` returns, may be before this runs).
        increment_version([*(c.exp_avg[i] for i in job.members), *(c.exp_avg_sq[i] for i in job.members)])
        if self.group is not None and self.device_group is None:
            torch.distributed.broadcast(c.master_flat, src=c.owner, group=self.group)
        self._write_back(job, c.master_flat)
