"""``ChunkedAdamW``: AdamW whose state lives in chunked host memory and is stepped by a CPU worker.

Call order, per training step (the main thread unless said otherwise):

1. forward: a module's forward pre-hook waits for the chunks holding its own parameters (only
   those still being stepped); backward: each parameter's post-accumulate-grad hook moves a fresh
   gradient into its view of the chunk's flat gradient buffer (gradients accumulated into an
   existing view need nothing).
2. ``step()``: runs the closure, waits for the previous step, moves any gradient that is not a
   view yet, snapshots each group's hyper-parameters (the ``lr`` as it is now, so schedulers work)
   and queues every chunk holding a gradient for the worker thread.
3. worker thread, chunk by chunk in layout order: gradient chunk to the host (CUDA: a copy on a
   side stream; CPU: the buffer already is host memory and is used in place, or upcast into one
   host fp32 buffer when the parameters are not fp32), torch's fused CPU AdamW kernel on the
   chunk's per-parameter views, the master weights written back into the parameters (CUDA: on
   another stream, an event recorded after), then the chunk is marked done.
4. The next forward waits per chunk (1.); ``zero_grad``, ``state_dict``, ``load_state_dict`` and
   ``step`` wait for every chunk. Parameters never seen in a module's forward before the first
   ``step()`` are stepped before ``step()`` returns.

A failure in the worker is raised at the next wait (the next forward or ``step()``) and stays: the
state is no longer consistent (earlier chunks of that step were applied).

Under ``ChunkedOffloadStrategy`` (CUDA or CPU) the parameters are views of the strategy's host
chunks whenever the optimizer sees them (at construction and from the end of each backward), so
this optimizer runs its CPU path: gradients arrive as host tensors (the strategy copied them out
of the device), and the strategy fetches a chunk to the device only after ``wait_for`` its
parameters. The strategy registers its host chunks (:mod:`lightning_ckpt.offload.inplace`): a
chunk whose parameters are all fp32 views of them has no master weights here (8 bytes per
parameter, not 12); the kernel steps the parameters where they are at each ``step()`` (the
warm-up re-lays the host chunks out) and the write-back is a version bump. bf16/fp16 parameters
keep their fp32 master. A parameter that views a larger buffer is never moved into the arena.
"""

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_ckpt.format.plan import parse_size
from lightning_ckpt.offload.chunks import (
    MASTER_DTYPE,
    HostArena,
    assign_owners,
    plan_chunks,
    restrict,
)
from lightning_ckpt.offload.inplace import steps_in_place
from lightning_ckpt.offload.shares import owner_meshes, placed, shares_wanted
from lightning_ckpt.offload.stepper import (
    Chunk,
    Job,
    Stepper,
    Worker,
    local_of,
    slot_views,
    stamp,
)

# Flags of torch.optim.AdamW this optimizer does not implement; the value it has instead.
_UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
# Keys torch.optim.AdamW keeps in every group (so a state dict loads into it as is). ``fused=True``
# names the implementation whose arithmetic this one reproduces: AdamW resumed from our state
# dict continues with it, bit for bit on the CPU.
_FIXED = {**_UNSUPPORTED, "foreach": None, "fused": True, "decoupled_weight_decay": True}


class ChunkedAdamWError(RuntimeError):
    """The worker thread failed to step a chunk; the optimizer cannot continue."""


def _reject_unsupported(options: dict[str, Any], where: str) -> None:
    for name, value in _UNSUPPORTED.items():
        if options.get(name, value) != value:
            raise ValueError(
                f"ChunkedAdamW does not support `{name}={options[name]!r}`{where}: it implements AdamW"
                f" with {name}={value}. Remove the argument, or use torch.optim.AdamW."
            )


class ChunkedAdamW(Optimizer):
    """AdamW with fp32 master weights and both moments in chunked host memory, stepped by torch's
    fused CPU AdamW kernel in a worker thread while the next forward runs.

    With fp32 parameters the trained weights equal ``torch.optim.AdamW(fused=True)`` on the CPU bit
    for bit; the state dict has torch's AdamW format (both ways). Parameters of other dtypes
    (bf16, fp16) keep an fp32 master copy and moments; their gradients are upcast per chunk.

    Under FSDP2 (``fully_shard``; Lightning's ``ModelParallelStrategy``) each rank steps its own
    shards with no collective. That runs on CPUs too: ``Trainer(accelerator="cpu", devices=2,
    strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))`` uses gloo by
    itself (docs/offload.md, "Several GPUs: FSDP2 shards").

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``. Parameters that do not
            require grad at construction are kept in the groups but get no chunk memory.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW`` (per group too).
        chunk_size: bytes of fp32 master weights per chunk (``"64MiB"`` or an int); a parameter
            larger than that gets a chunk of its own.
        overlap: step chunks in the background while the next forward runs (each module's forward
            waits for the chunks of its own parameters). ``False``: ``step()`` returns after the
            last chunk is written back.
        shard_across_ranks: when ``torch.distributed`` is initialized with several ranks (DDP), each
            rank holds and steps only its share of the chunks and the owners broadcast the updated
            values. Gradients must already be averaged across ranks, as DDP does. ``False``: every
            rank holds and steps everything.
        exchange: how the owners send updated values in that sharded mode. ``"host"``: from the
            host arena over a gloo group of the optimizer's own (4 bytes per parameter per step
            through host memory and TCP). ``"device"``: parameters on CUDA with an NCCL process
            group: from the owner's device buffer over an NCCL communicator of the optimizer's own,
            straight into the others' device memory (not yet run on GPUs; a worker failure on one
            rank then stalls the others until NCCL's timeout). ``"auto"`` (default): ``"host"``
            for now. ``exchange_backend`` tells which one runs.
        amsgrad, maximize, foreach, capturable, differentiable, fused: accepted for drop-in use of
            AdamW's arguments; anything but AdamW's defaults (``foreach``/``fused``: any value) is
            refused.
    """

    # Its worker bumps the version counters of the parameters and state it writes (and compares a
    # parameter's to tell one set from outside): incremental saves' post-step hook leaves it alone.
    bumps_parameter_versions = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        chunk_size: int | str = "64MiB",
        overlap: bool = True,
        shard_across_ranks: bool = True,
        exchange: str = "auto",
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        _reject_unsupported(
            {"amsgrad": amsgrad, "maximize": maximize, "capturable": capturable, "differentiable": differentiable},
            "",
        )
        if isinstance(lr, torch.Tensor) or not 0.0 <= lr:
            raise ValueError(f"`lr={lr!r}` must be a non-negative float.")
        if not 0.0 <= eps:
            raise ValueError(f"`eps={eps!r}` must be non-negative.")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"`betas={betas!r}` must be two floats in [0, 1).")
        if not 0.0 <= weight_decay:
            raise ValueError(f"`weight_decay={weight_decay!r}` must be non-negative.")
        if exchange not in ("auto", "host", "device"):
            raise ValueError(f'`exchange={exchange!r}` must be "auto", "host" or "device".')
        chunk_bytes = parse_size(chunk_size, "chunk_size")
        if chunk_bytes < 4:
            raise ValueError(f"`chunk_size={chunk_size!r}` must hold at least one fp32 element (4 bytes).")
        self._built = False
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, **_FIXED}
        super().__init__(params, defaults)
        self._overlap = overlap
        self._build(chunk_bytes // 4, shard_across_ranks, exchange)
        self._built = True

    # -- state seen from outside -------------------------------------------------------------

    @property  # type: ignore[override]
    def state(self) -> defaultdict[torch.Tensor, dict[str, Any]]:
        """Per-parameter state, as torch's ``Optimizer.state``; read from outside, after every
        queued step is applied. Lightning's teardown reads it (``_optimizers_to_device``) right
        before it moves the module to the CPU: a step still writing its parameters back then would
        be lost, or land in device memory already freed. The optimizer's own code reads
        ``_state`` (the same dict) and waits where it must."""
        if "_worker" in self.__dict__:
            # A failed step is raised by the next step() or wait(), not here: teardown after that
            # failure reads this too, and must not replace the error being handled.
            self._wait(self._chunks, raise_failure=False)
        return self._state

    @state.setter
    def state(self, value: defaultdict[torch.Tensor, dict[str, Any]]) -> None:
        self._state = value

    # -- construction -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise ValueError(
                "ChunkedAdamW lays its chunks out at construction: `add_param_group` afterwards is not"
                " supported. Pass every param group to the constructor."
            )
        _reject_unsupported(param_group, " in a param group")
        for p in param_group["params"] if not isinstance(param_group["params"], torch.Tensor) else [param_group["params"]]:
            if isinstance(p, torch.Tensor) and (p.is_sparse or p.layout != torch.strided):
                raise ValueError(
                    f"ChunkedAdamW needs dense (strided) parameters; got a {p.layout} parameter in `params`."
                    " Use torch.optim.SparseAdam for sparse parameters."
                )
            if isinstance(p, torch.Tensor) and not p.is_floating_point():
                raise ValueError(f"ChunkedAdamW steps floating-point parameters; got {p.dtype} in `params`.")
        super().add_param_group(param_group)
        for key, value in _FIXED.items():  # what AdamW's groups hold, whatever was passed
            self.param_groups[-1][key] = value
        self.param_groups[-1]["betas"] = tuple(self.param_groups[-1]["betas"])

    def _build(self, chunk_numel: int, shard: bool, exchange: str) -> None:
        packed: list[tuple[int, torch.Tensor]] = []
        devices = set()
        seen: set[torch.Tensor] = set()  # a parameter listed twice (tied) is packed and stepped once
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.requires_grad and p not in seen:
                    seen.add(p)
                    packed.append((g, p))
                    devices.add(local_of(p).device)
        _reject_flat_parameters([p for _, p in packed])
        sharded = [isinstance(p, DTensor) for _, p in packed]
        # FSDP2: each rank packs and steps its local shards alone; FSDP2 reduce-scatters the
        # gradients and all-gathers the updated shards, so the optimizer runs no collective.
        self._fsdp = any(sharded)
        if self._fsdp and not all(sharded):
            raise ValueError(
                "ChunkedAdamW got FSDP2-sharded parameters (DTensors) and plain ones together: shard the"
                " whole model (`fully_shard` on the root module too), or build one optimizer per kind."
            )
        if len(devices) > 1:
            raise ValueError(
                f"ChunkedAdamW needs every parameter on one device; `params` spans {sorted(map(str, devices))}."
                " Move the model to one device before building the optimizer."
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        layout = plan_chunks([(g, local_of(p).numel(), p.dtype) for g, p in packed], chunk_numel)
        dist = torch.distributed
        self._group = None  # sharded mode: gloo, for the moments state_dict() gathers (and the "host" exchange)
        device_group = None  # sharded mode, "device" exchange: NCCL, for the updated values
        owners = (0,) * len(layout.chunks)
        rank = 0
        sharded = shard and not self._fsdp and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        on_device = _device_exchange(self.device, exchange, sharded)
        if sharded:
            # Collective: every rank builds its optimizer (configure_optimizers runs on each), and
            # decides alike (same device type, same backend).
            self._group = dist.new_group(backend="gloo")
            if on_device:
                device_group = dist.new_group(backend="nccl")
            rank = dist.get_rank()
            owners = assign_owners(layout, dist.get_world_size())
            self._meshes = owner_meshes(dist.get_world_size())  # for saves where every rank writes
            layout = restrict(layout, {i for i, owner in enumerate(owners) if owner == rank})
        else:
            # Chunks whose parameters are all fp32 memory an owner lets us step in place get no
            # master weights. A chunk mixing them with others keeps its master whole: its master
            # region is allocated anyway, and the others still need their write-back.
            in_place = frozenset(
                spec.index for spec in layout.chunks
                if spec.dtype == MASTER_DTYPE and all(_in_place(packed[s.param][1]) for s in spec.slots)
            )
            layout = restrict(layout, {spec.index for spec in layout.chunks}, in_place)
        self.layout = layout
        self._arena = HostArena(layout, pin=self.device.type == "cuda")
        self._chunks: list[Chunk] = []
        self._where: dict[torch.Tensor, tuple[Chunk, int]] = {}  # parameter -> (chunk, position)
        aliased: list[weakref.ref[torch.Tensor]] = []  # parameters living in the arena
        for spec in layout.chunks:
            params = [packed[s.param][1] for s in spec.slots]
            owned = owners[spec.index] == rank
            empty = torch.empty(0, dtype=MASTER_DTYPE)
            master_flat, avg, avg_sq = self._arena.tensors(spec) if owned else (empty, empty, empty)
            shapes = [local_of(p) for p in params]
            master, exp_avg, exp_avg_sq = (slot_views(spec, shapes, t) for t in (master_flat, avg, avg_sq))
            chunk = Chunk(
                spec=spec,
                params=params,
                grad_buffer=None,
                grads=[],
                master_flat=master_flat,
                master=master,
                exp_avg=exp_avg,
                exp_avg_sq=exp_avg_sq,
                versions=[None] * len(params),
                owner=owners[spec.index],
                owned=owned,
                device=self.device,
            )
            self._chunks.append(chunk)
            for i, p in enumerate(params):
                self._where[p] = (chunk, i)
                if self._fsdp:
                    continue  # gradients are read where FSDP2 leaves them, its memory never moved
                p.register_post_accumulate_grad_hook(GradMover(weakref.ref(self)))
                if owned and spec.master and self._group is None and _may_alias(p):
                    self._arena.writable(spec)
                    with torch.no_grad():
                        chunk.master[i].copy_(p)
                    p.data = self._arena.own_storage(chunk.master[i])  # its master weights: no write-back
                    aliased.append(weakref.ref(p))
        largest = max((s.numel for s in layout.chunks), default=0)
        self._stepper = Stepper(self._arena, largest, self.device, self._group, device_group)
        self._worker = Worker(self._stepper)
        weakref.finalize(self, _shutdown, self._worker, self._stepper, self._arena, aliased)
        self._hooked: set[int] = set()  # ids of modules given wait hooks
        self._awaited: set[torch.Tensor] = set()  # parameters a hooked module's forward waits for
        self._discovery = (
            torch.nn.modules.module.register_module_forward_pre_hook(Discover(weakref.ref(self)))
            if self._overlap
            else None
        )

    # -- waiting --------------------------------------------------------------------------------

    def _raise_failure(self) -> None:
        if self._worker.error is None:
            return
        job, exc = self._worker.error
        spec = job.chunk.spec
        raise ChunkedAdamWError(
            f"ChunkedAdamW: stepping chunk {spec.index} (param group {spec.group}, {spec.dtype},"
            f" {len(spec.slots)} parameters) failed in the worker thread: {type(exc).__name__}: {exc}."
            " Parameters and optimizer state are now inconsistent (earlier chunks of that step were"
            " applied, later ones not): restore the model and optimizer from a checkpoint."
        ) from exc

    def _wait(self, chunks: Iterable[Chunk], raise_failure: bool = True) -> None:
        for chunk in chunks:
            chunk.done.wait()
            if chunk.cuda_done is not None:
                torch.cuda.current_stream(self.device).wait_event(chunk.cuda_done)
        if raise_failure:
            self._raise_failure()

    def wait(self) -> None:
        """Block until every queued chunk is stepped and written back (raises a worker failure)."""
        self._wait(self._chunks)

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        """Block until the chunks holding ``params`` are stepped and written back."""
        found = {id(entry[0]): entry[0] for p in params if (entry := self._where.get(p)) is not None}
        self._wait(found.values())

    def _adopt(self, module: torch.nn.Module) -> None:
        """First forward of a module holding packed parameters: its forward and its state_dict
        wait for their chunks from now on, and those chunks may be stepped in the background."""
        if id(module) in self._hooked:
            return
        params = [p for p in _unit_parameters(module) if p in self._where]
        chunks = list({id(self._where[p][0]): self._where[p][0] for p in params}.values())
        if not chunks:
            return
        self._hooked.add(id(module))
        self._awaited.update(params)  # each is in one of ``chunks``
        waiter = ChunkWaiter(weakref.ref(self), chunks)
        # First among the module's pre-hooks: FSDP2's all-gathers the unit's shards in its own.
        module.register_forward_pre_hook(waiter, prepend=True)
        module.register_state_dict_pre_hook(waiter)

    # -- the step -------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Queue every chunk with a gradient for the worker; see the module docstring."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait()
        if self._discovery is not None:  # the first forward is over: every module seen is known
            self._discovery.remove()
            self._discovery = None
            for chunk in self._chunks:
                chunk.synchronous = not all(p in self._awaited for p in chunk.params)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p not in self._where:
                    raise ValueError(
                        "ChunkedAdamW: a parameter that did not require grad when the optimizer was built"
                        f" (shape {tuple(p.shape)}) now has a gradient. Build the optimizer after freezing"
                        " or unfreezing parameters."
                    )
        jobs, waits = [], []
        for chunk in self._chunks:
            members, grads = [], []
            for i, p in enumerate(chunk.params):
                if p.grad is None:
                    continue
                if p.grad.layout != torch.strided:
                    raise ValueError(
                        "ChunkedAdamW does not support sparse gradients (e.g. `nn.Embedding(sparse=True)`):"
                        " build the module with `sparse=False`, or use torch.optim.SparseAdam for it."
                    )
                if not self._reads_in_place(p) and not self._fsdp:
                    self._into_view(chunk, i)
                grads.append(local_of(p.grad))
                local = chunk.local(i)
                if chunk.owned and chunk.versions[i] != stamp(local) and not chunk.aliased(i):  # set from outside
                    self._arena.writable(chunk.spec)
                    chunk.master[i].copy_(local.detach())
                    chunk.versions[i] = stamp(local)
                members.append(i)
            if not members:
                continue
            group = self.param_groups[chunk.spec.group]
            steps = [self._state_of(chunk, i)["step"] for i in members]
            lr = group["lr"]
            job = Job(
                chunk=chunk,
                members=members,
                steps=steps,
                lr=float(lr),
                beta1=float(group["betas"][0]),
                beta2=float(group["betas"][1]),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                grads=grads,
                grads_in_buffer=not self._fsdp,
                masters=chunk.masters_of(members),
            )
            jobs.append(job)
            if chunk.synchronous or not self._overlap:
                waits.append(chunk)
        # Invariant: a step() that raises has queued nothing (a retry would step chunks twice), so
        # jobs are queued after the loop. On CUDA they share one event, recorded after the loop: the
        # copies into gradient views above (``_into_view``) are on this stream too, and the
        # worker's D2H copy waits for this event alone.
        grads_ready = None
        if jobs and self.device.type == "cuda":
            grads_ready = torch.cuda.Event()
            grads_ready.record(torch.cuda.current_stream(self.device))
        for job in jobs:
            job.grads_ready = grads_ready
            job.chunk.done.clear()
            self._worker.jobs.put(job)
        self._wait(waits)
        return loss

    def _state_of(self, chunk: Chunk, i: int) -> dict[str, Any]:
        p = chunk.params[i]
        state = self._state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if chunk.owned:  # sharded mode: other ranks keep the step count only
                state["exp_avg"] = chunk.exp_avg[i]
                state["exp_avg_sq"] = chunk.exp_avg_sq[i]
            return state
        # Invariant: the state's moments are the arena's views and ``step`` is the CPU tensor the
        # kernel counts in. Lightning moves optimizer state to the device after a load
        # (``_optimizer_to_device``); those copies are frozen at the move, so point back at the
        # arena, which is the truth, and bring ``step`` home (its value is the same).
        if state["step"].device.type != "cpu":
            state["step"] = state["step"].to("cpu", torch.float32)
        if chunk.owned and state.get("exp_avg") is not chunk.exp_avg[i]:
            state["exp_avg"], state["exp_avg_sq"] = chunk.exp_avg[i], chunk.exp_avg_sq[i]
        return state

    def _reads_in_place(self, p: torch.Tensor) -> bool:
        """Can the worker read ``p.grad`` where it is? On the CPU, a dense gradient of the
        parameter's shape and dtype (``ChunkedOffloadStrategy``'s host gradient buffers): no copy
        into the chunk's buffer, which is then never allocated."""
        if p.grad is None:
            return False
        p, grad = local_of(p), local_of(p.grad)
        return (
            self.device.type == "cpu" and grad.device.type == "cpu" and grad.layout == torch.strided
            and grad.dtype == p.dtype and grad.shape == p.shape and grad.is_contiguous()
        )

    def _into_view(self, chunk: Chunk, i: int) -> None:
        """Make parameter ``i``'s gradient its view of the chunk's buffer (copying it there)."""
        p, view = chunk.params[i], chunk.grad_views()[i]
        grad = p.grad
        if grad is None or grad.data_ptr() == view.data_ptr():
            return
        view.copy_(grad)
        p.grad = view

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. ``set_to_none=False`` keeps the gradients as views
        of the chunk buffers (zeroed in one fill per chunk): the next backward accumulates into them
        directly; with ``True`` (torch's default) each fresh gradient is copied into its view.
        Waits for every chunk: parameters read right after ``step(); zero_grad()`` are the
        updated ones. Call it after the next forward, as Lightning does (forward, ``zero_grad``,
        backward, ``step``), for the step to overlap that forward."""
        self.wait()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                elif p in self._where and self._in_view(p):
                    continue  # zeroed below with its whole buffer
                else:
                    p.grad.detach_().requires_grad_(False)
                    p.grad.zero_()
        if not set_to_none:
            for chunk in self._chunks:
                if chunk.grad_buffer is not None:
                    chunk.grad_buffer.zero_()

    def _in_view(self, p: torch.Tensor) -> bool:
        chunk, i = self._where[p]
        return bool(chunk.grads) and p.grad is not None and p.grad.data_ptr() == chunk.grads[i].data_ptr()

    # -- state dict -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's AdamW format: per parameter ``step``, ``exp_avg``, ``exp_avg_sq`` (the params'
        shapes, fp32, viewing the host arena: copy them to keep a snapshot across steps).

        Sharded mode: a collective (every rank calls it, as Lightning's checkpointing does); the
        owners broadcast their chunks' moments, so every rank returns the whole state. Inside
        :func:`lightning_ckpt.offload.shares.own_shares` (a save every rank writes a part of) no
        collective: each moment is a ``DTensor`` held by its owner alone, viewing its arena.
        """
        self.wait()
        for chunk in self._chunks:  # state moved off the arena from outside is pointed back first
            for i, p in enumerate(chunk.params):
                if "step" in self._state.get(p, {}):
                    self._state_of(chunk, i)
        packed = super().state_dict()
        if self._fsdp:
            # FSDP2: the moments as DTensors laid out as their parameters (what torch's AdamW holds
            # there, what DCP's state-dict helpers and savers expect), viewing the arena.
            index = _torch_indices(self.param_groups)
            for chunk in self._chunks:
                for p in chunk.params:
                    entry = packed["state"].get(index[id(p)])
                    for key in ("exp_avg", "exp_avg_sq") if entry is not None else ():
                        entry[key] = DTensor.from_local(
                            entry[key], p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
                        )
        if self._group is None:
            return packed
        index = _torch_indices(self.param_groups)
        shares = shares_wanted()
        for chunk in self._chunks:
            stateful = [i for i, p in enumerate(chunk.params) if "step" in self._state.get(p, {})]
            if not stateful:  # the same on every rank: step counts are kept everywhere
                continue
            # 0-d parameters' chunks are gathered (on every rank alike): one-rank DTensors are not tried there.
            if shares and all(chunk.params[i].dim() > 0 for i in stateful):
                for i in stateful:
                    p, entry = chunk.params[i], packed["state"][index[id(chunk.params[i])]]
                    for key, views in (("exp_avg", chunk.exp_avg), ("exp_avg_sq", chunk.exp_avg_sq)):
                        entry[key] = placed(views[i] if chunk.owned else None, p.shape, self._meshes[chunk.owner])
                continue
            n = chunk.spec.numel
            if chunk.owned:
                _, avg, avg_sq = self._arena.tensors(chunk.spec)
                both = torch.cat([avg, avg_sq])
            else:
                both = torch.empty(2 * n, dtype=MASTER_DTYPE)
            torch.distributed.broadcast(both, src=chunk.owner, group=self._group)
            for i in stateful:
                slot, p = chunk.spec.slots[i], chunk.params[i]
                entry = packed["state"][index[id(p)]]
                entry["exp_avg"] = both[slot.offset : slot.offset + slot.numel].view(p.shape)
                entry["exp_avg_sq"] = both[n + slot.offset : n + slot.offset + slot.numel].view(p.shape)
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim.AdamW`` (or ``ChunkedAdamW``) state dict: hyper-parameters per group,
        state copied into the arena (cast to fp32)."""
        self.wait()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)
        ):
            raise ValueError(
                "loaded state dict has "
                f"{[len(g['params']) for g in groups]} parameters per group, this ChunkedAdamW has"
                f" {[len(g['params']) for g in self.param_groups]}: build it with the same param groups."
            )
        for saved in groups:
            _reject_unsupported(saved, " in the loaded state dict's param groups")
        index: dict[Any, torch.Tensor] = {}
        for saved, group in zip(groups, self.param_groups):
            index.update(zip(saved["params"], group["params"]))
            for key, value in saved.items():
                if key != "params" and key not in _FIXED:
                    group[key] = tuple(value) if key == "betas" else value
        self._state.clear()
        for key, saved_state in state_dict["state"].items():
            p = index[key]
            if p not in self._where:
                continue  # state of a parameter frozen here: nothing to step
            chunk, i = self._where[p]
            state = self._state_of(chunk, i)
            if chunk.owned:
                self._arena.writable(chunk.spec)
            state["step"].fill_(float(local_of(torch.as_tensor(saved_state["step"]))))
            if chunk.owned:
                state["exp_avg"].copy_(_local_value(saved_state["exp_avg"], p))
                state["exp_avg_sq"].copy_(_local_value(saved_state["exp_avg_sq"], p))

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise TypeError("ChunkedAdamW cannot be unpickled or deep-copied: save its state_dict() instead.")

    # -- introspection ------------------------------------------------------------------------

    @property
    def host_bytes(self) -> int:
        """Bytes of the host arena: fp32 master weights and both moments (12 bytes per parameter),
        the moments alone (8) for chunks whose parameters are their own master weights
        (``ChunkedOffloadStrategy``'s fp32 host chunks), each tensor padded to the staging alignment."""
        return self._arena.nbytes

    @property
    def pinned_bytes(self) -> int:
        return self._arena.pinned_bytes

    @property
    def exchange_backend(self) -> str | None:
        """How updated values reach the ranks that do not own a chunk: ``"gloo"`` (the host
        exchange), ``"nccl"`` (the device exchange), ``None`` (no exchange: one rank, FSDP2, or
        ``shard_across_ranks=False``)."""
        if self._stepper.device_group is not None:
            return "nccl"
        return "gloo" if self._group is not None else None


def _device_exchange(device: torch.device, exchange: str, sharded: bool) -> bool:
    """Does the sharded mode send updated values over NCCL (see ``exchange``)? Only when asked
    (``"auto"`` is the host exchange until the device one has run on GPUs). Refuses ``"device"``
    where it cannot apply, whether or not this run is sharded: the same arguments must not fail on
    another world size later. The same on every rank (device type, backend, torch build)."""
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    # ``init_process_group()`` without a backend reports "undefined"; its config names NCCL for CUDA
    nccl = initialized and "nccl" in f"{dist.get_backend()} {dist.get_backend_config()}".lower()
    possible = device.type == "cuda" and (nccl or not initialized) and dist.is_nccl_available()
    if exchange == "device" and not possible:
        backend = dist.get_backend_config() if initialized else "no process group"
        raise ValueError(
            f'ChunkedAdamW(exchange="device") sends updated values between CUDA devices over NCCL; the'
            f" parameters are on {device} ({backend}). Move the model to the GPU before building the"
            ' optimizer and train with the NCCL backend, or pass exchange="host" (or "auto").'
        )
    return sharded and exchange == "device" and possible and nccl


def _reject_flat_parameters(params: list[torch.Tensor]) -> None:
    """FSDP (1) flattens a unit's parameters into one ``FlatParameter``, which ranks hold in
    pieces that do not follow the parameters (with ``use_orig_params=True`` the parameters are
    views of it, empty on the ranks that hold none of them): nothing here can step those."""
    if any(getattr(p, "_is_flat_param", False) or getattr(p, "_fsdp_flattened", False) for p in params):
        raise ValueError(
            "ChunkedAdamW does not step FSDP (1) parameters (`FSDPStrategy`, `FullyShardedDataParallel`:"
            " flat parameters, or views of them with `use_orig_params=True`). Shard with FSDP2 instead:"
            " Lightning's `ModelParallelStrategy` with `fully_shard` in `configure_model` (or"
            " `torch.distributed.fsdp.fully_shard`), whose shards ChunkedAdamW steps on the host; or keep"
            " FSDPStrategy with torch.optim.AdamW."
        )


def _in_place(p: torch.Tensor) -> bool:
    """Can the kernel step ``p`` where it is, as its own master weights (no master copy)? fp32 host
    memory whose owner lets us: ``ChunkedOffloadStrategy``'s host chunks (registered in
    :mod:`lightning_ckpt.offload.inplace`), or an FSDP2 parameter's local shard in host memory
    (``CPUOffloadPolicy``, or the CPU standing in for the device), which FSDP2 all-gathers only
    from the unit's pre-forward, after the unit's forward waited for its chunks."""
    if isinstance(p, DTensor):
        local = local_of(p)
        return local.device.type == "cpu" and local.dtype == MASTER_DTYPE and local.is_contiguous()
    return steps_in_place(p)


def _unit_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters a module's forward reads first as one unit: an FSDP2 module's (all-gathered
    together in its pre-forward: those of its submodules, not those under a nested FSDP2
    module), else those it registers itself."""
    if not isinstance(module, FSDPModule):
        return [p for p in module._parameters.values() if p is not None]
    nested: list[str] = []
    found: list[torch.Tensor] = []
    for name, sub in module.named_modules():
        if any(name.startswith(prefix) for prefix in nested):
            continue
        if sub is not module and isinstance(sub, FSDPModule):
            nested.append(name + ".")
            continue
        found.extend(p for p in sub._parameters.values() if p is not None)
    return found


def _local_value(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A loaded state tensor of parameter ``p`` as ``p``'s local part: a DTensor's local shard (laid
    out as ``p``'s first, which is a collective where it differs), a whole tensor cut as ``p`` is
    (no communication), else ``value`` reshaped."""
    if isinstance(p, DTensor):
        if isinstance(value, DTensor):
            if value.device_mesh != p.device_mesh or tuple(value.placements) != tuple(p.placements):
                value = value.redistribute(p.device_mesh, p.placements)
            value = value.to_local()
        elif value.shape == p.shape and value.shape != local_of(p).shape:
            value = distribute_tensor(value.to(local_of(p).device), p.device_mesh, p.placements, src_data_rank=None).to_local()
    return value.reshape(local_of(p).shape)


def _may_alias(p: torch.Tensor) -> bool:
    """Can ``p`` become a view of its fp32 master weights in the arena? An fp32 parameter in host
    memory (the CPU standing in for the device) that is the whole of its own storage: one that
    views a larger buffer (``ChunkedOffloadStrategy``'s host chunks, a flat parameter) is managed
    by someone else and keeps its memory (the strategy's are stepped there, without a master)."""
    nbytes = p.numel() * p.element_size()
    return (
        p.device.type == "cpu"
        and p.dtype == MASTER_DTYPE
        and p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == nbytes
        and nbytes > 0
    )


def _torch_indices(groups: list[dict[str, Any]]) -> dict[int, int]:
    """id(parameter) -> its index in a state dict, numbered as ``torch.optim.Optimizer`` does."""
    index: dict[int, int] = {}
    start = 0
    for group in groups:
        for i, p in enumerate(group["params"], start):
            index.setdefault(id(p), i)
        start += len(group["params"])
    return index


def _shutdown(
    worker: Worker, stepper: Stepper, arena: HostArena, aliased: list[weakref.ref[torch.Tensor]]
) -> None:
    """The optimizer is gone: end the worker, let its last write-back copy finish reading the
    arena (CUDA), give the parameters that lived in the arena memory of their own (the arena is
    unmapped next), then release the arena (its file descriptor)."""
    worker.stop()
    worker.join()
    if stepper.last_write is not None:
        stepper.last_write.synchronize()
    for ref in aliased:
        p = ref()
        if p is not None and arena.holds(p):
            p.data = p.detach().clone()
    # Any thread may collect the optimizer: unregistering the page-locked arena on another
    # thread's current device (0 by default) would open a context there.
    with torch.cuda.device(stepper.device) if stepper.cuda else contextlib.nullcontext():
        arena.close()

# -- hooks: each holds the optimizer weakly, so a dropped optimizer is collected (and its worker
# ended) whatever modules outlive it. All run on the main thread, from autograd (``GradMover``) or
# a module call (the others).


class GradMover:
    """Post-accumulate-grad hook: a gradient autograd just created moves into its view at once, so
    clipping and scaling see the views and the fresh tensor is freed during backward."""

    def __init__(self, optimizer: weakref.ref[ChunkedAdamW]) -> None:
        self._optimizer = optimizer

    def __call__(self, p: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is None or p not in optimizer._where:
            return
        chunk, i = optimizer._where[p]
        grad = p.grad
        if grad is not None and grad.layout == torch.strided and grad.data_ptr() != chunk.grad_views()[i].data_ptr():
            chunk.done.wait()  # the buffer is not being read by a step still in flight
            with torch.no_grad():
                optimizer._into_view(chunk, i)


class Discover:
    """Global forward pre-hook until the first ``step()``: finds the modules holding our params."""

    def __init__(self, optimizer: weakref.ref[ChunkedAdamW]) -> None:
        self._optimizer = optimizer

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._adopt(module)


class ChunkWaiter:
    """Forward pre-hook and state_dict pre-hook of a module: waits for its parameters' chunks."""

    def __init__(self, optimizer: weakref.ref[ChunkedAdamW], chunks: list[Chunk]) -> None:
        self._optimizer = optimizer
        self._chunks = chunks

    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._wait(self._chunks)
