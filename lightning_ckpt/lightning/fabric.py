"""Fabric's strategies that write and read lightning_ckpt checkpoints from every rank.

On one device and under DDP, ``Fabric(plugins=[ShardedCheckpointIO()])`` is all it takes: Fabric's
``save`` hands the state to the plugin on rank 0 and ``load`` reads it on every rank. Fabric's
``ModelParallelStrategy`` (FSDP2, tensor parallelism) and ``FSDPStrategy`` never call a
``CheckpointIO`` (they refuse one) and write DCP folders themselves. The subclasses here take the
same arguments and save through the plugin instead: every rank writes its own shards of the
model and optimizers, rank 0 commits the whole (``ShardedCheckpointIO.save_sharded``), and
``fabric.load`` reshards the checkpoint onto the current ranks, any number of them, reading only
the pieces each rank holds (``distributed.load_sharded``). Stock DCP folders and single files
still load as the stock strategies load them.

Call order and ranks: Fabric calls ``save_checkpoint`` and ``load_checkpoint`` on every rank; each
broadcasts the path from rank 0 (as the stock strategies do) and runs no other collective, except
one barrier before an async-mode load (every rank's part must be committed before any rank reads).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional, Union

from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning.fabric.strategies.strategy import (
    _apply_filter,
    _validate_keys_for_strict_loading,
)
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_ckpt.format.dcp import load_sharded
from lightning_ckpt.format.reader import read_manifest
from lightning_ckpt.lightning.plugin import ShardedCheckpointIO
from lightning_ckpt.lightning.strategies import is_lightning_ckpt, spreads_writes
from lightning_ckpt.remote import is_remote

_State = dict[str, Union[Module, Optimizer, Any]]


def _distributed_module(state: _State, where: str) -> Module:
    """The one sharded model in ``state`` (FSDP2/DTensor or FSDP): its optimizers' state dicts need it."""
    from lightning.fabric.strategies.fsdp import _has_fsdp_modules
    from lightning.fabric.strategies.model_parallel import _has_dtensor_modules

    modules = [m for m in state.values() if _has_dtensor_modules(m) or _has_fsdp_modules(m)]
    if len(modules) != 1:
        found = "no sharded model" if not modules else f"{len(modules)} sharded models"
        raise ValueError(
            f"`{where}` needs exactly one model set up by the strategy in `state`, found {found}."
            " HINT: pass it as `state={'model': model, 'optimizer': optimizer, ...}` after"
            " `fabric.setup(...)`; save several models to several paths."
        )
    return modules[0]


class _ThroughThePlugin:
    """Mixed into a Fabric ``ParallelStrategy``: saves through ``ShardedCheckpointIO.save_sharded``
    from every rank where ``_every_rank_writes()``, and loads only once every rank's saves are
    committed (async mode)."""

    _checkpoint_io: Optional[CheckpointIO]
    broadcast: Callable[..., Any]
    barrier: Callable[..., None]
    global_rank: int
    world_size: int

    def _every_rank_writes(self, path: str) -> bool:
        raise NotImplementedError

    def _checkpoint_of(self, state: _State, filter: dict[str, Callable[[str, Any], bool]]) -> dict[str, Any]:
        """The checkpoint dict this rank saves for ``state`` (models and optimizers as state dicts)."""
        raise NotImplementedError

    def _load(self, path: str, state: Any, strict: bool, weights_only: Optional[bool]) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def checkpoint_io(self) -> ShardedCheckpointIO:
        """The ``ShardedCheckpointIO`` from ``Fabric(plugins=[...])``, or a default one."""
        if self._checkpoint_io is None:
            self._checkpoint_io = ShardedCheckpointIO()
        assert isinstance(self._checkpoint_io, ShardedCheckpointIO)
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        if not isinstance(io, ShardedCheckpointIO):
            raise TypeError(
                f"`{type(self).__name__}` saves through `lightning_ckpt.ShardedCheckpointIO`, got"
                f" `{type(io).__name__}` in `Fabric(plugins=[...])`. HINT: pass `ShardedCheckpointIO(...)`, or use"
                " Fabric's own strategy, which writes its own checkpoint format."
            )
        self._checkpoint_io = io

    def save_checkpoint(
        self,
        path: _PATH,
        state: _State,
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Every rank writes its part of ``state`` into the checkpoint folder at rank 0's ``path``
        (called on every rank, as ``fabric.save`` does). ``filter`` works as for Fabric's other
        strategies (a filtered checkpoint loads with ``strict=False``)."""
        if not self._every_rank_writes(os.fspath(path)):
            super().save_checkpoint(path, state, storage_options, filter)  # type: ignore[misc]
            return
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported; got"
                f" storage_options={storage_options!r}. Pass them once as `ShardedCheckpointIO(storage_options=...)`."
            )
        checkpoint = self._checkpoint_of(state, filter or {})
        target = self.broadcast(os.fspath(path))  # every rank writes into rank 0's folder
        self.checkpoint_io.save_sharded(checkpoint, target, self.global_rank, self.world_size, self.broadcast)

    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, _State]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Load ``path`` (rank 0's) as ``fabric.load`` does. In async mode, first waits for this
        rank's saves and meets the other ranks: a checkpoint saved just before is then committed
        (rank 0 commits it once every rank's part is durable) before any rank reads it."""
        target = self.broadcast(os.fspath(path))
        io = self.checkpoint_io
        if io.async_save:
            io.wait()
            self.barrier("lightning_ckpt.lightning.fabric.load")
        return self._load(target, state, strict, weights_only)


class _FabricShardedCheckpoints(_ThroughThePlugin):
    """For strategies whose model state is sharded (FSDP2/DTensor, FSDP)."""

    def _sharded_saves(self) -> bool:
        """Whether this strategy's saves are sharded (its stock full-state mode writes one file)."""
        raise NotImplementedError

    @override
    def _every_rank_writes(self, path: str) -> bool:
        return self._sharded_saves()

    @override
    def _checkpoint_of(self, state: _State, filter: dict[str, Callable[[str, Any], bool]]) -> dict[str, Any]:
        """Models and optimizers as DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict``
        give them (sharded, where they live: the plugin copies them itself); anything else as it
        is, or its ``state_dict()``."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        module = _distributed_module(state, "fabric.save")
        checkpoint: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                converted: Any = get_model_state_dict(obj)
            elif isinstance(obj, Optimizer):
                converted = get_optimizer_state_dict(module, obj)
            else:
                converted = obj.state_dict() if isinstance(obj, _Stateful) else obj
            _apply_filter(key, filter, converted, checkpoint)
        return checkpoint

    @override
    def _load(self, path: str, state: Any, strict: bool, weights_only: Optional[bool]) -> dict[str, Any]:
        """A lightning_ckpt checkpoint is loaded in place into the sharded model and optimizers in
        ``state``, resharded onto the current ranks; other values of ``state`` are replaced by the
        checkpoint's. Returns the rest of the checkpoint, as Fabric does: values not asked for,
        except keys saved in pieces (sharded models' and optimizers' state), which are left
        unread: assembling them whole would need the whole state on every rank. Without ``state``: the
        whole checkpoint on every rank. ``strict`` follows Fabric: keys of ``state`` missing from
        the checkpoint, and model parameters missing from it, raise ``KeyError``.

        Anything else (a stock DCP folder, a single file) loads as the stock strategy loads it.
        """
        if is_remote(path):
            raise ValueError(
                f"`{type(self).__name__}` loads local checkpoints only, got {path!r}. HINT: download it first with"
                " `python -m lightning_ckpt convert URL ./local.ckpt` (or load it on one device) and load the local copy."
            )
        if not is_lightning_ckpt(path):  # the stock strategy's own formats
            return super(_ThroughThePlugin, self).load_checkpoint(path, state, strict, weights_only)  # type: ignore[misc]
        if not state:
            return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if not isinstance(state, dict):
            raise TypeError(
                f"`fabric.load({path!r}, {type(state).__name__})`: `{type(self).__name__}` loads a checkpoint into"
                " a state dict, such as `{'model': model, 'optimizer': optimizer}`."
            )
        return self._load_in_place(path, state, strict, weights_only)

    def _load_in_place(self, path: str, state: _State, strict: bool, weights_only: Optional[bool]) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )


        module = _distributed_module(state, "fabric.load")
        records = read_manifest(path).tensors
        saved = {r.path[0] for r in records if r.path}  # top-level keys that hold tensors
        # Keys saved from sharded state (any tensor stored as pieces): never assembled unasked.
        sharded = {r.path[0] for r in records if r.path and r.chunks is not None}
        targets: dict[str, Any] = {}
        for key, obj in state.items():
            if key not in saved:
                continue  # missing from the checkpoint: refused below with strict=True
            if isinstance(obj, Module):
                targets[key] = get_model_state_dict(obj)
            elif isinstance(obj, Optimizer):
                targets[key] = get_optimizer_state_dict(module, obj)
        skip = sharded - state.keys()
        verify = self.checkpoint_io.verify_on_load == "full"
        checkpoint = load_sharded(path, targets, strict=strict, weights_only=weights_only, verify=verify, skip=skip)
        _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
        options = StateDictOptions(strict=strict)
        for key, obj in list(state.items()):
            if key not in checkpoint:
                continue
            value = checkpoint.pop(key)
            if isinstance(obj, Module):
                set_model_state_dict(obj, value, options=options)
            elif isinstance(obj, Optimizer):
                set_optimizer_state_dict(module, obj, optim_state_dict=value, options=options)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(value)
            else:
                state[key] = value
        return checkpoint


class ShardedFabricModelParallelStrategy(_FabricShardedCheckpoints, ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) saving lightning_ckpt
    checkpoints from every rank and loading them onto any number of ranks. Takes exactly
    ``ModelParallelStrategy``'s arguments::

        fabric = Fabric(strategy=ShardedFabricModelParallelStrategy(parallelize_fn),
                        plugins=[ShardedCheckpointIO(async_save=True)])
        fabric.save("step=100.ckpt", {"model": model, "optimizer": optimizer, "step": 100})
        fabric.load("step=100.ckpt", {"model": model, "optimizer": optimizer, "step": 0})

    With ``save_distributed_checkpoint=False``, saves and loads as the stock strategy does (the
    full state gathered into one ``torch.save`` file).
    """

    @override
    def _sharded_saves(self) -> bool:
        return self._save_distributed_checkpoint


class ShardedFabricFSDPStrategy(_FabricShardedCheckpoints, FSDPStrategy):
    """Fabric's ``FSDPStrategy`` saving lightning_ckpt checkpoints from every rank (its
    ``state_dict_type="sharded"``, the default here) and loading them onto any number of ranks,
    also into an FSDP2 model (``ShardedFabricModelParallelStrategy``). Otherwise exactly
    ``FSDPStrategy``; ``state_dict_type="full"`` saves and loads as the stock strategy does."""

    def __init__(self, *args: Any, state_dict_type: str = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)

    @override
    def _sharded_saves(self) -> bool:
        return self._state_dict_type == "sharded"


class ShardedFabricDDPStrategy(_ThroughThePlugin, DDPStrategy):
    """Fabric's ``DDPStrategy`` whose saves are written by every rank, each about
    ``1/world_size`` of the replicated state (``ShardedCheckpointIO(spread_writes=...)``: by
    default on one node only, where every rank sees rank 0's folder), and whose ``fabric.load``
    of a checkpoint saved asynchronously just before waits until it is committed. Otherwise
    exactly ``DDPStrategy``: every rank loads the whole checkpoint.

    The stock ``DDPStrategy`` with ``plugins=[ShardedCheckpointIO()]`` works too (rank 0 writes
    everything); in async mode, call ``fabric.strategy.checkpoint_io.wait()`` and
    ``fabric.barrier()`` before loading a checkpoint the run saved itself.
    """

    @override
    def _every_rank_writes(self, path: str) -> bool:
        return spreads_writes(self.checkpoint_io, self.world_size, self.num_nodes, path)

    @override
    def _checkpoint_of(self, state: _State, filter: dict[str, Callable[[str, Any], bool]]) -> dict[str, Any]:
        return self._convert_stateful_objects_in_state(state, filter=filter)

    @override
    def _load(self, path: str, state: Any, strict: bool, weights_only: Optional[bool]) -> dict[str, Any]:
        return super(_ThroughThePlugin, self).load_checkpoint(path, state, strict, weights_only)  # type: ignore[misc]


__all__ = ["ShardedFabricDDPStrategy", "ShardedFabricFSDPStrategy", "ShardedFabricModelParallelStrategy"]
