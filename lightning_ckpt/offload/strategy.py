"""``ChunkedOffloadStrategy``: parameters in host chunks, streamed through fixed device slots.

The model is never moved to the device whole. At setup every parameter's data is moved into a
host chunk (the layout of :func:`lightning_ckpt.offload.chunks.plan_chunks`, tied parameters
stored once) and the parameter's ``.data`` points there. The device then holds the plan's
resident chunks (for the whole run) and a fixed pool of slots, one streamed chunk each.

Call order, per training step (all on the main thread):

1. forward pre-hook of a unit: fetch its chunks into slots, pinned while the unit runs (never
   evicted), each after ``ChunkedAdamW`` has stepped every parameter in it (a chunk can hold
   parameters of several units); then fetch the next ``prefetch`` units of the traced order into
   free slots; forward hook: unpin.
2. Autograd saves a parameter, or a view of a slot, through this strategy's saved-tensor hooks:
   it is packed as (parameter or chunk, view geometry), never as the slot's memory, so a slot
   can be reused by another chunk while the graph waits for backward.
3. backward: a hook on each unit output's gradient (it runs before the unit's backward) unpins
   what earlier backward nodes used (on the CPU engine nodes run one at a time: those nodes are
   done), fetches the unit's chunks and prefetches the ``prefetch`` units before it. Unpacking a
   saved parameter fetches its chunk if it is not held (and pins it until the next such hook).
4. after backward (``post_backward``): every slot is released and every streamed parameter points
   at its host chunk again, so the optimizer step writes the host chunks (the truth for streamed
   chunks). The first step is the warm-up: it runs the smallest plan and records the unit order
   and activation bytes; after its backward the chunks are repacked in first-use order and the
   final plan is applied.

Eviction takes the unpinned chunk whose next use in the traced order is furthest (Belady).
"""

import bisect
import functools
import os
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_ckpt.activation import installed_checkpointing, module_matcher
from lightning_ckpt.offload.adamw import ChunkedAdamW
from lightning_ckpt.offload.chunks import plan_chunks
from lightning_ckpt.offload.placement import OffloadBudgetError, OffloadPlan, Unit, plan_offload
from lightning_ckpt.plan import parse_size

_ALIGN = 64  # bytes; every slot and chunk offset is a multiple (any dtype views it)
_AUTO_MARGIN = 0.9  # "auto": this share of the device's free memory


class _Activations:
    """A tensor autograd saved that is not parameter memory: counted while the graph holds it."""

    __slots__ = ("tensor", "_streamer", "_bytes")

    def __init__(self, tensor: torch.Tensor, streamer: "_Streamer") -> None:
        self.tensor = tensor
        self._streamer = streamer
        self._bytes = tensor.numel() * tensor.element_size()
        streamer._activation_change(self._bytes)

    def __del__(self) -> None:
        self._streamer._activation_change(-self._bytes)


class _Streamer:
    """The host chunks, the device slots and the hooks of one model (no Lightning in here)."""

    def __init__(
        self,
        units: list[tuple[str, torch.nn.Module]],
        params: list[torch.nn.Parameter],
        chunk_bytes: int,
        budget: int,
        prefetch: int,
        device: torch.device,
    ) -> None:
        self.device = device
        self.budget = budget
        self.prefetch = prefetch
        self.unit_modules = units
        self.unit_params = [_unique(m.parameters()) for _, m in units]
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
        self._pack(params)
        self.plan: OffloadPlan = self._plan()  # raises OffloadBudgetError before anything runs
        self._apply(self.plan)
        self._handles = []
        for u, (_, module) in enumerate(units):
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, u)))
            self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, u)))
        for p in params:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_done))

    # -- layout -------------------------------------------------------------------------------

    def _pack(self, params: list[torch.nn.Parameter]) -> None:
        """Move every parameter's data into host chunks, in the order of ``params``."""
        self.params = params
        entries = [(0, _aligned(p.numel() * p.element_size()), p.dtype) for p in params]
        layout = plan_chunks(entries, self._chunk_bytes_arg)
        self.specs = layout.chunks
        # plan_chunks packs elements; each element here is a byte (sizes and offsets are bytes,
        # each parameter padded to _ALIGN so every dtype views its place).
        self.chunk_nbytes = [spec.numel for spec in layout.chunks]
        self.host = [torch.empty(n, dtype=torch.uint8, pin_memory=self.device.type == "cuda") for n in self.chunk_nbytes]
        self.chunk_of: dict[int, int] = {}
        with torch.no_grad():
            for spec in layout.chunks:
                for slot in spec.slots:
                    p = params[slot.param]
                    self.chunk_of[id(p)] = spec.index
                    view = self._view(self.host[spec.index], slot.offset, p)
                    view.copy_(p.detach())
                    p.data = view
        self.units = [
            Unit(name, tuple(sorted({self.chunk_of[id(p)] for p in ps})))
            for (name, _), ps in zip(self.unit_modules, self.unit_params)
        ]
        self._uses: list[list[int]] = [[] for _ in self.specs]  # trace positions using each chunk
        for i, u in enumerate(self.trace):
            for c in self.units[u].chunks:
                self._uses[c].append(i)

    @staticmethod
    def _view(buffer: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
        n = p.numel() * p.element_size()
        return buffer[offset : offset + n].view(p.dtype).view(p.shape)

    def _point(self, chunk: int, buffer: torch.Tensor) -> None:
        for slot in self.specs[chunk].slots:
            p = self.params[slot.param]
            p.data = self._view(buffer, slot.offset, p)

    def _plan(self) -> OffloadPlan:
        if self.warming_up:
            return plan_offload(self.chunk_nbytes, self.units, self.budget, together=self.groups)
        return plan_offload(
            self.chunk_nbytes, self.units, self.budget,
            trace=self.trace, activation=self.unit_activation, prefetch=self.prefetch, together=self.groups,
            activation_peak=self.traced_activation_peak,
        )

    def set_groups(self, groups: list[tuple[int, ...]]) -> None:
        """Units recomputed together in backward: re-plan so that each set fits the slots at once."""
        if groups == self.groups:
            return
        self.groups = groups
        self._unapply()
        self._apply(self._plan())

    def _apply(self, plan: OffloadPlan) -> None:
        """Allocate the plan's device memory once: resident chunks (filled now) and the slots."""
        self.resident: dict[int, torch.Tensor] = {}
        for c in sorted(plan.resident):
            buffer = torch.empty(self.chunk_nbytes[c], dtype=torch.uint8, device=self.device)
            buffer.copy_(self.host[c])
            self.h2d_bytes += self.chunk_nbytes[c]
            self.resident[c] = buffer
            self._point(c, buffer)
        self.slots = [torch.empty(plan.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(plan.slots)]
        self._slot_by_ptr = {s.data_ptr(): i for i, s in enumerate(self.slots)}
        self._stable_ptrs = {b.data_ptr() for b in self.resident.values()} | {h.data_ptr() for h in self.host}
        self.holder: list[int | None] = [None] * plan.slots  # chunk in each slot
        self.slot_of: dict[int, int] = {}  # chunk -> slot
        self.pins: dict[int, int] = {}  # chunk -> pin count (pinned: a kernel may still read it)
        self._backward_pins: list[int] = []
        self._recompute_pins: list[int] = []
        self._recompute_units: set[int] = set()
        self._forward_pos = 0
        self._backward_pos: int | None = None
        self.plan = plan

    def _unapply(self) -> None:
        """Every parameter back on its host chunk (resident chunks copied back first)."""
        # A step still running writes into whatever the parameters point at: let it finish first.
        for optimizer in self.optimizers:
            optimizer.wait()
        self.release_all()
        with torch.no_grad():
            for c, buffer in self.resident.items():
                self.host[c].copy_(buffer)
                self.d2h_bytes += self.chunk_nbytes[c]
                self._point(c, self.host[c])
        self.resident = {}

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
        slot = self.slot_of.pop(chunk)
        self.holder[slot] = None
        self._point(chunk, self.host[chunk])

    def _fetch(self, chunk: int, pin: bool, distance: float | None = None) -> None:
        if chunk in self.resident:
            return
        if chunk not in self.slot_of:
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
            # A chunk can hold parameters of several units: wait for the optimizer's step of every
            # one of them before its host memory is copied.
            params = [self.params[s.param] for s in self.specs[chunk].slots]
            for optimizer in self.optimizers:
                optimizer.wait_for(params)
            buffer = self.slots[slot][: self.chunk_nbytes[chunk]]
            with torch.no_grad():
                buffer.copy_(self.host[chunk], non_blocking=True)
            self.h2d_bytes += self.chunk_nbytes[chunk]
            self.holder[slot] = chunk
            self.slot_of[chunk] = slot
            self._point(chunk, buffer)
        if pin:
            self.pins[chunk] = self.pins.get(chunk, 0) + 1

    def _unpin(self, chunk: int) -> None:
        if self.pins.get(chunk):
            self.pins[chunk] -= 1

    def _fetch_unit(self, u: int, pin: bool, distance: float | None = None) -> None:
        for c in self.units[u].chunks:
            self._fetch(c, pin, distance)

    def release_all(self) -> None:
        """Every slot free, every pin dropped (nothing runs on the device)."""
        for chunk in list(self.slot_of):
            self._evict(chunk)
        self.pins.clear()
        self._backward_pins = []
        self._recompute_pins = []
        self._recompute_units = set()
        self._backward_pos = None
        self._forward_pos = 0

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
        # The gradient leaves the device for the host step (ChunkedAdamW's gradient buffer).
        if self.chunk_of.get(id(p)) not in self.resident and p.grad is not None:
            self.d2h_bytes += p.grad.numel() * p.grad.element_size()

    # -- saved tensors ------------------------------------------------------------------------

    def pack_saved(self, t: torch.Tensor) -> Any:
        chunk = self.chunk_of.get(id(t))
        if chunk is not None:
            return ("param", t)
        if t.device == self.device and t.numel() > 0:
            ptr = t.untyped_storage().data_ptr()
            if ptr in self._stable_ptrs:
                return t  # a resident or host chunk: it does not move while the graph waits
            slot = self._slot_by_ptr.get(ptr)
            if slot is not None and self.holder[slot] is not None:
                return ("view", self.holder[slot], t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        return _Activations(t, self)

    def unpack_saved(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Activations):
            return packed.tensor
        kind = packed[0]
        chunk = self.chunk_of[id(packed[1])] if kind == "param" else packed[1]
        self._fetch(chunk, pin=True)
        self._backward_pins.append(chunk)
        if kind == "param":
            return packed[1]
        _, _, dtype, shape, stride, offset = packed
        base = self.slots[self.slot_of[chunk]] if chunk in self.slot_of else self.resident[chunk]
        return torch.as_strided(base.view(dtype), shape, stride, offset)

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
        self.release_all()
        if not self.warming_up or not self.trace:
            return
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
        for handle in self._handles:
            handle.remove()

    def stats(self) -> dict[str, int]:
        return {
            "device_memory_budget": self.budget,
            "peak_device_bytes": self.peak_device_bytes,
            "resident_chunks": len(self.plan.resident),
            "streamed_chunks": len(self.specs) - len(self.plan.resident),
            "slots": self.plan.slots,
            "slot_bytes": self.plan.slot_bytes,
            "resident_bytes": self.plan.resident_bytes,
            "activation_bytes": self.plan.activation_bytes,
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
        }


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _unique(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return list({id(p): p for p in params}.values())


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []


class ChunkedOffloadStrategy(SingleDeviceStrategy):
    """One device whose memory holds only part of the parameters: the rest live in host chunks and
    are streamed through a fixed pool of device slots, fetched ahead of use, planned from one
    traced warm-up step. Pair it with :class:`lightning_ckpt.ChunkedAdamW` for the optimizer state.

    Args:
        device_memory_budget: bytes the strategy may use on the device for parameters, slots and
            activations (``"16GB"``, an int), or ``"auto"``: 90% of the device's free memory (on
            the CPU, of the available host memory).
        chunk_size: bytes per parameter chunk (``"64MiB"``, an int); a larger parameter gets a
            chunk of its own.
        prefetch: units fetched ahead of the running one (in the traced order; in reverse during
            backward).
        unit_types: module types (or their import paths as strings) whose instances are fetched
            as one unit; ``None``: every module holding parameters of its own.
        device, accelerator, checkpoint_io, precision_plugin: as for ``SingleDeviceStrategy``.
    """

    strategy_name = "chunked_offload"

    def __init__(
        self,
        device_memory_budget: Union[int, str] = "auto",
        chunk_size: Union[int, str] = "64MiB",
        prefetch: int = 2,
        unit_types: Optional[list[Union[type[torch.nn.Module], str]]] = None,
        device: Union[str, torch.device] = "cpu",
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(device=device, accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if device_memory_budget != "auto":
            parse_size(device_memory_budget, "device_memory_budget")
        self.device_memory_budget = device_memory_budget
        self.chunk_size = parse_size(chunk_size, "chunk_size")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"`prefetch={prefetch!r}` must be a non-negative int (units fetched ahead; 0: none).")
        self.prefetch = prefetch
        self._unit_match: Optional[Callable[[torch.nn.Module], bool]] = (
            module_matcher(list(unit_types), "unit_types") if unit_types is not None else None
        )
        self._streamer: Optional[_Streamer] = None
        self._last_stats: dict[str, int] = {}

    def _budget(self) -> int:
        if self.device_memory_budget != "auto":
            return parse_size(self.device_memory_budget, "device_memory_budget")
        if self.root_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.root_device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(free * _AUTO_MARGIN)

    def _units(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        units: list[tuple[str, torch.nn.Module]] = []
        inside: set[int] = set()
        for name, module in model.named_modules():
            if id(module) in inside:
                continue
            if self._unit_match is None:
                if any(p is not None for p in module._parameters.values()):
                    units.append((name or "<root>", module))
            elif self._unit_match(module):
                units.append((name, module))
                inside.update(id(m) for m in module.modules())  # the outermost match is the unit
        return units

    @override
    def model_to_device(self) -> None:
        """Never moves the model whole: parameters go to host chunks, the plan's share to the device."""
        assert self.model is not None
        if self.root_device.type != "cpu":
            raise NotImplementedError(
                f"ChunkedOffloadStrategy runs on the CPU only for now (got device {self.root_device}): the device"
                " streaming path (side stream, events, ChunkedAdamW writing into host chunks) is not built yet."
                " Use `device='cpu'`, or ChunkedAdamW alone under the default strategy on a GPU."
            )
        if self._streamer is not None:
            return
        model = self.model
        units = self._units(model)
        if not units:
            raise ValueError(
                "ChunkedOffloadStrategy: no module of the model matches `unit_types`; name the module types"
                " (e.g. the transformer block) whose parameters are fetched together."
            )
        # Buffers are small and read anywhere: they go to the device as they are.
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(self.root_device)
        order = _unique(p for _, m in units for p in m.parameters())
        params = _unique([*order, *model.parameters()])
        self._streamer = _Streamer(units, params, self.chunk_size, self._budget(), self.prefetch, self.root_device)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if self._streamer is not None:
            self._streamer.optimizers = [o for o in self.optimizers if isinstance(o, ChunkedAdamW)]

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._streamer is None:
            return
        # ActivationCheckpointing applies at on_fit_start: its blocks are known from here on.
        index = {id(m): u for u, (_, m) in enumerate(self._streamer.unit_modules)}
        groups = []
        for module in self.model.modules():
            if installed_checkpointing(module) is not None:
                inside = tuple(sorted({index[id(m)] for m in module.modules() if id(m) in index}))
                if inside:
                    groups.append(inside)
        self._streamer.set_groups(groups)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._saved_tensor_hooks():
            return super().training_step(*args, **kwargs)

    @contextmanager
    def _saved_tensor_hooks(self) -> Any:
        if self._streamer is None:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._streamer.pack_saved, self._streamer.unpack_saved):
            yield

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._streamer is not None:
            self._streamer.end_backward()

    def memory_stats(self) -> dict[str, int]:
        """Device accounting: ``device_memory_budget``, ``peak_device_bytes``, ``resident_chunks``,
        ``streamed_chunks``, ``slots``, ``slot_bytes``, ``resident_bytes``, ``activation_bytes``,
        ``h2d_bytes``, ``d2h_bytes`` (totals since setup; after teardown, those of the last run)."""
        if self._streamer is None:
            return dict(self._last_stats)
        return self._streamer.stats()

    @override
    def teardown(self) -> None:
        if self._streamer is not None:
            self._last_stats = self._streamer.stats()
            self._streamer.close()
            self._streamer = None
        super().teardown()


__all__ = ["ChunkedOffloadStrategy", "OffloadBudgetError"]
