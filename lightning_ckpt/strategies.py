"""Where Lightning's strategies decide how a checkpoint is saved and loaded.

Multi-rank saves go through :meth:`ShardedCheckpointIO.save_sharded` on every rank when the
strategy's state is sharded (``ModelParallelStrategy`` with ``save_distributed_checkpoint=True``,
``FSDPStrategy(state_dict_type="sharded")``) or replicated on ranks of one node (DDP).
``ShardedModelCheckpoint`` routes its saves here, so the stock strategies save in our format.

Loading a sharded checkpoint back into FSDP2 / tensor-parallel modules is the one thing a stock
strategy cannot be told to do: ``ModelParallelStrategy.load_checkpoint`` never consults the
``CheckpointIO`` (it recognises only DCP folders and single files). ``ShardedModelParallelStrategy``
is ``ModelParallelStrategy`` with the same arguments, whose ``save_checkpoint`` and
``load_checkpoint`` use the plugin.
"""

import os
from typing import Any, Optional

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_ckpt import manifest as fmt
from lightning_ckpt.errors import CheckpointError
from lightning_ckpt.remote import is_remote


def sharded_io(strategy: Strategy) -> Any:
    """The strategy's ``ShardedCheckpointIO`` if its saves should be written by every rank, else ``None``."""
    from lightning_ckpt.io import ShardedCheckpointIO

    io = strategy.checkpoint_io
    if not isinstance(io, ShardedCheckpointIO):
        return None
    # Sharded state, on any number of ranks (one included: the stock path would write DCP files).
    if isinstance(strategy, ModelParallelStrategy):
        return io if strategy._save_distributed_checkpoint else None
    if isinstance(strategy, FSDPStrategy):
        return io if strategy._state_dict_type == "sharded" else None
    if isinstance(strategy, DDPStrategy) and strategy.world_size > 1:
        spread = io.spread_writes
        if spread is None:  # automatic: every rank sees the folder rank 0 sees only on one node
            spread = strategy.num_nodes == 1
        return io if spread else None
    return None


def save_sharded(strategy: Strategy, checkpoint: dict[str, Any], filepath: _PATH) -> bool:
    """Save ``checkpoint`` from every rank if the strategy allows it (see :func:`sharded_io`)."""
    io = sharded_io(strategy)
    if io is None:
        return False
    if isinstance(strategy, DDPStrategy) and io.spread_writes is None and is_remote(filepath) and io.remote.local_dir is None:
        return False  # spreading needs a folder all ranks share; without a local tier rank 0 uploads alone
    io.save_sharded(checkpoint, filepath, strategy.global_rank, strategy.world_size, strategy.broadcast)
    return True


def is_lightning_ckpt(path: _PATH) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), fmt.MANIFEST_FILE))


class _ShardedResume(Strategy):
    """Save through the plugin from every rank; resume from our checkpoints by loading in place
    into the live sharded model and optimizers (resharding onto the current mesh).

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
        from lightning_ckpt.io import ShardedCheckpointIO

        if isinstance(self.checkpoint_io, ShardedCheckpointIO) and is_remote(checkpoint_path):
            return self._load_ours(self._local_copy(self.checkpoint_io, os.fspath(checkpoint_path)), weights_only)
        if not is_lightning_ckpt(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        return self._load_ours(checkpoint_path, weights_only)

    def _local_copy(self, io: Any, url: str) -> str:
        """The local tier's copy of the checkpoint at ``url``: rank 0 brings it there (or finds it
        current), every rank then reads its shards from that one folder.

        The tier must be a folder every rank shares, as for sharded saves to a URL: one download,
        and every rank provably reads the same checkpoint (a copy per node could differ: a node's
        tier may hold a newer save whose upload never finished). A collective (an all-reduce of
        success, so a failed download raises on every rank instead of leaving the others
        waiting); every rank calls it, as Lightning calls ``load_checkpoint``.
        """
        from lightning_ckpt import remote

        options = io.remote
        if options.local_dir is None:  # the same answer on every rank: nothing collective has started
            raise ValueError(
                f"Resuming {type(self).__name__} from {url} needs `ShardedCheckpointIO(local_dir=...)` on a folder every"
                " rank shares (as saving to a URL does): rank 0 downloads the checkpoint there and every rank reads its"
                " shards from it. HINT: set `local_dir` (the same one the saves use), or download first with"
                " `python -m lightning_ckpt convert URL ./local.ckpt` and resume from the local copy."
            )
        io.wait()  # never read a checkpoint this run is still writing or uploading
        io.keep_loaded(url)
        error: Optional[BaseException] = None
        if self.global_rank == 0:
            try:
                remote.local_copy_for_load(url, options)
            except Exception as err:  # raised below, after every rank knows
                error = err
        rank0_ok = self.reduce_boolean_decision(error is None, all=True)
        if error is not None:
            raise error
        if not rank0_ok:
            raise CheckpointError(f"Resuming from {url}: rank 0 could not bring the checkpoint into `local_dir`; its error is in rank 0's output.")
        local = options.local_path(url)
        if not self.reduce_boolean_decision(is_lightning_ckpt(local), all=True):
            raise CheckpointError(
                f"Resuming from {url}: not every rank sees the copy rank 0 brought into `local_dir` ({local})."
                " HINT: `local_dir` must be a folder every rank shares (the same path on a shared filesystem), as"
                " for saving to a URL from several ranks."
            )
        return local

    def _load_ours(self, checkpoint_path: _PATH, weights_only: Optional[bool]) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from lightning_ckpt.distributed import load_sharded

        assert self.model is not None and self.lightning_module is not None
        if getattr(self.checkpoint_io, "async_save", False):
            self.checkpoint_io.wait()  # never read a checkpoint this run is still writing
        strict = self.lightning_module.strict_loading
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if fitting else []
        targets: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        if optimizers:
            targets["optimizer_states"] = [get_optimizer_state_dict(self.model, o) for o in optimizers]
        verify = getattr(self.checkpoint_io, "verify_on_load", "full") == "full"
        # Not fitting (validate, test, predict): the optimizer states are neither read nor assembled.
        skip = () if fitting else ("optimizer_states",)
        checkpoint = load_sharded(checkpoint_path, targets, strict=strict, weights_only=weights_only, verify=verify, skip=skip)
        # Through DCP, as the targets came: FSDP (1) modules load sharded values only inside its
        # sharded state-dict context (a plain ``load_state_dict`` expects full tensors).
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=StateDictOptions(strict=strict))
        saved = checkpoint.pop("optimizer_states", [])
        if optimizers and len(saved) != len(optimizers):
            raise ValueError(
                f"{checkpoint_path}: the checkpoint holds {len(saved)} optimizer state(s), the model configures"
                f" {len(optimizers)}. Resume with the same `configure_optimizers`."
            )
        for optimizer, state in zip(optimizers, saved):
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=StateDictOptions(strict=strict))
        return checkpoint


class ShardedModelParallelStrategy(_ShardedResume, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2, tensor parallelism) that saves and resumes lightning_ckpt
    checkpoints: every rank writes its own shards, and resuming reshards them onto the current
    device mesh (any world size). Takes exactly ``ModelParallelStrategy``'s arguments::

        Trainer(strategy=ShardedModelParallelStrategy(data_parallel_size=2),
                plugins=[ShardedCheckpointIO()], callbacks=[ShardedModelCheckpoint(...)])

    Stock DCP folders and single-file checkpoints still load as ``ModelParallelStrategy`` loads them.
    """


class ShardedFSDPStrategy(_ShardedResume, FSDPStrategy):
    """``FSDPStrategy`` that saves and resumes lightning_ckpt checkpoints with
    ``state_dict_type="sharded"`` (its default here); otherwise exactly ``FSDPStrategy``."""

    def __init__(self, *args: Any, state_dict_type: str = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)


__all__ = ["ShardedFSDPStrategy", "ShardedModelParallelStrategy"]
