"""The host chunks, device slots and hooks of ``ChunkedOffloadStrategy`` (no Lightning in here).

At setup every parameter's data is moved into a host chunk (the layout of
:func:`lightning_ckpt.offload.chunks.plan_chunks`, tied parameters stored once) and the parameter's
``.data`` points there. The device then holds the plan's resident chunks (for the whole run) and a
fixed pool of slots, one streamed chunk each. The host chunks are the truth: between a backward
and the next use every parameter, resident or not, points at its host chunk, the optimizer steps
it there, and a resident chunk is copied to its device buffer again on its first use after that
(on the CPU that buffer is the host chunk: the copy keeps its place in the ordering and its bytes
in ``h2d_bytes``, and moves nothing).

Device work goes through :mod:`lightning_ckpt.offload.streams` (CUDA, or the CPU standing in for
it). Invariants, per chunk in device memory:

- **fetch before use**: a chunk is copied in on the copy stream (after its optimizer step is done:
  ``ChunkedAdamW.wait_for``), and the compute stream waits for that copy's event when the chunk is
  pinned for use, before any kernel that reads it is issued;
- **release before reuse**: when a chunk's last pin is dropped an event is recorded on the compute
  stream (after every kernel that read it); the next copy into its slot waits for that event. A
  chunk is evicted only while unpinned, so never while a kernel may still read it;
- **gradients out before the step**: see :mod:`lightning_ckpt.offload.gradients`. After backward
  every copy is waited for on the host, and one event after the backward's kernels releases every
  slot and resident buffer.

Call order, per training step (the main thread; backward hooks on autograd's thread for the
device, one node at a time):

1. forward pre-hook of a unit: fetch its chunks (pinned while the unit runs), then fetch the next
   ``prefetch`` units of the traced order into free slots; forward hook: unpin.
2. Autograd saves a parameter, or a view of a slot, through the saved-tensor hooks: it is packed
   as (parameter or chunk, view geometry), never as the slot's memory, so a slot can be reused by
   another chunk while the graph waits for backward.
3. backward: a hook on each unit output's gradient (it runs before the unit's backward) unpins
   what earlier backward nodes used (those nodes are done: their kernels are issued), fetches the
   unit's chunks and prefetches the ``prefetch`` units before it. Unpacking a saved parameter
   fetches its chunk if it is not held (and pins it until the next such hook). Gradients leave
   the device as autograd makes them.
4. at the end of backward (``finish_backward``, queued on autograd's engine so that hooks after
   backward see the gradients): every slot is released, every parameter points at its host chunk
   and its gradient at its host gradient. The first step is the warm-up: it runs the smallest plan
   and records the unit order and activation bytes; after its backward (``end_backward``) the
   chunks are repacked in first-use order and the final plan is applied.

Eviction takes the unpinned chunk whose next use in the traced order is furthest (Belady).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable
from typing import Any, Optional

import torch

from lightning_ckpt.hostmem import SharedBuffer
from lightning_ckpt.offload import inplace
from lightning_ckpt.offload.adamw import ChunkedAdamW
from lightning_ckpt.offload.gradients import HostGrads
from lightning_ckpt.offload.layout import host_layout
from lightning_ckpt.offload.materialize import materialize_parameter
from lightning_ckpt.offload.placement import OffloadPlan, Unit, plan_offload
from lightning_ckpt.offload.streams import Streams

HOST, RESIDENT = -1, -2  # where a chunk's memory is, besides a slot (its index)


class _Activations:
    """A tensor autograd saved that is not parameter memory: counted while the graph holds it."""

    __slots__ = ("tensor", "_streamer", "_bytes")

    def __init__(self, tensor: torch.Tensor, streamer: "Streamer") -> None:
        self.tensor = tensor
        self._streamer = streamer
        self._bytes = tensor.numel() * tensor.element_size()
        streamer._activation_change(self._bytes)

    def __del__(self) -> None:
        self._streamer._activation_change(-self._bytes)


class Streamer:
    """The host chunks, the device slots and the hooks of one model (no Lightning in here)."""

    def __init__(
        self,
        units: list[tuple[str, torch.nn.Module]],
        params: list[torch.nn.Parameter],
        chunk_bytes: int,
        budget: int,
        prefetch: int,
        device: torch.device,
        streams: Streams,
    ) -> None:
        self.device = device
        self.streams = streams
        self.budget = budget
        self.prefetch = prefetch
        self.unit_modules = units
        self.unit_params = [unique(m.parameters()) for _, m in units]
        self.optimizers: list[ChunkedAdamW] = []
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.peak_device_bytes = 0
        self._live_activations = 0
        self.unit_activation = [0] * len(units)  # live activation bytes after each unit (warm-up)
        self.traced_activation_peak = 0  # the warm-up step's peak, wherever it was
        self.trace: list[int] = []
        self.groups: list[tuple[int, ...]] = []  # units recomputed together (activation checkpointing)
        self.warming_up = True
        self._chunk_bytes_arg = chunk_bytes
        self.grads: Optional[HostGrads] = None
        self._pool: Optional[SharedBuffer] = None  # the memory of the host chunks and gradients
        self._last_copy: Any = None  # the event of the last copy into device memory
        self._idle: Any = None  # the event after which no kernel issued so far reads device memory
        self._finish_queued = False
        self._pack(params)
        self.plan: OffloadPlan = self._plan()  # raises OffloadBudgetError before anything runs
        self._apply(self.plan)
        self._handles = []
        for u, (_, module) in enumerate(units):
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, u)))
            self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, u)))
        for p in params:
            if p.requires_grad:
                # Before any optimizer's hook (they are built later): the gradient leaves first.
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_done))

    # -- layout -------------------------------------------------------------------------------

    def _pack(self, params: list[torch.nn.Parameter]) -> None:
        """Move every parameter's data into host chunks, in the order of ``params`` (a parameter on
        the meta device gets its place there, zeroed). No parameter is ever the whole of its
        storage, so ChunkedAdamW leaves it here (it moves only those owning their memory)."""
        self.params = params
        self._views: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}  # see ``_place``
        self.layout = layout = host_layout(params, self._chunk_bytes_arg, self.device)
        self.specs = layout.specs
        self.chunk_nbytes = layout.chunk_nbytes
        old_pool, self._pool = self._pool, layout.pool
        self.host = layout.host
        with torch.no_grad():
            for spec in layout.specs:
                for slot in spec.slots:
                    p = params[slot.param]
                    view = layout.view(self.host[spec.index], slot.offset, p)
                    if p.is_meta:  # no values yet: zeroed in its chunk, initialized by the strategy
                        materialize_parameter(p, view)
                    else:
                        view.copy_(p.detach())
                        p.data = view
        # ChunkedAdamW steps fp32 parameters here in place, with no master copy of its own. Our side
        # of that: a host chunk is read (fetched) after ``wait_for`` its parameters, re-laid out
        # (here) after ``wait`` (``_unapply``), its values copied and the parameters re-pointed.
        inplace.register(self, self.host)
        old, self.grads = self.grads, HostGrads(
            self.streams, params, layout.places, layout.grad_buffers, pin=self.device.type == "cuda"
        )
        if old is not None:
            self.grads.adopt(old)
            self.d2h_bytes += old.d2h_bytes
        if old_pool is not None:
            old_pool.close()  # page-locking ends; nothing views it any longer but ``old``'s tensors
        self.units = [
            Unit(name, tuple(sorted({layout.place_of(p)[0] for p in ps})))
            for (name, _), ps in zip(self.unit_modules, self.unit_params)
        ]
        names: dict[int, str] = {}  # parameter -> its name under the first unit holding it (all a streamed one can have)
        for unit, module in self.unit_modules:
            for name, p in module.named_parameters():
                names.setdefault(id(p), f"{unit}.{name}" if unit else name)
        # Chunks of one parameter (never split): named in the plan's budget errors.
        self.single = {
            spec.index: names.get(id(params[spec.slots[0].param]), f"parameter {spec.slots[0].param}")
            for spec in self.specs
            if len(spec.slots) == 1
        }
        self._uses: list[list[int]] = [[] for _ in self.specs]  # trace positions using each chunk
        for i, u in enumerate(self.trace):
            for c in self.units[u].chunks:
                self._uses[c].append(i)

    def _place(self, chunk: int, where: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The memory of ``chunk`` at ``where`` (``HOST``, ``RESIDENT`` or a slot index) and its
        parameters' views of it."""
        place = self._views.get((chunk, where))
        if place is None:
            # Made once per chunk and place while the memory lives: ``_apply``, ``_unapply`` and
            # ``_pack`` forget them (so they never keep device memory alive past ``_unapply``).
            if where == HOST:
                buffer = self.host[chunk]
            elif where == RESIDENT:
                buffer = self.resident[chunk]
            else:
                buffer = self.slots[where][: self.chunk_nbytes[chunk]]
            views = [self.layout.view(buffer, slot.offset, self.params[slot.param]) for slot in self.specs[chunk].slots]
            place = self._views[(chunk, where)] = (buffer, views)
        return place

    def _point(self, chunk: int, where: int) -> None:
        """Every parameter of ``chunk`` at its place in the chunk's memory at ``where``."""
        for slot, view in zip(self.specs[chunk].slots, self._place(chunk, where)[1]):
            p = self.params[slot.param]
            if p.data_ptr() != view.data_ptr() or p.device != view.device:
                p.data = view

    def _plan(self) -> OffloadPlan:
        if self.warming_up:
            return plan_offload(self.chunk_nbytes, self.units, self.budget, together=self.groups, single=self.single)
        return plan_offload(
            self.chunk_nbytes, self.units, self.budget,
            trace=self.trace, activation=self.unit_activation, prefetch=self.prefetch, together=self.groups,
            activation_peak=self.traced_activation_peak, single=self.single,
        )

    def set_groups(self, groups: list[tuple[int, ...]]) -> None:
        """Units recomputed together in backward: re-plan so that each set fits the slots at once."""
        if groups == self.groups:
            return
        self.groups = groups
        self._unapply()
        self._apply(self._plan())

    def _apply(self, plan: OffloadPlan) -> None:
        """Allocate the plan's device memory once: resident chunks (filled on first use) and the
        slots. Every parameter stays on its host chunk until its first use."""
        self.resident: dict[int, torch.Tensor] = {}
        for c in sorted(plan.resident):
            # On the CPU the host chunk itself (its refills move no bytes): ``Streams.resident_buffer``.
            self.resident[c] = self.streams.resident_buffer(self.host[c])
        self.stale = set(self.resident)  # resident chunks whose device copy is older than the host's
        # Resident chunks no unit holds are read outside every unit's hooks: filled before each step.
        held = {c for unit in self.units for c in unit.chunks}
        self.unhooked = sorted(c for c in self.resident if c not in held)
        self.fetched: dict[int, Any] = {}  # chunk -> its copy's event, until the compute stream waited
        self.slots = [torch.empty(plan.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(plan.slots)]
        self._slot_by_ptr = {s.data_ptr(): i for i, s in enumerate(self.slots)}
        # Storages that do not move while the graph waits: resident buffers, the host chunks' one.
        self._stable_ptrs = {t.untyped_storage().data_ptr() for t in [*self.resident.values(), *self.host]}
        self._views = {}
        self.holder: list[int | None] = [None] * plan.slots  # chunk in each slot
        # Per slot: the event after the last kernel that read it (the next copy into it waits).
        self.released: list[Any] = [self._idle] * plan.slots
        self.slot_of: dict[int, int] = {}  # chunk -> slot
        self.pins: dict[int, int] = {}  # chunk -> pin count (pinned: a kernel may still read it)
        self._backward_pins: list[int] = []
        self._recompute_pins: list[int] = []
        self._recompute_units: set[int] = set()
        self._forward_pos = 0
        self._backward_pos: int | None = None
        self.plan = plan

    def _unapply(self) -> None:
        """Every parameter back on its host chunk (the truth: nothing is copied back)."""
        # A step still running writes into whatever the parameters point at: let it finish first.
        for optimizer in self.optimizers:
            optimizer.wait()
        self.release_all()
        self.streams.synchronize(self._idle)  # nothing reads the device memory now: it can go
        self.resident = {}
        self.slots = []
        self._views = {}

    # -- fetch and evict ------------------------------------------------------------------------

    def _next_use(self, chunk: int) -> float:
        """Steps of the traced order until ``chunk`` is used again in the current direction."""
        uses = self._uses[chunk]
        if self._backward_pos is None:
            i = bisect.bisect_left(uses, self._forward_pos)
            if i < len(uses):
                return uses[i] - self._forward_pos
            # Used again in backward, which walks the trace from its end.
            return (len(self.trace) - self._forward_pos) + (len(self.trace) - 1 - uses[-1]) if uses else float("inf")
        i = bisect.bisect_left(uses, self._backward_pos) - 1
        return self._backward_pos - uses[i] if i >= 0 else float("inf")

    def _slot_for(self, chunk: int, distance: float | None) -> int | None:
        """A free slot, or one freed by evicting the unpinned chunk used furthest ahead.
        ``distance``: prefetch only evicts a chunk used later than the prefetched one."""
        for i, held in enumerate(self.holder):
            if held is None:
                return i
        victims = [c for c in self.slot_of if not self.pins.get(c)]
        if not victims:
            return None
        victim = max(victims, key=lambda c: (self._next_use(c), c))
        if distance is not None and self._next_use(victim) <= distance:
            return None
        slot = self.slot_of[victim]
        self._evict(victim)
        return slot

    def _evict(self, chunk: int) -> None:
        # Parameters are read-only between optimizer steps: the host chunk is current, no copy back.
        # Unpinned: ``released[slot]`` already follows every kernel that read it.
        slot = self.slot_of.pop(chunk)
        self.holder[slot] = None
        self.fetched.pop(chunk, None)
        self._point(chunk, HOST)

    def _copy_in(self, chunk: int, where: int, after: Any) -> None:
        # A chunk can hold parameters of several units: wait for the optimizer's step of every
        # one of them before its host memory is copied.
        params = [self.params[s.param] for s in self.specs[chunk].slots]
        for optimizer in self.optimizers:
            optimizer.wait_for(params)
        with torch.no_grad():
            label = ("fetch", chunk, "resident" if where == RESIDENT else where)
            event = self.streams.copy_in(self._place(chunk, where)[0], self.host[chunk], after, label=label)
        self.fetched[chunk] = self._last_copy = event
        # What a device copies, also where the CPU's resident chunk is its host chunk (no bytes move).
        self.h2d_bytes += self.chunk_nbytes[chunk]
        self._point(chunk, where)

    def _fetch(self, chunk: int, pin: bool, distance: float | None = None) -> None:
        if chunk in self.resident:
            if chunk in self.stale:
                self.stale.discard(chunk)
                self._copy_in(chunk, RESIDENT, self._idle)
        elif chunk not in self.slot_of:
            slot = self._slot_for(chunk, distance)
            if slot is None:
                if distance is not None:
                    return  # a prefetch that would evict something needed sooner: skipped
                raise RuntimeError(
                    f"ChunkedOffloadStrategy: no free slot for chunk {chunk}: all {len(self.slots)} slots hold chunks"
                    " a running unit reads. A unit reads parameters of more chunks than the plan counted (a parameter"
                    " read outside the forward of the module that registers it?). Name larger units with"
                    " `unit_types`, or raise `device_memory_budget`."
                )
            self.holder[slot] = chunk
            self.slot_of[chunk] = slot
            self._copy_in(chunk, slot, self.released[slot])
        if pin:
            self.pins[chunk] = self.pins.get(chunk, 0) + 1
            event = self.fetched.pop(chunk, None)
            if event is not None:  # the kernels issued from here on read it: after its copy
                self.streams.wait(event, label=("use", chunk, self.slot_of.get(chunk, "resident")))

    def _unpin(self, chunk: int) -> None:
        if self.pins.get(chunk):
            self.pins[chunk] -= 1
            if not self.pins[chunk] and chunk in self.slot_of:
                slot = self.slot_of[chunk]
                self.released[slot] = self.streams.record(("release", chunk, slot))

    def _fetch_unit(self, u: int, pin: bool, distance: float | None = None) -> None:
        for c in self.units[u].chunks:
            self._fetch(c, pin, distance)

    def refresh_unhooked(self) -> None:
        """Fill the resident chunks no unit holds (read outside the hooks): before each step."""
        for c in self.unhooked:
            self._fetch(c, pin=True)
            self.pins[c] = 0  # resident: never evicted, nothing to release

    def release_all(self) -> None:
        """Every slot free, every pin dropped, every parameter on its host chunk: nothing issued
        so far may read device memory after the event recorded here, which every later copy into
        it waits for."""
        self._idle = self.streams.record(("idle",))
        for chunk in list(self.slot_of):
            self._evict(chunk)
        self.released = [self._idle] * len(self.slots)
        for c in self.resident:
            self._point(c, HOST)
            self.stale.add(c)
            self.fetched.pop(c, None)
        self.pins.clear()
        self._backward_pins = []
        self._recompute_pins = []
        self._recompute_units = set()
        self._backward_pos = None
        self._forward_pos = 0

    def to_host(self) -> None:
        """Outside a step (no unit running, no backward): every parameter back on its host chunk,
        as after a backward, so that a save reads host memory; the next use fetches again."""
        if any(self.pins.values()) or torch._C._current_graph_task_id() != -1:
            return
        self.release_all()

    # -- hooks ----------------------------------------------------------------------------------

    def _pre_forward(self, u: int, module: torch.nn.Module, args: Any) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        if self.warming_up and not in_backward and torch.is_grad_enabled():
            self.trace.append(u)
        if not in_backward and self.trace and not self.warming_up:
            pos = self._position(u, self._forward_pos, forward=True)
            self._forward_pos = pos + 1
        self._fetch_unit(u, pin=True)
        self._note_peak()
        if in_backward:
            # A checkpointed block recomputes: what it saves views these slots until its backward
            # is over, so its units stay pinned until backward reaches a unit outside it.
            self._recompute_units.add(u)
            self._recompute_pins.extend(self.units[u].chunks)
            return
        if not self.warming_up:
            start = self._forward_pos
            for j in range(start, min(start + self.prefetch, len(self.trace))):
                self._fetch_unit(self.trace[j], pin=False, distance=j - start)

    def _post_forward(self, u: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recompute: pinned until its block's backward is over (see _pre_forward)
        for c in self.units[u].chunks:
            self._unpin(c)
        if self.warming_up:
            self.unit_activation[u] = max(self.unit_activation[u], self._live_activations)
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, u))

    def _pre_backward(self, u: int, grad: torch.Tensor) -> None:
        self._queue_finish()
        # Nodes run one at a time: whatever earlier nodes unpacked, they are done with.
        for c in self._backward_pins:
            self._unpin(c)
        self._backward_pins = []
        if self._recompute_pins and u not in self._recompute_units:
            for c in self._recompute_pins:
                self._unpin(c)
            self._recompute_pins = []
            self._recompute_units = set()
        if self.trace and not self.warming_up:
            start = len(self.trace) if self._backward_pos is None else self._backward_pos
            self._backward_pos = self._position(u, start - 1, forward=False)
        elif self._backward_pos is None:
            self._backward_pos = len(self.trace)
        self._fetch_unit(u, pin=True)
        self._backward_pins.extend(self.units[u].chunks)
        if not self.warming_up:
            pos = self._backward_pos
            for j in range(pos - 1, max(pos - 1 - self.prefetch, -1), -1):
                self._fetch_unit(self.trace[j], pin=False, distance=pos - j)
        return None

    def _position(self, u: int, start: int, forward: bool) -> int:
        """The trace position of this call of unit ``u``: the next one from ``start`` in the
        direction of the pass, else its first (forward) or last (backward) call."""
        trace = self.trace
        if forward:
            for i in range(max(start, 0), len(trace)):
                if trace[i] == u:
                    return i
            return trace.index(u) if u in trace else max(start, 0)
        for i in range(min(start, len(trace) - 1), -1, -1):
            if trace[i] == u:
                return i
        return len(trace) - 1 - trace[::-1].index(u) if u in trace else max(start, 0)

    def _grad_done(self, p: torch.Tensor) -> None:
        # The gradient leaves the device for the host step, into its chunk's gradient buffer.
        self._queue_finish()
        assert self.grads is not None
        self.grads.arrive(p)

    def _queue_finish(self) -> None:
        if not self._finish_queued:
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def begin_backward(self) -> None:
        """Before a backward: gradients from earlier backwards are put aside (accumulation)."""
        assert self.grads is not None
        self.grads.begin()

    def finish_backward(self) -> None:
        """The end of a backward (autograd's final callback, and again after it: idempotent):
        every slot released, every parameter and gradient in host memory."""
        self._finish_queued = False
        self.release_all()
        if self._last_copy is not None:
            # A prefetch nothing used may still read a host chunk the optimizer writes next.
            self.streams.synchronize(self._last_copy)
            self._last_copy = None
        assert self.grads is not None
        self.grads.finish()

    # -- saved tensors ------------------------------------------------------------------------

    def pack_saved(self, t: torch.Tensor) -> Any:
        if self.layout.holds(t):
            return ("param", t)
        if t.device == self.device and t.numel() > 0:
            ptr = t.untyped_storage().data_ptr()
            if ptr in self._stable_ptrs:
                return t  # a resident or host chunk: it does not move while the graph waits
            slot = self._slot_by_ptr.get(ptr)
            if slot is not None and self.holder[slot] is not None:
                chunk = self.holder[slot]
                # Bytes into the chunk, then into the parameter holding them: the pack names the
                # parameter, not the chunk's index or place (both change when the warm-up re-lays
                # the chunks out; the chunk may be resident by the time the backward reads it).
                at = t.storage_offset() * t.element_size() - self.slots[slot].storage_offset()
                param, in_param = self.layout.param_at(chunk, at)
                return ("view", param, t.dtype, tuple(t.shape), t.stride(), in_param)
        return _Activations(t, self)

    def unpack_saved(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Activations):
            return packed.tensor
        kind, param = packed[0], packed[1]
        chunk, in_chunk = self.layout.place_of(param)
        self._fetch(chunk, pin=True)
        self._backward_pins.append(chunk)
        if kind == "param":
            return param
        _, _, dtype, shape, stride, in_param = packed
        base = self.slots[self.slot_of[chunk]] if chunk in self.slot_of else self.resident[chunk]
        # ``as_strided`` takes a storage offset, and ``base`` may start inside its storage (on the
        # CPU a resident chunk is a region of the host pool).
        at = base.storage_offset() + in_chunk + in_param
        assert at % dtype.itemsize == 0, "views of a chunk are aligned to their dtype"
        return torch.as_strided(base.view(dtype), shape, stride, at // dtype.itemsize)

    def _activation_change(self, nbytes: int) -> None:
        self._live_activations += nbytes
        if nbytes > 0:
            if self.warming_up:
                self.traced_activation_peak = max(self.traced_activation_peak, self._live_activations)
            self._note_peak()

    def _note_peak(self) -> None:
        device = self.plan.resident_bytes + len(self.slots) * self.plan.slot_bytes + self._live_activations
        self.peak_device_bytes = max(self.peak_device_bytes, device)

    # -- the warm-up ----------------------------------------------------------------------------

    def end_backward(self) -> None:
        """After a backward: free every slot; after the first one, apply the traced plan."""
        self.finish_backward()
        if not self.warming_up or not self.trace:
            return
        allocated = self.streams.peak_bytes()
        if allocated is not None:
            # The device's own count of what is not parameter memory (transients, the batch,
            # gradients before they leave): the plan keeps room for it.
            ours = self.plan.resident_bytes + len(self.slots) * self.plan.slot_bytes
            self.traced_activation_peak = max(self.traced_activation_peak, allocated - ours)
        self.warming_up = False
        self._unapply()
        first_use: dict[int, torch.nn.Parameter] = {}
        for u in self.trace:
            for p in self.unit_params[u]:
                first_use.setdefault(id(p), p)
        for p in self.params:
            first_use.setdefault(id(p), p)
        self._pack(list(first_use.values()))
        self._apply(self._plan())

    def close(self) -> None:
        self._unapply()
        inplace.unregister(self)
        self.streams.close()
        if self._pool is not None:
            # Unregistered, not unmapped: the parameters keep viewing the host chunks.
            self._pool.close()
        for handle in self._handles:
            handle.remove()

    def stats(self) -> dict[str, int]:
        allocated = self.streams.peak_bytes()
        assert self.grads is not None
        return {
            "device_memory_budget": self.budget,
            # The device allocator's peak where there is one (CUDA), else this strategy's count.
            "peak_device_bytes": self.peak_device_bytes if allocated is None else allocated,
            "accounted_peak_bytes": self.peak_device_bytes,
            "resident_chunks": len(self.plan.resident),
            "streamed_chunks": len(self.specs) - len(self.plan.resident),
            "slots": self.plan.slots,
            "slot_bytes": self.plan.slot_bytes,
            "resident_bytes": self.plan.resident_bytes,
            "activation_bytes": self.plan.activation_bytes,
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes + self.grads.d2h_bytes,
        }


def unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in params}.values())


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
