"""Loading our checkpoints through DCP: ``ShardedStorageReader`` serves our files to DCP's
``DefaultLoadPlanner``, and ``load_sharded`` reshards a checkpoint (any world size) into a live
model and optimizers, reading only the pieces each rank holds. Which rank wrote what:
``save.ranks``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.futures import Future

from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format import reader
from lightning_ckpt.format.plan import (
    dtype_from_name,
    encode_checkpoint,
    is_stored_tensor,
)


def stored(value: torch.Tensor) -> bool:
    """Tensors stored as bytes: plain ones, and the local pieces of DTensors and ShardedTensors."""
    return isinstance(value, DTensor) or is_sharded_tensor(value) or is_stored_tensor(value)


def is_sharded_tensor(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


# ----------------------------------------------------------------------------------------------
# Loading into live, sharded state


def _fqn(path: Iterable[Any]) -> str:
    return json.dumps([k if type(k) in (str, int) else repr(k) for k in path])


class ShardedStorageReader(StorageReader):
    """A DCP ``StorageReader`` over a lightning_ckpt checkpoint directory (any format version).

    Tensor keys are the JSON key paths of the checkpoint dict (``'["state_dict", "w"]'``). Each
    file is verified against its digest before the first piece is read from it (``verify=True``),
    so a rank reads and hashes only the files its shard overlaps. Reusable: each load after the
    first opens the checkpoint anew (it may have been replaced since).
    """

    def __init__(self, path: str | os.PathLike[str], verify: bool = True) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.verify = verify
        self.files = reader.ShardFiles(self.path, verify)
        self._read = False  # ``files`` served a load already

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._reopen(os.fspath(checkpoint_id))

    def _reopen(self, path: str) -> None:
        self.files.close()
        self.path, self.files, self._read = path, reader.ShardFiles(path, self.verify), False

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), fmt.MANIFEST_FILE))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._read:  # a later load (``dcp.load`` resets a reader only when given a checkpoint_id)
            self._reopen(self.path)
        self._read = True
        manifest = self.files.manifest
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for index, record in enumerate(manifest.tensors):
            fqn = _fqn(record.path)
            pieces = record.chunks if record.chunks is not None else [
                {"offsets": [0] * len(record.shape), "shape": record.shape}
            ]
            chunks = []
            for piece in pieces:
                offsets = torch.Size(piece["offsets"])
                chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(piece["shape"])))
                storage[MetadataIndex(fqn, offsets)] = (index, piece if record.chunks is not None else None)
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(record.dtype)),
                size=torch.Size(record.shape),
                chunks=chunks,
            )
        return Metadata(state_dict_metadata=state, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            index, piece = self._storage[item.storage_index]
            source = self.files.piece(index, piece)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.shape != source.shape:
                raise RuntimeError(f"{self.path}: piece {item.storage_index} has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
            target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future


def load_sharded(
    path: str | os.PathLike[str],
    targets: dict[str, Any],
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    verify: bool = True,
    skip: Collection[str] = (),
) -> dict[str, Any]:
    """The checkpoint dict at ``path``, with the tensors at the key paths of ``targets`` loaded in
    place into those (sharded) tensors, resharding as needed; every other tensor comes back whole.

    ``targets`` mirrors the checkpoint's top level, e.g. ``{"state_dict": model_state_dict,
    "optimizer_states": [optimizer_state_dict]}`` from DCP's ``get_model_state_dict`` /
    ``get_optimizer_state_dict``. Top-level keys in ``skip`` are left out, their files unread
    (e.g. optimizer states when only evaluating). Runs no collective: each rank reads the pieces
    it needs.
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    storage = ShardedStorageReader(path, verify)
    _, found = encode_checkpoint(targets, stored)
    wanted = {_fqn(p): t for t, _, p in found}
    saved = {_fqn(r.path) for r in storage.files.manifest.tensors}
    missing = sorted(k for k in wanted if k not in saved)
    if missing and strict:
        raise KeyError(
            f"{path}: the checkpoint has no tensors for {len(missing)} key(s) of the live state, e.g."
            f" {', '.join(missing[:3])}. Load with strict=False to keep their current values."
        )
    present = {k: v for k, v in wanted.items() if k in saved}
    files = storage.files
    try:
        with warnings.catch_warnings():  # no_dist=True is the point: each rank loads its own pieces
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(present, storage_reader=storage, planner=DefaultLoadPlanner(flatten_state_dict=False), no_dist=True)
        records = files.manifest.tensors
        keys = [_fqn(r.path) for r in records]
        unread = torch.empty(0)  # stands in for a skipped tensor until its key is dropped

        def supplied(index: int) -> torch.Tensor | None:
            return unread if records[index].path[:1] and records[index].path[0] in skip else present.get(keys[index])

        checkpoint = files.load_tree(weights_only, supplied)
        for key in skip:
            checkpoint.pop(key, None)
        return checkpoint
    finally:
        files.close()


__all__ = ["ShardedStorageReader", "is_sharded_tensor", "load_sharded", "stored"]
