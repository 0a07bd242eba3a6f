"""Multi-rank saves: which rank writes which piece of a checkpoint (``plan_part``).

The checkpoint dict of every rank is encoded into the same JSON tree. Its tensors are cut into
pieces by DCP's own save planner (``DefaultSavePlanner`` gives each DTensor's or ShardedTensor's
local chunk with its global offsets); each piece is written by exactly one of the ranks that hold
it:

* a piece of a sharded tensor held by one rank is written by that rank;
* a piece held by several ranks (a plain tensor in DDP, a DTensor replicated along a mesh
  dimension) goes to the least-loaded of its holders, every rank running the same greedy
  assignment over the same pieces in the same order, so they agree without talking.

No collective runs per save. Ranks signal completion through the filesystem and rank 0 commits
(``store.parts.write_part``). Loading them back: ``format.dcp``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.dcp import is_sharded_tensor, stored
from lightning_ckpt.format.plan import (
    Found,
    Plan,
    Stable,
    dtype_name,
    encode_checkpoint,
    is_stored_tensor,
    plan_tensors,
    tensor_name,
)


def _holders(value: torch.Tensor, rank: int, world_size: int) -> tuple[int, ...]:
    """The global ranks that hold the same local piece of ``value`` as this rank."""
    if is_sharded_tensor(value):
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
    tree, found = encode_checkpoint(checkpoint, stored)
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
    if is_sharded_tensor(value):
        shards = value.local_shards()  # type: ignore[attr-defined]
        return shards[0].tensor if shards else torch.empty(0)
    return value


__all__ = ["PartPlan", "layout_digest", "plan_part"]
