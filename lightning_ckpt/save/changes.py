"""Incremental saves: which shard files of a save provably hold the same bytes as a file of the
previous save this process committed to the same folder (how such a file is reused:
``store.reuse``).

The rule (no guessing; when in doubt, write): a shard file is reused only if it would hold
exactly the blobs (names, dtypes, shapes, order) of a file of that previous save, and every blob
comes from the same tensor state as then:

* the same storage: a weak reference to the storage object must still give that very object
  (``param.data = ...`` swaps the storage; a freed storage whose address a new one took fails
  here, as the reference died with the old one);
* the same device, storage offset, shape, stride and dtype;
* the same ``_version`` counter, which every in-place change made through PyTorch bumps
  (optimizer steps, ``mul_`` under ``no_grad``, ``copy_``, ``load_state_dict``), on the tensor and
  on every view sharing its storage.

``requires_grad=False`` is never taken as proof. Fused optimizer kernels (``fused=True``) update
parameters and state without bumping their counters (torch 2.13): a post-step hook on every
optimizer bumps them (``track_optimizer_steps``). What the counter still cannot see are writes
that bypass PyTorch's autograd bookkeeping outside an optimizer step (through ``tensor.data``,
``numpy()``, DLPack, a custom kernel's raw pointer, an optimizer that is no
``torch.optim.Optimizer``, a ``torch.distributed`` collective into the tensor such as
``dist.broadcast(t)``): code that changes saved tensors that way saves with ``incremental=False``.
Blobs without a trackable state (views spanning several tensors, inference tensors) are always
written.

``Tracker`` lives in the training process (one per plugin: a new process or plugin starts
empty, so its first save writes everything).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import increment_version
from torch.optim.optimizer import register_optimizer_step_post_hook

from lightning_ckpt import remote
from lightning_ckpt.format.plan import Blob, Plan, Shard
from lightning_ckpt.save.job import Prepared, commit_dir_of
from lightning_ckpt.store.reuse import Reused, StoredFile, file_id

# What a shard file holds, up to the bytes: its component and each blob's name, dtype, shape
# and size in file order. Equal keys mean byte-identical safetensors headers.
ShardKey = tuple[str, tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]]


@dataclass(frozen=True, slots=True, eq=False)
class TensorState:
    """The identity and version of a blob's source tensor at a save (see the module docstring)."""

    storage: weakref.ref[torch.UntypedStorage]
    device: str
    data_ptr: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    version: int | tuple[int, int]  # a DTensor piece's: (the DTensor's, its local shard's)

    def same(self, other: TensorState) -> bool:
        """Do both states provably describe the same bytes? (The storage must still be alive.)"""
        storage = self.storage()
        return (
            storage is not None
            and storage is other.storage()
            and (self.device, self.data_ptr, self.offset, self.shape, self.stride, self.dtype, self.version)
            == (other.device, other.data_ptr, other.offset, other.shape, other.stride, other.dtype, other.version)
        )


def tensor_state(blob: Blob) -> TensorState | None:
    """The state of ``blob``'s source, or ``None`` when it cannot be tracked (always written)."""
    source, whole = blob.source, blob.piece_of
    if source is None or blob.name.endswith(".__span__"):
        return None  # a span is a fresh view: its version counter does not follow the tensors in it
    if type(source) not in (torch.Tensor, torch.nn.Parameter) or source.layout != torch.strided:
        return None
    # A DTensor's in-place ops run on its local shard below autograd: only the DTensor's own
    # counter moves (shared with its ``detach()``-ed state-dict copies). A wrapper made afresh
    # for the save (``DTensor.from_local``) has a counter of its own that nothing ever bumped
    # (version 0): no proof. A ShardedTensor's shards have no such counter: always written.
    if whole is not None and (type(whole).__name__ != "DTensor" or whole._version == 0):
        return None
    try:
        version = source._version if whole is None else (whole._version, source._version)
        storage = source.untyped_storage()
        return TensorState(
            weakref.ref(storage),
            str(source.device),
            storage.data_ptr(),
            source.storage_offset(),
            tuple(source.shape),
            tuple(source.stride()),
            source.dtype,
            version,
        )
    except (RuntimeError, TypeError):  # inference tensors keep no version counter; exotic storages
        return None


def shard_key(shard: Shard) -> ShardKey:
    return shard.component, tuple((b.name, b.dtype, tuple(b.shape), b.nbytes) for b in shard.blobs)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The tensor states of every shard of a plan, taken when the save was planned."""

    shards: dict[str, tuple[ShardKey, tuple[TensorState | None, ...]]]  # filename -> key, states

    @classmethod
    def of(cls, plan: Plan) -> Snapshot:
        return cls({s.filename: (shard_key(s), tuple(tensor_state(b) for b in s.blobs)) for s in plan.shards})


@dataclass
class _Record:
    """The latest committed save into one folder: its shard files, by what they hold."""

    target: str  # a local directory, or the URL of a remote save committed in a spool folder
    files: dict[ShardKey, tuple[StoredFile, tuple[TensorState | None, ...]]]
    # A multi-rank save's shared folder: a rank's part is durable there before rank 0 commits it.
    part_folder: str | None = None
    url: str | None = None  # a remote save's URL (published: its objects can be copied on the server)


@dataclass
class Tracker:
    """What this process last committed into each folder, to reuse unchanged files from (see
    the module docstring). Training thread only; the savers call it under the plugin's lock.

    Call order per save: ``begin`` (the snapshot of its tensors, and what it may take from the
    latest committed save), then ``committed`` once it is durable, or ``clear`` when a save
    failed (nothing is reused until a save commits whole again). Saves commit in the order they
    began, so the last ``committed`` call for a folder is its latest checkpoint.
    """

    _records: dict[str, _Record] = field(default_factory=dict)
    copies: bool = False  # reused files are copied, not linked (``Reused.copy``)

    def begin(self, plan: Plan, target: str) -> tuple[dict[str, Reused], Snapshot]:
        """The snapshot of ``plan`` now, and ``reuse`` for a save of it to ``target`` (a local
        directory, or a URL for a remote save committed in a spool folder)."""
        snapshot = Snapshot.of(plan)
        return self.reuse(snapshot, target), snapshot

    def reuse(self, snapshot: Snapshot, target: str) -> dict[str, Reused]:
        """The shard files of a save to ``target`` (absolute) that the latest checkpoint committed
        into its folder holds already, with unchanged tensors: new filename -> where it is."""
        record = self._records.get(os.path.dirname(target))
        if record is None:
            return {}
        reuse: dict[str, Reused] = {}
        for filename, (key, states) in snapshot.shards.items():
            found = record.files.get(key)
            if found is None:
                continue
            stored, old_states = found
            if not states or not all(
                new is not None and old is not None and new.same(old) for new, old in zip(states, old_states)
            ):
                continue  # a changed blob, or one that cannot be tracked: write the file
            remote = None if record.url is None else (record.url, stored.filename)
            if record.url == record.target:  # on the server only: copied there when published
                reuse[filename] = Reused((), stored.size, stored.digest, None, remote, self.copies)
                continue
            folders = (record.target,) + ((record.part_folder,) if record.part_folder else ())
            sources = tuple(os.path.join(folder, stored.filename) for folder in folders)
            if stored.id is None or all(file_id(source) != stored.id for source in sources):
                continue  # removed or replaced since (by someone else): write it
            reuse[filename] = Reused(sources, stored.size, stored.digest, stored.id, remote, self.copies)
        return reuse

    def committed(
        self,
        snapshot: Snapshot,
        target: str,
        stored: Iterable[StoredFile],
        part_folder: str | None = None,
        url: str | None = None,
    ) -> None:
        """The save of ``snapshot`` committed ``stored`` at ``target``: the latest in its folder.
        ``part_folder``: a multi-rank save's, where this rank's files are until rank 0 commits;
        ``url``: a remote save's URL, once published."""
        by_name = {s.filename: s for s in stored}
        files = {
            key: (by_name[filename], states)
            for filename, (key, states) in snapshot.shards.items()
            if filename in by_name
        }
        self._records[os.path.dirname(target)] = _Record(target, files, part_folder, url)

    def forget(self, path: str) -> None:
        """``path`` (a checkpoint) is being removed: never reuse from it."""
        for folder, record in list(self._records.items()):
            if record.target == path:
                del self._records[folder]

    def clear(self) -> None:
        self._records.clear()


def track_optimizer_steps() -> None:
    """Register ``_after_optimizer_step`` (once per process, never removed: see
    ``hooks``). Called by every plugin with incremental saves on."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_after_optimizer_step)


_step_hook: Any = None


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Every optimizer's post-step hook: bump the version counter of each parameter it stepped
    (one with a gradient) and of each tensor of its state. Fused kernels (``fused=True`` in
    torch's optimizers, ``ChunkedAdamW``'s, other libraries' raw-pointer kernels) change them in
    place without bumping it, and the change rule reads nothing else. A bump the step made itself
    already changes nothing: the rule only asks whether the counter moved. An optimizer whose
    ``bumps_parameter_versions`` is true (``ChunkedAdamW``: it compares the counters to tell
    outside writes, and steps in the background after this hook ran) bumps the counters of its
    parameters and state itself, when it writes them: nothing is read here (its ``state``, read
    from outside, waits for the step)."""
    if getattr(optimizer, "bumps_parameter_versions", False):
        return
    stepped = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    state = [v for p in stepped for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    tensors = [t for t in stepped + state if not t.is_inference()]
    if tensors:
        increment_version(tensors)


def frozen_keys(module: torch.nn.Module, normalize: Callable[[str], str] = lambda k: k) -> frozenset[str]:
    """The state-dict keys of ``module`` that rarely change: parameters with ``requires_grad=False``
    and the buffers of modules in eval mode whose own parameters are all frozen. A hint for the
    planner's layout only (see ``plan.plan_tensors``): reuse is decided by ``Tracker`` alone."""
    keys = set()
    for prefix, sub in module.named_modules():
        own = list(sub.named_parameters(recurse=False))
        dot = f"{prefix}." if prefix else ""
        keys.update(normalize(dot + name) for name, p in own if not p.requires_grad)
        if not sub.training and all(not p.requires_grad for _, p in own):
            keys.update(normalize(dot + name) for name, _ in sub.named_buffers(recurse=False))
    return frozenset(keys)


def stable_predicate(
    keys: frozenset[str], normalize: Callable[[str], str] = lambda k: k
) -> Callable[[str, tuple[Any, ...]], bool]:
    """``plan.Stable`` for the model tensors named in ``keys`` (a Lightning checkpoint's
    ``state_dict``, or Fabric's ``model``), state-dict keys compared after ``normalize``."""

    def stable(component: str, path: tuple[Any, ...]) -> bool:
        return (
            len(path) == 2 and path[0] in ("state_dict", "model") and isinstance(path[1], str)
            and normalize(path[1].split("@", 1)[0]) in keys  # "key@0,0": a multi-rank save's piece
        )

    return stable


# An incremental save's ticket, for ``Tracker.committed``: its snapshot, the checkpoint it commits
# (a local directory; a URL when committed in a spool), a multi-rank save's part folder, its URL.
Ticket = tuple[Snapshot, str, "str | None", "str | None"]


def begin_incremental(
    tracker: Tracker | None, prepared: Prepared, path: str, options: remote.RemoteOptions
) -> tuple[dict[str, Reused], Ticket | None]:
    """The shard files a save to ``path`` may reuse (see ``incremental.Tracker``) and its ticket;
    none for a plugin with ``incremental=False``. A remote save committed in a spool folder is
    tracked by its URL (its reused files stay on the server)."""
    if tracker is None:
        return {}, None
    url = path if remote.is_remote(path) else None
    target = tracked_name(path, options)
    reuse, snapshot = tracker.begin(prepared.plan, target)
    return reuse, (snapshot, target, None if prepared.part is None else prepared.part.folder, url)


def tracked_name(path: str, options: remote.RemoteOptions) -> str:
    """The name the incremental tracker knows the checkpoint at ``path`` by: its URL when it is
    committed in a spool folder (its files stay on the server), else its absolute commit folder."""
    if remote.is_remote(path) and options.local_dir is None:
        return path
    return os.path.abspath(commit_dir_of(path, options))
