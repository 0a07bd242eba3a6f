"""Multi-rank saves on disk: this rank's part, the meeting point, the merge and stale-part clean-up.

Every rank writes its shards into one shared temporary directory (``part_folder``) beside the
target and publishes ``rank-NNNNN.json`` once they are durable (or ``rank-NNNNN.failed``); rank 0
waits for every rank's file (the meeting point: ranks signal through the filesystem, so no
collective waits on a write), merges them into the manifest of the whole (format v3,
``SHARDED_FORMAT_VERSION``) and commits it with ``writer.commit``. ``distributed.py`` plans the
parts (which rank writes which piece); this module writes them. Runs in the training process
(synchronous saves) or in the writer process (async). Imports ``writer``, ``plan``, ``manifest``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.plan import Blob, Plan
from lightning_ckpt.store.commit import (
    PART_MARKER,
    ImageSource,
    WriteResult,
    commit,
    prepare_target,
    remove_tree,
    write_error,
    write_shards,
    write_small_files,
)
from lightning_ckpt.store.reuse import Reused, stored_files
from lightning_ckpt.store.shards import ShardWriter, fsync_dir, write_small

DEFAULT_PART_TIMEOUT = 1800.0  # seconds rank 0 waits for the other ranks' parts (NCCL's default timeout)
_PART_POLL_SECONDS = 0.02


@dataclass(frozen=True)
class Part:
    """This rank's share of a multi-rank save.

    ``folder`` is the shared temporary directory, ``.<name>.lckpt-part-<run token>-<save number>``
    beside the target: the same on every rank (the token is agreed once per run). ``pieces`` say
    which stored blob holds which part of which tensor (``{"id", "blob", "offsets", "shape"}``
    plus ``byte_offset``/``stride`` for views); ``tensors`` is the table of every tensor of the
    checkpoint (equal on every rank; rank 0 writes it), ``layout`` its digest.
    """

    rank: int
    world_size: int
    folder: str
    pieces: list[dict[str, Any]]
    tensors: list[dict[str, Any]]
    layout: str
    timeout: float


def part_folder(target: str, token: str, number: int) -> str:
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}{PART_MARKER}{token}-{number}")


def _part_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _publish(folder: str, name: str, body: dict[str, Any]) -> None:
    """Make ``name`` appear in ``folder`` complete or not at all (write, fsync, rename, fsync dir)."""
    staging = os.path.join(folder, f".{name}.tmp")
    write_small(staging, json.dumps(body).encode())
    os.rename(staging, os.path.join(folder, name))
    fsync_dir(folder)


def write_part(
    plan: Plan,
    target: str | os.PathLike[str],
    shard_writer: ShardWriter,
    part: Part,
    *,
    metadata: bytes,
    created_by: dict[str, str],
    global_step: int | None = None,
    epoch: int | None = None,
    images: ImageSource | None = None,
    reuse: dict[str, Reused] | None = None,
) -> WriteResult:
    """Write this rank's shards of a multi-rank save; on rank 0, then commit the whole checkpoint.
    ``reuse``: this rank's shard files taken from an earlier checkpoint (see ``write_shards``).

    Every rank publishes ``rank-NNNNN.json`` (its files and pieces) once its shards are durable,
    or ``rank-NNNNN.failed`` with its error. Rank 0 waits for every rank's file (at most
    ``part.timeout`` seconds), writes the tensor table, ``metadata.json`` and ``manifest.json``,
    and renames the directory into place: until then nothing loads it, and a save that any rank
    failed is never committed (the previous checkpoint stays).
    """
    start = time.perf_counter()
    target, parent = prepare_target(target, replaces=part.rank == 0)
    if part.rank == 0:
        clean_stale_parts(parent, keep=os.path.basename(part.folder).rsplit("-", 1)[0])
    try:
        os.makedirs(part.folder, exist_ok=True)  # any rank may get here first
        direct = shard_writer.use_direct(parent)
        files, reused = write_shards(plan, part.folder, shard_writer, direct, images, reuse)
        stored = stored_files(part.folder, files, plan)
        file_of_blob = plan.file_of_blob()
        pieces = [{**p, "file": file_of_blob[(p["component"], p["blob"])]} for p in part.pieces]
        model_blobs = [[b.name, s.filename, b.nbytes] for s in plan.shards if s.component == "model" for b in s.blobs]
        _publish(
            part.folder,
            _part_file(part.rank),
            {
                "rank": part.rank,
                "layout": part.layout,
                "files": {name: [r.size, r.digest] for name, r in files.items()},
                "pieces": pieces,
                "model_blobs": model_blobs,
                "reused_bytes": sum(files[name].size for name in reused),
            },
        )
    except BaseException as err:
        if part.rank != 0:
            with contextlib.suppress(OSError):
                _publish(part.folder, f"rank-{part.rank:05d}.failed", {"error": f"{type(err).__name__}: {err}"})
        else:
            remove_tree(part.folder)
        error = write_error(err, target, f"Rank {part.rank} writing its part of checkpoint")
        if error is None:
            raise
        raise error from err
    nbytes = sum(r.size for r in files.values())
    reused_bytes = sum(files[name].size for name in reused)
    if part.rank != 0:
        seconds = time.perf_counter() - start
        return WriteResult(
            path=target, nbytes=nbytes, seconds=seconds, files=len(files), direct_io=direct, reused_bytes=reused_bytes, stored=stored
        )
    try:
        manifest, reused_bytes = _merge_parts(part, target, metadata, created_by, global_step, epoch)
        data = manifest.to_bytes()
        write_small(os.path.join(part.folder, fmt.MANIFEST_FILE), data)
        fsync_dir(part.folder)
        commit(part.folder, target)
    except BaseException as err:
        remove_tree(part.folder)
        error = write_error(err, target)
        if error is None:
            raise
        raise error from err
    total = manifest.total_bytes + len(data)
    seconds = time.perf_counter() - start
    return WriteResult(
        path=target, nbytes=total, seconds=seconds, files=len(manifest.files) + 1, direct_io=direct, reused_bytes=reused_bytes, stored=stored
    )


def _wait_for_parts(part: Part, target: str) -> list[dict[str, Any]]:
    """Every rank's published part, in rank order (rank 0 only)."""
    deadline = time.monotonic() + part.timeout
    bodies: dict[int, dict[str, Any]] = {}
    while len(bodies) < part.world_size:
        for rank in range(part.world_size):
            if rank in bodies:
                continue
            failed = os.path.join(part.folder, f"rank-{rank:05d}.failed")
            if os.path.exists(failed):
                with open(failed, "rb") as f:
                    raise RuntimeError(f"rank {rank} could not write its part ({json.loads(f.read())['error']})")
            with contextlib.suppress(FileNotFoundError):
                with open(os.path.join(part.folder, _part_file(rank)), "rb") as f:
                    bodies[rank] = json.loads(f.read())
        if len(bodies) < part.world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(part.world_size)) - set(bodies))
                raise RuntimeError(
                    f"ranks {missing} did not finish their parts of {target!r} within {part.timeout:.0f} s. Every"
                    " rank must write to the same shared filesystem path; a rank that died or is still writing"
                    " leaves the save uncommitted. Raise `ShardedCheckpointIO(part_timeout=...)` for slow storage."
                )
            time.sleep(_PART_POLL_SECONDS)
    return [bodies[rank] for rank in range(part.world_size)]


def _merge_parts(
    part: Part,
    target: str,
    metadata: bytes,
    created_by: dict[str, str],
    global_step: int | None,
    epoch: int | None,
) -> tuple[fmt.Manifest, int]:
    """Rank 0: the manifest of the whole checkpoint, from every rank's published part, and the
    bytes the ranks reused from earlier checkpoints."""
    bodies = _wait_for_parts(part, target)
    files: dict[str, fmt.FileRecord] = {}
    pieces: dict[int, list[dict[str, Any]]] = {}
    model_blobs: list[tuple[Blob, str]] = []
    for body in bodies:
        if body["layout"] != part.layout:
            raise RuntimeError(
                f"rank {body['rank']} saved a different set of tensors than rank 0 (names, shapes or dtypes"
                " differ). Every rank must save the same checkpoint structure."
            )
        for name, (size, digest) in body["files"].items():
            files[name] = fmt.FileRecord(size, digest, body["rank"])
        for piece in body["pieces"]:
            pieces.setdefault(piece["id"], []).append(piece)
        model_blobs += [
            (Blob("model", name, None, torch.uint8, (nbytes,), nbytes), filename) for name, filename, nbytes in body["model_blobs"]
        ]
    for name, record in write_small_files(part.folder, metadata, model_blobs).items():
        files[name] = fmt.FileRecord(record.size, record.digest, 0)
    for rank in range(part.world_size):
        os.remove(os.path.join(part.folder, _part_file(rank)))
    records = []
    for index, tensor in enumerate(part.tensors):
        found = sorted(pieces.get(index, []), key=lambda p: p["offsets"])
        covered = sum(math.prod(p["shape"]) for p in found)
        if covered != math.prod(tensor["shape"]):
            raise RuntimeError(
                f"the saved pieces of tensor {tensor['path']!r} cover {covered} of its {math.prod(tensor['shape'])}"
                " elements; every element must be written by exactly one rank"
            )
        first = found[0] if found else {"file": fmt.METADATA_FILE, "blob": ""}
        whole = len(found) == 1 and first["shape"] == tensor["shape"]
        views = {k: first.get(k) for k in ("byte_offset", "stride")} if whole else {}
        chunks = None if whole else [
            {k: p[k] for k in ("file", "blob", "offsets", "shape", "byte_offset", "stride") if p.get(k) is not None}
            for p in found
        ]
        records.append(fmt.TensorRecord(**tensor, file=first["file"], blob=first["blob"], chunks=chunks, **views))
    components: dict[str, list[str]] = {}
    for record in records:
        for name in [record.file] + [c["file"] for c in record.chunks or ()]:
            if name != fmt.METADATA_FILE and name not in components.setdefault(record.component, []):
                components[record.component].append(name)
    manifest = fmt.Manifest(
        files=files,
        components={c: sorted(names) for c, names in components.items()},
        tensors=records,
        created_by=created_by,
        global_step=global_step,
        epoch=epoch,
        format_version=fmt.SHARDED_FORMAT_VERSION,
        model_index_file=fmt.MODEL_INDEX_FILE if model_blobs else None,
        extra={"world_size": part.world_size},
    )
    return manifest, sum(body.get("reused_bytes", 0) for body in bodies)


def clean_stale_parts(folder: str, keep: str) -> list[str]:
    """Remove the shared temporary directories of multi-rank saves from other runs (crashed or
    killed saves); ``keep`` is this run's prefix (``.<name>.lckpt-part-<token>``)."""
    token = keep.split(PART_MARKER, 1)[-1]
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if name.startswith(".") and PART_MARKER in name and name.split(PART_MARKER, 1)[1].rsplit("-", 1)[0] != token:
                remove_tree(os.path.join(folder, name))
                removed.append(name)
    return removed
