"""Where Lightning's strategies decide how a checkpoint is saved and loaded.

Multi-rank saves go through :meth:`ShardedCheckpointIO.save_sharded` on every rank when the
strategy's state is sharded (``ModelParallelStrategy`` with ``save_distributed_checkpoint=True``,
``FSDPStrategy(state_dict_type="sharded")``) or replicated on ranks of one node (DDP).
``ShardedModelCheckpoint`` routes its saves here, so the stock strategies save in our format.

Loading one of our checkpoints back into FSDP / tensor-parallel modules is what the stock
strategies cannot be told to do through the ``CheckpointIO``: their ``load_checkpoint`` never
consults it (it recognises only DCP folders and single files), and their ``save_checkpoint`` writes
DCP files (sharded state) or refuses an existing directory (full state: ``last.ckpt``'s second
save). Two ways in, one loader (:func:`load_in_place`) and one saver (:func:`save_sharded`):

* ``ShardedModelCheckpoint.setup`` calls :func:`enable_sharded_checkpoints` on the trainer's
  strategy (callbacks' ``setup`` runs before the strategy restores), so a stock
  ``ModelParallelStrategy`` or ``FSDPStrategy``, or a user's subclass of either, saves and resumes
  our checkpoints as it is (``Trainer.save_checkpoint`` included);
* ``ShardedModelParallelStrategy`` / ``ShardedFSDPStrategy`` do the same by subclassing, for
  runs without the callback, and also hand the plugin the state where it lives (no copy into
  host memory in ``dump_checkpoint``).
"""

import os
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    Strategy,
)
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_ckpt import remote
from lightning_ckpt.errors import CheckpointError
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.dcp import load_sharded
from lightning_ckpt.format.reader import read_manifest
from lightning_ckpt.lightning.plugin import CheckpointIOFeatures, ShardedCheckpointIO
from lightning_ckpt.offload.shares import own_shares
from lightning_ckpt.remote import is_remote
from lightning_ckpt.save.staging import largest_image, optimizer_state_tensors, staging_need


# Per trainer, the load its latest restore made (``collective_restores``): logged once, by
# whichever ``ShardedModelCheckpoint`` gets there first (``restored_load``).
_RESTORED: weakref.WeakKeyDictionary[pl.Trainer, dict[str, Any]] = weakref.WeakKeyDictionary()


def collective_restores(trainer: pl.Trainer) -> None:
    """Let the plugin's load inside Lightning's restore (``_CheckpointConnector.resume_start``,
    which every rank runs together) be a collective one (``ShardedCheckpointIO(read_once=...)``),
    and no other load: one a user's code makes on one rank alone never waits for the others.
    Undone by :func:`end_collective_restores`. Idempotent (several callbacks)."""
    io = trainer.strategy.checkpoint_io
    arm = getattr(io, "expect_collective_load", None)
    connector = trainer._checkpoint_connector
    if arm is None or "resume_start" in vars(connector):
        return
    original = connector.resume_start

    def resume_start(*args: Any, **kwargs: Any) -> None:
        before = getattr(io, "last_load", None)
        arm(trainer.world_size, trainer.num_nodes)
        try:
            original(*args, **kwargs)
        finally:
            io.end_collective_load()
        record = getattr(io, "last_load", None)
        if record is not None and record is not before:
            _RESTORED[trainer] = {"record": record, "logged": False}

    connector.resume_start = resume_start


def end_collective_restores(trainer: pl.Trainer) -> None:
    """Undo :func:`collective_restores` (the connector's own method again)."""
    vars(trainer._checkpoint_connector).pop("resume_start", None)


def restored_load(trainer: pl.Trainer) -> tuple[Any, bool]:
    """(the record of the latest restore's load or ``None``, whether this is the first call to
    see it: it is then to be logged)."""
    found = _RESTORED.get(trainer)
    if found is None:
        return None, False
    first, found["logged"] = not found["logged"], True
    return found["record"], first


def sharded_io(strategy: Strategy) -> Any:
    """The strategy's ``ShardedCheckpointIO`` if its saves should be written by every rank, else ``None``."""
    io = _our_io(strategy)
    if io is None:
        return None
    sharded = _sharded_state(strategy)
    if sharded is not None:  # on any number of ranks (one included: the stock path would write DCP files)
        return io if sharded else None
    if isinstance(strategy, DDPStrategy):
        return io if spreads_writes(io, strategy.world_size, strategy.num_nodes) else None
    return None


def spreads_writes(io: Any, world_size: int, num_nodes: int, path: Optional[_PATH] = None) -> bool:
    """Do the ranks of a DDP run (Trainer or Fabric) each write part of the replicated state
    through ``io`` (``ShardedCheckpointIO(spread_writes=...)``)? Automatic (``None``): on one node,
    where every rank sees the folder rank 0 sees, unless ``path`` is a URL without a local tier
    (then rank 0 uploads alone)."""
    if world_size < 2 or io.spread_writes is False:
        return False
    if io.spread_writes is None:
        return num_nodes == 1 and not (path is not None and is_remote(path) and io.remote.local_dir is None)
    return True


def writes_parts(strategy: Strategy, filepath: _PATH) -> bool:
    """Will :func:`save_sharded` of a checkpoint to ``filepath`` have every rank write its part?"""
    io = sharded_io(strategy)
    if io is None:
        return False
    return not isinstance(strategy, DDPStrategy) or spreads_writes(io, strategy.world_size, strategy.num_nodes, filepath)


def checkpoint_state(strategy: Strategy, filepath: _PATH) -> AbstractContextManager[None]:
    """Enter around building a checkpoint for :func:`save_sharded`: where every rank writes its part,
    sharded optimizers (``ChunkedAdamW``) give each rank's own share of their state, ungathered."""
    return own_shares(writes_parts(strategy, filepath))


def save_sharded(strategy: Strategy, checkpoint: dict[str, Any], filepath: _PATH) -> bool:
    """Save ``checkpoint`` from every rank if the strategy allows it (see :func:`sharded_io`), or
    from rank 0 alone if it gathered the full state for rank 0 to write; ``False``: not saved, the
    strategy's own ``save_checkpoint`` is the way. Every rank calls it."""
    io = sharded_io(strategy)
    if io is None:
        io = _full_state_io(strategy)
        if io is None:
            return False
        # What the stock ``save_checkpoint`` does in this mode, without its refusal of an existing
        # directory at ``filepath`` (ours are directories, replaced atomically: ``last.ckpt``).
        if strategy.is_global_zero:
            io.save_checkpoint(checkpoint, filepath)
        return True
    if not writes_parts(strategy, filepath):
        return False  # DDP to a URL without a local tier: rank 0 uploads alone
    io.save_sharded(checkpoint, filepath, strategy.global_rank, strategy.world_size, strategy.broadcast)
    return True


def save_from_ranks(trainer: pl.Trainer, filepath: str, weights_only: bool) -> None:
    """``Trainer.save_checkpoint`` on any number of ranks. Every rank calls it.

    In one process it *is* ``Trainer.save_checkpoint`` (public API that users, loggers and other
    callbacks wrap; its barrier is a no-op there). With several ranks, the same steps without its
    per-file barrier (see ``callback``'s module docstring).
    """
    if trainer.world_size == 1:
        with checkpoint_state(trainer.strategy, filepath):
            trainer.save_checkpoint(filepath, weights_only)
        return
    with trainer.profiler.profile("save_checkpoint"):
        with checkpoint_state(trainer.strategy, filepath):  # every rank writes: its own optimizer share
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only)
        # Sharded state (FSDP2 / tensor parallel) and DDP on one node: every rank writes its part;
        # the full state FSDP / ModelParallelStrategy gathered: rank 0 writes it (see save_sharded).
        if not save_sharded(trainer.strategy, checkpoint, filepath):
            trainer.strategy.save_checkpoint(checkpoint, filepath)


def prepare_staging(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """After the first optimizer step (its state exists now): refuse an async plugin's staging
    pool too small for this state's largest shard, and let the plugin fault in (and page-lock) its
    pool in the background, long before the first save, sized for this rank's state. The pool is
    not prepared for spread DDP writes (each rank stages a part only the plan knows)."""

    io = trainer.strategy.checkpoint_io
    if not isinstance(io, CheckpointIOFeatures) or not io.async_save:
        return
    # Parameters and buffers, not ``state_dict()``: under FSDP (1) that would gather every full
    # parameter onto every rank; these are this rank's shards (FSDP1's flat parameters, FSDP2's
    # DTensors) and count tied weights once.
    model = [*pl_module.parameters(), *pl_module.buffers()]
    state = [t for optimizer in trainer.optimizers for t in optimizer_state_tensors(optimizer)]
    io.check_staging_pool(largest_image([model, state], io.max_shard_size))
    if trainer.world_size > 1 and not isinstance(trainer.strategy, (ModelParallelStrategy, FSDPStrategy)):
        return
    io.prepare_staging(*staging_need(model + state))


def _full_state_io(strategy: Strategy) -> Any:
    """The strategy's ``ShardedCheckpointIO`` if it is a ``ModelParallelStrategy`` /
    ``FSDPStrategy`` whose checkpoint holds full state gathered on rank 0, else ``None``."""
    io = _our_io(strategy)
    return io if io is not None and _sharded_state(strategy) is False else None


def _sharded_state(strategy: Strategy) -> Optional[bool]:
    """Does a ``ModelParallelStrategy`` / ``FSDPStrategy`` checkpoint sharded state (every rank its
    part) or the full state gathered on rank 0? ``None`` for any other strategy."""
    if isinstance(strategy, ModelParallelStrategy):
        return strategy._save_distributed_checkpoint
    if isinstance(strategy, FSDPStrategy):
        return strategy._state_dict_type == "sharded"
    return None


def _our_io(strategy: Strategy) -> Any:

    io = strategy.checkpoint_io
    return io if isinstance(io, ShardedCheckpointIO) else None


def is_lightning_ckpt(path: _PATH) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), fmt.MANIFEST_FILE))


def enable_sharded_checkpoints(strategy: Strategy) -> bool:
    """Let this ``ModelParallelStrategy`` / ``FSDPStrategy`` instance save and resume our
    checkpoints; ``False`` for any other strategy (their saves and loads already go through the
    ``CheckpointIO``).

    Invariant: only the instance's ``save_checkpoint`` and ``load_checkpoint`` change. The class (a
    user's subclass included) keeps every method: its own ``load_checkpoint`` still loads every
    checkpoint that is not ours, and its own ``save_checkpoint`` still saves whenever the plugin is
    not ``ShardedCheckpointIO`` or ``storage_options`` are given (see :func:`save_sharded`).
    Idempotent, and a no-op on the ``Sharded*`` subclasses, which do this already. Call it before
    the strategy restores (a callback's ``setup``).
    """
    if isinstance(strategy, _ShardedResume) or not isinstance(strategy, (ModelParallelStrategy, FSDPStrategy)):
        return False
    # An instance attribute shadows the class's method; ``strategy.load_checkpoint`` read before it
    # is the class's bound method: Lightning's, or the subclass's override.
    if not isinstance(strategy.__dict__.get("load_checkpoint"), _LoadOursFirst):
        strategy.load_checkpoint = _LoadOursFirst(strategy, strategy.load_checkpoint)  # type: ignore[method-assign]
    if not isinstance(strategy.__dict__.get("save_checkpoint"), _SaveOursFirst):
        strategy.save_checkpoint = _SaveOursFirst(strategy, strategy.save_checkpoint)  # type: ignore[method-assign]
    return True


class _LoadOursFirst:
    """A stock strategy instance's ``load_checkpoint`` (see :func:`enable_sharded_checkpoints`)."""

    def __init__(self, strategy: Strategy, stock: Callable[..., dict[str, Any]]) -> None:
        self.strategy = strategy
        self.stock = stock

    def __call__(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return load_in_place(self.strategy, checkpoint_path, weights_only, self.stock)


class _SaveOursFirst:
    """A stock strategy instance's ``save_checkpoint`` (see :func:`enable_sharded_checkpoints`)."""

    def __init__(self, strategy: Strategy, stock: Callable[..., None]) -> None:
        self.strategy = strategy
        self.stock = stock

    def __call__(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is None and save_sharded(self.strategy, checkpoint, filepath):
            return
        self.stock(checkpoint, filepath, storage_options=storage_options)


class _ShardedResume(Strategy):
    """Save through the plugin from every rank; resume from our checkpoints by loading in place
    into the live sharded model and optimizers (resharding onto the current mesh, see
    :func:`load_in_place`).

    The state handed to the plugin stays where it lives (no ``cpu_offload``): the plugin copies
    device memory itself, into its reused staging pool (async) or its bounded buffers (sync),
    instead of Lightning copying every shard into fresh host memory inside ``dump_checkpoint``.
    """

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if sharded_io(self) is None:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if sharded_io(self) is None:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.model is not None
        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if storage_options is None and save_sharded(self, checkpoint, filepath):
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return load_in_place(self, checkpoint_path, weights_only, super().load_checkpoint)


def load_in_place(
    strategy: Strategy, checkpoint_path: _PATH, weights_only: Optional[bool], stock: Callable[..., dict[str, Any]]
) -> dict[str, Any]:
    """``strategy.load_checkpoint``: ours loaded in place into the live (sharded) model and
    optimizers, resharding onto the current mesh; any other checkpoint through ``stock`` (the
    strategy's own ``load_checkpoint``). Every rank calls it, as Lightning calls ``load_checkpoint``."""

    io = strategy.checkpoint_io
    if isinstance(io, ShardedCheckpointIO) and is_remote(checkpoint_path):
        return _load_ours(strategy, _local_copy(strategy, io, os.fspath(checkpoint_path)), weights_only)

    def load(path: _PATH) -> dict[str, Any]:
        return _load_ours(strategy, path, weights_only) if is_lightning_ckpt(path) else stock(path, weights_only)

    # ``ckpt_path="last"``: the newest intact checkpoint of the folder (see ``resume_last``).
    return io.load_resolved(checkpoint_path, load) if isinstance(io, ShardedCheckpointIO) else load(checkpoint_path)


def _local_copy(strategy: Strategy, io: Any, url: str) -> str:
    """The local tier's copy of the checkpoint at ``url``: rank 0 brings it there (or finds it
    current), every rank then reads its shards from that one folder.

    The tier must be a folder every rank shares, as for sharded saves to a URL: one download,
    and every rank provably reads the same checkpoint (a copy per node could differ: a node's
    tier may hold a newer save whose upload never finished). A collective (an all-reduce of
    success, so a failed download raises on every rank instead of leaving the others
    waiting); every rank calls it, as Lightning calls ``load_checkpoint``.
    """

    options = io.remote
    if options.local_dir is None:  # the same answer on every rank: nothing collective has started
        raise ValueError(
            f"Resuming {type(strategy).__name__} from {url} needs `ShardedCheckpointIO(local_dir=...)` on a folder every"
            " rank shares (as saving to a URL does): rank 0 downloads the checkpoint there and every rank reads its"
            " shards from it. HINT: set `local_dir` (the same one the saves use), or download first with"
            " `python -m lightning_ckpt convert URL ./local.ckpt` and resume from the local copy."
        )
    io.wait()  # never read a checkpoint this run is still writing or uploading
    io.keep_loaded(url)
    error: Optional[BaseException] = None
    if strategy.global_rank == 0:
        try:
            remote.local_copy_for_load(url, options)
        except Exception as err:  # raised below, after every rank knows
            error = err
    rank0_ok = strategy.reduce_boolean_decision(error is None, all=True)
    if error is not None:
        raise error
    if not rank0_ok:
        raise CheckpointError(f"Resuming from {url}: rank 0 could not bring the checkpoint into `local_dir`; its error is in rank 0's output.")
    local = options.local_path(url)
    if not strategy.reduce_boolean_decision(is_lightning_ckpt(local), all=True):
        raise CheckpointError(
            f"Resuming from {url}: not every rank sees the copy rank 0 brought into `local_dir` ({local})."
            " HINT: `local_dir` must be a folder every rank shares (the same path on a shared filesystem), as"
            " for saving to a URL from several ranks."
        )
    return local


def _load_ours(strategy: Strategy, checkpoint_path: _PATH, weights_only: Optional[bool]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )


    model, module = strategy.model, strategy.lightning_module
    assert model is not None and module is not None
    io = strategy.checkpoint_io
    if getattr(io, "async_save", False):
        io.wait()  # never read a checkpoint this run is still writing
    strict = module.strict_loading
    fitting = module.trainer.state.fn == TrainerFn.FITTING
    optimizers = [getattr(o, "_optimizer", o) for o in strategy.optimizers] if fitting else []
    targets: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
    by_index = bool(optimizers) and _optimizer_states_by_index(checkpoint_path)
    if optimizers:
        # The same tensors as the live state, keyed as the checkpoint keys them.
        states = [get_optimizer_state_dict(model, o) for o in optimizers]
        targets["optimizer_states"] = [_rekey(s, model, by_name=False) for s in states] if by_index else states
    verify = getattr(io, "verify_on_load", "full") == "full"
    # Not fitting (validate, test, predict): the optimizer states are neither read nor assembled.
    skip = () if fitting else ("optimizer_states",)
    checkpoint = load_sharded(checkpoint_path, targets, strict=strict, weights_only=weights_only, verify=verify, skip=skip)
    # Through DCP, as the targets came: FSDP (1) modules load sharded values only inside its
    # sharded state-dict context (a plain ``load_state_dict`` expects full tensors).
    set_model_state_dict(model, checkpoint.pop("state_dict"), options=StateDictOptions(strict=strict))
    saved = checkpoint.pop("optimizer_states", [])
    if optimizers and len(saved) != len(optimizers):
        raise ValueError(
            f"{checkpoint_path}: the checkpoint holds {len(saved)} optimizer state(s), the model configures"
            f" {len(optimizers)}. Resume with the same `configure_optimizers`."
        )
    for optimizer, state in zip(optimizers, saved):
        state = _rekey(state, model, by_name=True) if by_index else state
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=StateDictOptions(strict=strict))
    return checkpoint


def _optimizer_states_by_index(checkpoint_path: _PATH) -> bool:
    """Does the checkpoint key its optimizer states by parameter index? Lightning's full-state saves
    (``FSDPStrategy(state_dict_type="full")``, ``ModelParallelStrategy(save_distributed_checkpoint=False)``)
    do: rank 0 alone writes whole tensors, its optimizer state re-keyed to the parameters' positions."""

    return any(
        len(record.path) > 3 and record.path[0] == "optimizer_states" and record.path[2] == "state" and type(record.path[3]) is int
        for record in read_manifest(checkpoint_path).tensors
    )


def _rekey(state: dict[str, Any], model: torch.nn.Module, by_name: bool) -> dict[str, Any]:
    """An optimizer state keyed by parameter name <-> by position, as Lightning re-keys full-state
    saves (the same per-parameter dicts: loading into one loads into the other)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    key_type = OptimStateKeyType.PARAM_NAME if by_name else OptimStateKeyType.PARAM_ID
    return FullyShardedDataParallel.rekey_optim_state_dict(state, key_type, model)


class ShardedModelParallelStrategy(_ShardedResume, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2, tensor parallelism) that saves and resumes lightning_ckpt
    checkpoints: every rank writes its own shards, and resuming reshards them onto the current
    device mesh (any world size). Takes exactly ``ModelParallelStrategy``'s arguments::

        Trainer(strategy=ShardedModelParallelStrategy(data_parallel_size=2),
                plugins=[ShardedCheckpointIO()], callbacks=[ShardedModelCheckpoint(...)])

    With ``ShardedModelCheckpoint`` among the callbacks the stock strategy resumes as well; this
    class is for runs without it, and saves without Lightning's copy of the state into host memory.

    Stock DCP folders and single-file checkpoints still load as ``ModelParallelStrategy`` loads them.
    """


class ShardedFSDPStrategy(_ShardedResume, FSDPStrategy):
    """``FSDPStrategy`` that saves and resumes lightning_ckpt checkpoints with
    ``state_dict_type="sharded"`` (its default here); otherwise exactly ``FSDPStrategy``."""

    def __init__(self, *args: Any, state_dict_type: str = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)


__all__ = ["ShardedFSDPStrategy", "ShardedModelParallelStrategy"]
