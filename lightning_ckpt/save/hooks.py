"""The save pipeline's process-wide state: one optimizer pre-step hook and one exit handler for
every plugin of the process, and the registries they walk (held weakly).

* Before every optimizer step (``before_optimizer_step``): note the optimizer as stepping (its
  parameters and state change only in its ``step()``, so their device copies may overlap the next
  forward and backward: ``changed_by_optimizers_only``); warm up async savers (``warm_up``); and
  order the training stream after the device copies of saves still landing (``hand_over``).
* At interpreter exit (``finish_in_flight_saves``): saves still in flight are finished, then each
  writer process is stopped; what failed is warned about.

Registered savers are duck-typed (``Stepped``, ``Finishing``): nothing here imports them.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_ckpt.format.plan import OPTIMIZER_COMPONENT, Blob


class Stepped(Protocol):
    """An async saver, as the pre-step hook sees it."""

    warmed: bool
    pending: Any

    def warm_up(self, optimizer: torch.optim.Optimizer) -> None: ...

    def hand_over(self) -> None: ...


class Finishing(Protocol):
    """A saver with work in flight at interpreter exit."""

    def finish_at_exit(self) -> None: ...


# Optimizers seen stepping in this process. Their parameters and state change only in their own
# ``step()``, so the copies of those tensors may overlap the next forward and backward.
_stepping: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


_async_savers: weakref.WeakSet[Stepped] = weakref.WeakSet()  # type: ignore[type-var]  # the step hook walks these


_finishing: weakref.WeakSet[Finishing] = weakref.WeakSet()  # type: ignore[type-var]  # the exit handler walks these


_step_hook: Any = None


def _track_optimizers() -> None:
    """Register ``before_optimizer_step`` once per process. It is never removed: torch iterates
    the hooks' dict in ``step()``, so a hook removed from inside that loop (or by another thread
    meanwhile) raises "OrderedDict mutated during iteration" there."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(before_optimizer_step)


def before_optimizer_step(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Every optimizer's pre-step hook: note the optimizer as stepping, and, as the step changes
    what pending device copies read, order the training stream after them here, or, for a step
    given a closure (Lightning's automatic optimization runs forward and backward inside it), once
    the closure has run."""
    _stepping.add(optimizer)
    savers = list(_async_savers)
    for saver in savers:
        if not saver.warmed:
            saver.warm_up(optimizer)
    waiting = [saver for saver in savers if saver.pending is not None]
    if not waiting:
        return None

    def hand_over() -> None:
        for saver in waiting:
            saver.hand_over()

    # ``args`` starts with the optimizer itself (``step`` is a method): the closure is next.
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        hand_over()
        return None

    def then_hand_over(*a: Any, **k: Any) -> Any:
        result = closure(*a, **k)
        hand_over()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": then_hand_over}
    return (args[0], then_hand_over, *args[2:]), kwargs


def _storage(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
    return local.untyped_storage().data_ptr()


def changed_by_optimizers_only() -> Callable[[Blob], bool]:
    """Which blobs the forward and backward leave alone: optimizer state, and the parameters of
    optimizers seen stepping. Anything else (buffers, frozen weights, callback state) is not."""
    params = {_storage(p) for optimizer in list(_stepping) for group in optimizer.param_groups for p in group["params"]}

    def deferrable(blob: Blob) -> bool:
        assert blob.source is not None
        return blob.component == OPTIMIZER_COMPONENT or blob.source.untyped_storage().data_ptr() in params

    return deferrable


@atexit.register
def finish_in_flight_saves() -> None:
    """Saves still in flight when the interpreter exits are finished (a checkpoint the user asked
    for is not dropped), then the writer processes are stopped; what failed is warned about."""
    for saver in list(_finishing):
        saver.finish_at_exit()


def register_async(saver: Stepped) -> None:
    """Let the pre-step hook and the exit handler see ``saver`` (held weakly); registers the hook
    once per process."""
    _track_optimizers()
    _async_savers.add(saver)
    _finishing.add(saver)  # type: ignore[arg-type]


def register_sync(saver: Finishing) -> None:
    """Let the exit handler see ``saver`` (held weakly)."""
    _finishing.add(saver)
