"""Models built on the meta device under ``ChunkedOffloadStrategy``: their tensors get memory where
they live (never a whole copy anywhere else) and are then initialized in place.

A meta parameter gets its place in a host chunk (``Streamer``'s packing: the chunk's bytes, zeroed,
swapped into the parameter object with :func:`materialize_parameter`, so every module holding it,
tied ones included, sees the same tensor); a meta buffer gets zeroed device memory
(:func:`materialize_buffers`). Then :func:`initialize` applies the rule of FSDP and Lightning's
``ModelParallelStrategy`` for meta-initialized models, with two additions:

1. Every module (in ``model.named_modules()`` order) holding a meta-born parameter or buffer of its
   own has its ``reset_parameters()`` called, where it has one, under ``torch.no_grad()`` and with
   the default random generator. torch.nn's layers initialize themselves with it when built, so a
   model built on meta gets the values of the same model built on the CPU from the same seed when
   its modules were built in registration order and nothing between the build and the setup
   draws random numbers.
2. A parameter shared by several modules (tied) keeps the values of the first module, in that
   order, that wrote it: a later module's ``reset_parameters()`` still runs (drawing the random
   numbers its construction on the CPU draws before the tie drops its own tensor), then the shared
   parameter's values are put back.
3. A meta-born tensor nothing wrote (its module has no ``reset_parameters()``, or it does not cover
   the tensor) is *pending*: something must write it before the first step, a checkpoint load
   (``ckpt_path``; the strategy restores after setup, into the host chunks) or the user's own code
   in a hook. :func:`check_written` (the strategy, before the first forward) raises naming each
   such tensor, its module and the module's type. Writes are seen through version counters, so a
   change through ``.data`` is not.

Nothing here imports Lightning. Runs on the main thread, at setup and before the first step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Pending:
    """A meta-born tensor nothing has written yet."""

    name: str  # its name in the model (``layers.0.weight``)
    module_type: str
    reason: str  # why ``reset_parameters`` did not write it
    tensor: torch.Tensor
    version: int  # its version counter when materialized


def meta_parameters(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter of ``model`` on the meta device (ids survive materialization)."""
    return {id(p) for p in model.parameters() if p.is_meta}


def materialize_parameter(p: torch.nn.Parameter, memory: torch.Tensor) -> None:
    """Make meta parameter ``p`` a zeroed view of ``memory`` (its shape and dtype), in place: the
    Python object stays, so modules sharing it and hooks on it keep it."""
    memory.zero_()
    new = torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=memory.device), requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)  # swap_tensors swaps the attribute dicts too: keep p's
    try:
        torch.utils.swap_tensors(p, new)
    except RuntimeError as exc:  # e.g. something holds a weak reference to the parameter
        raise RuntimeError(
            f"ChunkedOffloadStrategy: a meta parameter of shape {tuple(p.shape)} could not be given its memory in"
            f" place ({exc}). Do not hold references into the model before `trainer.fit`, or build the model on the"
            " CPU (`trainer.init_module()` without `empty_init=True`)."
        ) from exc
    # ``.data =`` keeps p's own version counter (a view would share the whole chunk's): the writes
    # that initialize p are told apart from writes to its neighbours.
    p.data = memory


def materialize_buffers(model: torch.nn.Module, device: torch.device) -> set[int]:
    """Every buffer of ``model`` to ``device`` (meta ones as zeros); a buffer shared by several
    modules stays shared. Returns the ``id`` of each buffer materialized from meta."""
    moved: dict[int, torch.Tensor] = {}
    born: set[int] = set()
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is None:
                continue
            if id(buffer) not in moved:
                if buffer.is_meta:
                    moved[id(buffer)] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
                    born.add(id(moved[id(buffer)]))
                else:
                    moved[id(buffer)] = buffer.to(device)
            module._buffers[key] = moved[id(buffer)]
    return born


def initialize(model: torch.nn.Module, born: set[int]) -> list[Pending]:
    """Initialize the materialized tensors ``born`` (ids) of ``model`` by the rule of the module
    docstring; returns those nothing wrote. Raises ``ValueError`` naming the module whose
    ``reset_parameters()`` replaced a parameter or buffer instead of writing it in place."""
    tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers()) if id(t) in born}
    versions = {key: t._version for key, t in tensors.items()}
    owner: dict[int, tuple[str, torch.nn.Module]] = {}  # first module registering each tensor

    def written(t: torch.Tensor) -> bool:
        return t._version != versions[id(t)]

    with torch.no_grad():
        for name, module in model.named_modules():
            own = [(key, t) for key, t in _own(module) if id(t) in tensors]
            for key, t in own:
                owner.setdefault(id(t), (_join(name, key), module))
            reset = getattr(module, "reset_parameters", None)
            if not own or not callable(reset):
                continue
            # Tied parameters an earlier module wrote: their values are put back after this reset.
            keep = [(t, t.clone()) for _, t in own if written(t) and owner[id(t)][1] is not module]
            before = dict(_own(module))
            reset()
            replaced = [key for key, t in before.items() if dict(_own(module)).get(key) is not t]
            if replaced:
                raise ValueError(
                    f"ChunkedOffloadStrategy: `{type(module).__name__}.reset_parameters()` of module {name!r} replaced"
                    f" {', '.join(map(repr, replaced))} instead of writing into it. A model built on the meta device"
                    " has its tensors in the strategy's memory before it is initialized: initialize in place"
                    " (`torch.nn.init.normal_(self.weight)`, `self.bias.zero_()`), or build the model on the CPU."
                )
            for t, values in keep:
                t.copy_(values)
    pending = []
    for key, (name, module) in owner.items():  # in module order
        t = tensors[key]
        if not written(t):
            reason = "has no `reset_parameters()`" if not callable(getattr(module, "reset_parameters", None)) else "`reset_parameters()` does not write it"
            pending.append(Pending(name, type(module).__name__, reason, t, versions[key]))
    return pending


def check_written(pending: Iterable[Pending]) -> None:
    """Raise ``ValueError`` naming every pending tensor still unwritten (see the module docstring)."""
    unwritten = [p for p in pending if p.tensor._version == p.version]
    if not unwritten:
        return
    listed = "; ".join(f"{p.name!r} (a {p.module_type}, which {p.reason})" for p in unwritten[:8])
    more = f" and {len(unwritten) - 8} more" if len(unwritten) > 8 else ""
    raise ValueError(
        f"ChunkedOffloadStrategy: the model was built on the meta device and nothing initialized {listed}{more}:"
        " they would train from zeros. Give those module types a `reset_parameters()` that initializes their own"
        " parameters and buffers in place, load a checkpoint that holds them (`trainer.fit(model, ckpt_path=...)`;"
        " not for non-persistent buffers), write them in a hook before the first step (e.g. `on_fit_start`), or"
        " build the model on the CPU."
    )


def _own(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(k, t) for k, t in itertools.chain(module._parameters.items(), module._buffers.items()) if t is not None]


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
