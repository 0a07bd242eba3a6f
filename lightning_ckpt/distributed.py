"""Multi-rank checkpoints: every rank writes its own part, rank 0 commits the whole.

Saving (``plan_part``): the checkpoint dict of every rank is encoded into the same JSON tree.
Its tensors are cut into pieces by DCP's own save planner (``DefaultSavePlanner`` gives each
DTensor's or ShardedTensor's local chunk with its global offsets); each piece is written by
exactly one of the ranks that hold it:

* a piece of a sharded tensor held by one rank is written by that rank;
* a piece held by several ranks (a plain tensor in DDP, a DTensor replicated along a mesh
  dimension) goes to the least-loaded of its holders, every rank running the same greedy
  assignment over the same pieces in the same order, so they agree without talking.

No collective runs per save. Ranks signal completion through the filesystem and rank 0 commits
(``parts.write_part``). Loading: ``reader`` assembles whole tensors from the pieces (one process,
any world size); ``load_sharded`` reshards into a live model and optimizers through DCP's
``DefaultLoadPlanner`` with ``ShardedStorageReader`` serving our files.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.futures import Future

from lightning_ckpt import manifest as fmt
from lightning_ckpt import reader
from lightning_ckpt.plan import (
    Found,
    Plan,
    Stable,
    dtype_from_name,
    dtype_name,
    encode_checkpoint,
    is_stored_tensor,
    plan_tensors,
    tensor_name,
)


def _stored(value: torch.Tensor) -> bool:
    """Tensors stored as bytes: plain ones, and the local pieces of DTensors and ShardedTensors."""
    return isinstance(value, DTensor) or _is_sharded_tensor(value) or is_stored_tensor(value)


def _is_sharded_tensor(value: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def _holders(value: torch.Tensor, rank: int, world_size: int) -> tuple[int, ...]:
    """The global ranks that hold the same local piece of ``value`` as this rank."""
    if _is_sharded_tensor(value):
        group = getattr(value, "_process_group", None)
        sharded_over = dist.get_world_size(group) if dist.is_initialized() else 1
        if sharded_over != world_size:  # replicas elsewhere hold the same pieces: which one writes?
            raise ValueError(
                f"cannot save a ShardedTensor sharded over {sharded_over} of the {world_size} ranks (FSDP's"
                " HYBRID_SHARD without a device mesh): its replicas' pieces would be written more than once."
                " HINT: pass `device_mesh=(replicas, shards)` to `ShardedFSDPStrategy`, whose state dicts then hold"
                " DTensors, which are saved once."
            )
        return (rank,)
    if not isinstance(value, DTensor):
        return tuple(range(world_size))  # a plain tensor: replicated (every rank saves the same dict)
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return ()
    index: list[Any] = []
    for dim, placement in enumerate(value.placements):
        if isinstance(placement, Replicate):
            index.append(slice(None))
        elif isinstance(placement, Shard):
            index.append(coordinate[dim])
        else:
            raise ValueError(
                f"cannot save a DTensor with placement {placement} (only Shard and Replicate hold final"
                " values); redistribute it before saving"
            )
    return tuple(sorted(int(r) for r in mesh.mesh[tuple(index)].flatten().tolist()))


@dataclass(frozen=True)
class PartPlan:
    """This rank's share of a save, in the terms of ``parts.Part``."""

    plan: Plan  # this rank's shards (file names tagged with the rank)
    tree: Any  # the checkpoint dict's JSON tree: the same on every rank, written by rank 0
    pieces: list[dict[str, Any]]  # what this rank writes: tensor id, blob, offsets, shape
    tensors: list[dict[str, Any]]  # every tensor of the checkpoint (whole shape), in tree order
    layout: str  # ``layout_digest(tensors)``: rank 0 refuses parts whose layout differs from its own


def plan_part(
    checkpoint: dict[Any, Any], rank: int, world_size: int, max_shard_size: int, stable: Stable | None = None
) -> PartPlan:
    """This rank's share of a multi-rank save of ``checkpoint`` (see the module docstring);
    ``stable``: see ``plan.plan_tensors``."""
    tree, found = encode_checkpoint(checkpoint, _stored)
    flat = {str(i): t for i, (t, _, _) in enumerate(found)}
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    planner.set_up_planner(flat, None, rank == 0)
    local: SavePlan = planner.create_local_plan()
    load: dict[tuple[int, ...], dict[int, int]] = {}
    # Pieces only this rank holds, and pieces it writes for several holders, go to different
    # files: a rank loading its own shards then never reads (and hashes) another rank's big file
    # for a replicated scalar such as an optimizer's step.
    owned: dict[bool, Found] = {False: [], True: []}
    pieces: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    whole_of: dict[bool, list[torch.Tensor]] = {False: [], True: []}  # the tensor each owned piece is cut from
    for item in local.items:  # in state-dict order: the same order on every rank
        index = int(item.index.fqn)
        value, component, path = found[index]
        assert item.tensor_data is not None
        chunk = item.tensor_data.chunk
        nbytes = chunk.sizes.numel() * torch.empty((), dtype=value.dtype).element_size()
        if nbytes == 0:
            continue
        holders = _holders(value, rank, world_size)
        loads = load.setdefault(holders, dict.fromkeys(holders, 0))
        owner = min(holders, key=lambda r: (loads[r], r))
        loads[owner] += nbytes
        if owner != rank:
            continue
        offsets = list(chunk.offsets)
        whole = list(chunk.sizes) == list(value.shape)
        name = tensor_name(component, path) + ("" if whole else "@" + ",".join(map(str, offsets)))
        shared = len(holders) > 1
        owned[shared].append((planner.resolve_data(item), component, (path[0], name)))
        whole_of[shared].append(value)
        pieces[shared].append({"id": index, "component": component, "offsets": offsets, "shape": list(chunk.sizes)})
    plans = [
        plan_tensors(
            owned[shared], max_shard_size, file_tag=f"rank{rank:05d}" + ("-shared" if shared else ""), stable=stable
        )
        for shared in (False, True)
    ]
    plan = Plan(
        tree=None,
        tensors=plans[0].tensors + plans[1].tensors,
        shards=plans[0].shards + plans[1].shards,
        components=tuple(dict.fromkeys(plans[0].components + plans[1].components)),
    )
    # Pieces of DTensors and ShardedTensors: incremental saves follow the whole tensor's version.
    whole_of_blob = {
        (spec.component, spec.blob): value
        for spec, value in zip(plan.tensors, whole_of[False] + whole_of[True])
        if not is_stored_tensor(value)
    }
    if whole_of_blob:
        plan = replace(plan, shards=tuple(
            replace(s, blobs=tuple(replace(b, piece_of=whole_of_blob.get((b.component, b.name))) for b in s.blobs))
            for s in plan.shards
        ))
    written = pieces[False] + pieces[True]
    for piece, spec in zip(written, plan.tensors):
        piece["blob"] = spec.blob
        if spec.byte_offset is not None:
            piece.update(byte_offset=spec.byte_offset, stride=list(spec.stride or ()))
    tensors = [
        {
            "component": component,
            "path": [k if type(k) in (str, int) else repr(k) for k in path],
            "dtype": dtype_name(value.dtype),
            "shape": list(value.shape),
            "device": str(_local(value).device),
            "requires_grad": value.requires_grad,
            "parameter": isinstance(value, torch.nn.Parameter),
        }
        for value, component, path in found
    ]
    return PartPlan(plan, tree, written, tensors, layout_digest(tensors))


def layout_digest(tensors: list[dict[str, Any]]) -> str:
    """What every rank of a save must agree on: each tensor's name, dtype, shape and kind. Not its
    device: rank k's shards live on ``cuda:k`` (the manifest records rank 0's)."""
    return fmt.digest(json.dumps([{k: v for k, v in t.items() if k != "device"} for t in tensors], sort_keys=True).encode())


def _local(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.to_local()
    if _is_sharded_tensor(value):
        shards = value.local_shards()  # type: ignore[attr-defined]
        return shards[0].tensor if shards else torch.empty(0)
    return value


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
    _, found = encode_checkpoint(targets, _stored)
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


__all__ = ["ShardedStorageReader", "load_sharded", "plan_part"]
