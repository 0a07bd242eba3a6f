"""Pure planning: checkpoint dict -> JSON tree + tensor table + size-capped shards, and back.

Nothing here touches a disk or a process. ``make_plan`` splits a checkpoint into

* a JSON-serialisable *tree* (the whole dict, with every tensor replaced by ``{"$tensor": id}``),
* a table of :class:`TensorSpec` (one per tensor in the dict, in tree order),
* :class:`Blob` s (the contiguous byte runs actually written; tensors that overlap in memory share
  one blob, so tied weights are stored once and come back aliased), packed into :class:`Shard` s
  per *component* (the top-level key: ``state_dict`` -> ``model``, ``optimizer_states`` ->
  ``optimizer``, anything else under its own name; see ``component_names``).

``decode_tree`` is the inverse of the tree encoding.
"""

from __future__ import annotations

import base64
import io
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

MODEL_COMPONENT = "model"
OPTIMIZER_COMPONENT = "optimizer"
_COMPONENT_OF_KEY = {"state_dict": MODEL_COMPONENT, "optimizer_states": OPTIMIZER_COMPONENT}
_RESERVED_COMPONENTS = frozenset({MODEL_COMPONENT, OPTIMIZER_COMPONENT, "metadata", "manifest"})

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(value: int | str, argument: str = "max_shard_size") -> int:
    """``2_000_000_000``, ``"2GB"``, ``"512MiB"`` -> bytes. Raises ``ValueError`` naming ``argument``."""
    if isinstance(value, bool):
        raise ValueError(f"`{argument}` must be a byte count or a string like '2GB', got {value!r}.")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"`{argument}={value!r}` is not a size. Use bytes as an int or a string such as"
                f" '2GB', '500MB' or '512MiB'."
            )
        number = int(float(match.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ValueError(f"`{argument}` must be a byte count or a string like '2GB', got {type(value).__name__}.")
    if number <= 0:
        raise ValueError(f"`{argument}={value!r}` must be positive.")
    return number


def _reduce_by_fields(self: Any) -> tuple[Any, tuple[Any, ...]]:
    """Pickle a frozen slots dataclass as its constructor call: dataclasses' own ``__getstate__``
    looks its fields up per object, which was most of the time spent pickling a plan (every save
    sends one to the writer process)."""
    cls = type(self)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return cls, tuple(getattr(self, name) for name in names)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


@dataclass(frozen=True, slots=True)
class Blob:
    """A contiguous run of bytes stored under ``name`` in one shard file.

    ``source`` is a tensor whose (contiguous) bytes are the blob; it may live on any device.
    It is ``None`` in a plan handed to the writer process, which reads staged bytes instead.
    """

    component: str
    name: str
    source: torch.Tensor | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    # ``source`` is a piece of this tensor (a DTensor's or ShardedTensor's local shard), whose own
    # version counter is what in-place changes bump (see ``incremental.tensor_state``).
    piece_of: torch.Tensor | None = None

    __reduce__ = _reduce_by_fields


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the checkpoint dict: where it sits in the dict and how it is cut from its blob.

    ``byte_offset``/``stride`` are ``None`` when the tensor *is* its blob (the common case); set
    when it is a view into a blob shared with other tensors.
    """

    component: str
    path: tuple[Any, ...]
    blob: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str
    byte_offset: int | None = None
    stride: tuple[int, ...] | None = None
    requires_grad: bool = False
    parameter: bool = False

    __reduce__ = _reduce_by_fields


@dataclass(frozen=True, slots=True)
class Shard:
    component: str
    filename: str
    blobs: tuple[Blob, ...]  # in file order: descending element size, so every blob is aligned

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blobs)


@dataclass(frozen=True, slots=True)
class Plan:
    tree: Any
    tensors: tuple[TensorSpec, ...]
    shards: tuple[Shard, ...]
    components: tuple[str, ...]

    def file_of_blob(self) -> dict[tuple[str, str], str]:
        return {(s.component, b.name): s.filename for s in self.shards for b in s.blobs}

    def cuda_devices(self) -> set[torch.device]:
        """The CUDA devices its tensors live on (empty: every byte is in host memory)."""
        return {b.source.device for s in self.shards for b in s.blobs if b.source is not None and b.source.is_cuda}

    def without_data(self) -> Plan:
        """The same plan with no tensors and no tree: small, picklable, for the writer process."""
        shards = tuple(
            Shard(s.component, s.filename, tuple(Blob(b.component, b.name, None, b.dtype, b.shape, b.nbytes) for b in s.blobs))
            for s in self.shards
        )
        return Plan(None, self.tensors, shards, self.components)


# ----------------------------------------------------------------------------------------------
# Tree encoding (format v1). JSON natives stay as they are; everything else is a one-key tag.


def _qualname(obj_type: type) -> str:
    return f"{obj_type.__module__}.{obj_type.__qualname__}"


# Mapping types rebuilt by name on load (never imported from data: only these names are honoured).
_MAPPING_TYPES: dict[str, tuple[str, str]] = {
    "collections.OrderedDict": ("collections", "OrderedDict"),
    "lightning.fabric.utilities.data.AttributeDict": ("lightning.fabric.utilities.data", "AttributeDict"),
    "lightning_fabric.utilities.data.AttributeDict": ("lightning_fabric.utilities.data", "AttributeDict"),
}


def is_stored_tensor(value: torch.Tensor) -> bool:
    """Tensors written as raw bytes; anything exotic (sparse, quantized, meta, subclasses) is pickled."""
    return (
        type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.layout == torch.strided
        and not value.is_quantized
        and value.device.type != "meta"
    )


class _Encoder:
    def __init__(
        self,
        on_tensor: Callable[[torch.Tensor, tuple[Any, ...]], int],
        stores: Callable[[torch.Tensor], bool] = is_stored_tensor,
    ) -> None:
        self._on_tensor = on_tensor
        self._stores = stores

    def encode(self, value: Any, path: tuple[Any, ...]) -> Any:
        kind = type(value)
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, torch.Tensor) and self._stores(value):
            return {"$tensor": self._on_tensor(value, path)}
        if kind is list:
            return [self.encode(v, (*path, i)) for i, v in enumerate(value)]
        if kind is tuple:
            return {"$tuple": [self.encode(v, (*path, i)) for i, v in enumerate(value)]}
        if kind is dict and all(type(k) is str and not k.startswith("$") for k in value):
            return {k: self.encode(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, dict) and (kind is dict or _qualname(kind) in _MAPPING_TYPES):
            encoded: dict[str, Any] = {
                "$map": [[self.encode(k, path), self.encode(v, (*path, k))] for k, v in value.items()]
            }
            if kind is not dict:
                encoded["type"] = _qualname(kind)
                attrs = getattr(value, "__dict__", None)
                if attrs:
                    encoded["attrs"] = {a: self.encode(v, path) for a, v in attrs.items()}
            return encoded
        if kind is torch.Size:
            return {"$size": list(value)}
        if kind is torch.dtype:
            return {"$dtype": str(value).removeprefix("torch.")}
        if kind is torch.device:
            return {"$device": str(value)}
        if kind is complex:
            return {"$complex": [self.encode(value.real, path), self.encode(value.imag, path)]}
        if kind is bytes:
            return {"$bytes": base64.b64encode(value).decode("ascii")}
        if kind in (set, frozenset):
            return {"$" + kind.__name__: [self.encode(v, path) for v in value]}
        # Last resort, for values that have no data-only form (enums, dataclasses, namespaces, ...).
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return {"$pickle": base64.b64encode(buffer.getvalue()).decode("ascii"), "type": _qualname(kind)}


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from iter_tensors(v)


def format_key_path(path: Sequence[Any]) -> str:
    """``("optimizer_states", 0, "state")`` -> ``checkpoint['optimizer_states'][0]['state']``."""
    return "checkpoint" + "".join(f"[{k!r}]" for k in path)


def decode_tree(
    tree: Any,
    tensor: Callable[[int], torch.Tensor],
    unpickle: Callable[[bytes, tuple[Any, ...]], Any],
    path: tuple[Any, ...] = (),
) -> Any:
    """Inverse of the encoding. ``tensor(id)`` gives tensor ``id``; ``unpickle`` loads a ``$pickle``."""

    def dec(value: Any, at: tuple[Any, ...]) -> Any:
        if isinstance(value, list):
            return [dec(v, (*at, i)) for i, v in enumerate(value)]
        if not isinstance(value, dict):
            return value
        if len(value) >= 1 and next(iter(value)).startswith("$"):
            tag, payload = next(iter(value.items()))
            if tag == "$tensor":
                return tensor(payload)
            if tag == "$tuple":
                return tuple(dec(v, (*at, i)) for i, v in enumerate(payload))
            if tag == "$map":
                result = _new_mapping(value.get("type"))
                for k, v in payload:
                    key = dec(k, at)
                    result[key] = dec(v, (*at, key))
                for name, attr in value.get("attrs", {}).items():
                    setattr(result, name, dec(attr, at))
                return result
            if tag == "$float":
                return float(payload)
            if tag == "$size":
                return torch.Size(payload)
            if tag == "$dtype":
                return dtype_from_name(payload)
            if tag == "$device":
                return torch.device(payload)
            if tag == "$complex":
                return complex(payload[0], payload[1])
            if tag == "$bytes":
                return base64.b64decode(payload)
            if tag == "$set":
                return {dec(v, at) for v in payload}
            if tag == "$frozenset":
                return frozenset(dec(v, at) for v in payload)
            if tag == "$pickle":
                return unpickle(base64.b64decode(payload), at)
            raise ValueError(f"unknown tag {tag!r} at {format_key_path(at)}")
        return {k: dec(v, (*at, k)) for k, v in value.items()}

    return dec(tree, path)


def _new_mapping(type_name: str | None) -> dict[Any, Any]:
    if type_name is None:
        return {}
    module_name, attr = _MAPPING_TYPES.get(type_name, ("builtins", "dict"))
    try:
        import importlib

        return getattr(importlib.import_module(module_name), attr)()
    except ImportError:  # e.g. written with `lightning`, read with only `pytorch_lightning` installed
        return {}


def dtype_from_name(name: str) -> torch.dtype:
    """The ``torch.dtype`` a manifest names (the inverse of ``dtype_name``; also used by ``distributed``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------
# Storage deduplication: tensors whose bytes overlap become views of one blob.


def _byte_extent(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of ``t`` inside its storage."""
    size = t.element_size()
    start = t.storage_offset() * size
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * size


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def component_names(keys: Sequence[Any]) -> dict[Any, str]:
    """The component (shard file prefix) of each top-level key of a checkpoint dict.

    A Trainer checkpoint (one holding ``state_dict`` or ``optimizer_states``): those two are
    ``model`` and ``optimizer``, and every other key is named after itself, with ``_2``, ``_3``
    ... where that name is taken or reserved (a ``model`` key beside ``state_dict`` is
    ``model_2``). Any other dict (Fabric's ``{"model": ..., "optimizer": ...}``): every key is
    named after itself; only ``metadata`` and ``manifest`` are reserved. Names are for people
    and other tools only: loading follows the manifest, so checkpoints named by earlier rules
    (Fabric's ``model_2``) load unchanged.
    """
    trainer = any(key in _COMPONENT_OF_KEY for key in keys)
    reserved = _RESERVED_COMPONENTS if trainer else _RESERVED_COMPONENTS - set(_COMPONENT_OF_KEY.values())
    names: dict[Any, str] = {}
    taken: set[str] = set()
    for key in keys:
        if trainer and key in _COMPONENT_OF_KEY:
            name = _COMPONENT_OF_KEY[key]
        else:
            base = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(key)).strip("._-") or "part"
            name, n = base, 1
            while name in taken or name in reserved:
                n += 1
                name = f"{base}_{n}"
        names[key] = name
        taken.add(name)
    return names


def tensor_name(component: str, path: tuple[Any, ...]) -> str:
    """The stored name of the tensor at ``path`` (also how ``distributed`` names multi-rank pieces)."""
    # Model weights keep their state-dict key, so the shards read like any HF checkpoint.
    inner = path[1:]
    if component == MODEL_COMPONENT and len(inner) == 1 and isinstance(inner[0], str):
        return inner[0]
    return "/".join(str(k) for k in inner) or component


Found = list[tuple[torch.Tensor, str, tuple[Any, ...]]]  # (tensor, component, key path), in tree order


def encode_checkpoint(
    checkpoint: dict[Any, Any], stores: Callable[[torch.Tensor], bool] = is_stored_tensor
) -> tuple[Any, Found]:
    """The JSON tree of ``checkpoint`` (tensor ``i`` replaced by ``{"$tensor": i}``) and its tensors."""
    if not isinstance(checkpoint, dict):
        raise TypeError(f"a checkpoint must be a dict, got {type(checkpoint).__name__}")
    found: Found = []
    components = component_names(list(checkpoint))

    def on_tensor(t: torch.Tensor, path: tuple[Any, ...]) -> int:
        found.append((t, components[path[0]], path))
        return len(found) - 1

    encoder = _Encoder(on_tensor, stores)
    items: list[list[Any]] = []
    for key, value in checkpoint.items():
        items.append([encoder.encode(key, ()), encoder.encode(value, (key,))])
    encoded_tree: Any
    if all(type(k) is str and not k.startswith("$") for k in checkpoint):
        encoded_tree = dict(items)
    else:
        encoded_tree = {"$map": items}
    return encoded_tree, found


# Which tensors rarely change (``(component, key path) -> bool``): they get shards of their own.
Stable = Callable[[str, tuple[Any, ...]], bool]
STABLE_TAG = "stable"  # in the file names of those shards: ``model-stable-00001-of-00002.safetensors``
# Stable shards are cut smaller than the others, so that an in-place change of one frozen weight
# rewrites about what changed: each holds 1/STABLE_FILES of the component's stable bytes, at least
# STABLE_MIN_BYTES, at most ``max_shard_size``. A component's stable tensors then span at most
# ~STABLE_FILES files. Measured (docs/benchmarks.md): a 940 MB frozen base's first save took ~12%
# longer in files of 15 or 59 MB than in one file, none longer in files of 512 MiB.
STABLE_FILES = 16
STABLE_MIN_BYTES = 512 * 2**20


def stable_shard_size(stable_bytes: int, max_shard_size: int) -> int:
    """The cap of a component's stable shards, given its stable bytes (see ``STABLE_FILES``)."""
    return min(max_shard_size, max(STABLE_MIN_BYTES, -(-stable_bytes // STABLE_FILES)))


def make_plan(checkpoint: dict[Any, Any], max_shard_size: int, stable: Stable | None = None) -> Plan:
    """Split ``checkpoint`` into a tree, tensor specs, blobs and shards (no bytes are copied).
    ``stable``: see ``plan_tensors``."""
    tree, found = encode_checkpoint(checkpoint)
    return replace(plan_tensors(found, max_shard_size, stable=stable), tree=tree)


def plan_tensors(found: Found, max_shard_size: int, file_tag: str = "", stable: Stable | None = None) -> Plan:
    """Blobs and shards for ``found`` (a plan without a tree). ``file_tag`` goes into every shard
    file name (``model-<tag>-00001-of-00002.safetensors``).

    Blobs whose first tensor ``stable`` holds for (frozen weights: see ``incremental``) are packed
    into shards of their own, tagged ``stable``, after the component's other shards, so an
    incremental save can reuse those files whole while the rest changes; smaller ones
    (``stable_shard_size``), so that a frozen weight changed in place rewrites about what changed.
    Without any such blob the layout is exactly the one without ``stable``.
    """
    specs, blobs = _dedupe(found)
    used = list(dict.fromkeys(spec.component for spec in specs))
    steady: set[tuple[str, str]] = set()
    if stable is not None:
        first_path: dict[tuple[str, str], tuple[Any, ...]] = {}
        for spec in specs:
            first_path.setdefault((spec.component, spec.blob), spec.path)
        steady = {key for key, path in first_path.items() if stable(key[0], path)}
    stable_tag = f"{file_tag}-{STABLE_TAG}" if file_tag else STABLE_TAG
    shards = []
    for c in used:
        changing = [b for b in blobs if b.component == c and (c, b.name) not in steady]
        frozen = [b for b in blobs if b.component == c and (c, b.name) in steady]
        shards += _pack(c, changing, max_shard_size, file_tag)
        shards += _pack(c, frozen, stable_shard_size(sum(b.nbytes for b in frozen), max_shard_size), stable_tag)
    shards = tuple(shards)
    return Plan(tree=None, tensors=tuple(specs), shards=shards, components=tuple(used))


def _dedupe(found: list[tuple[torch.Tensor, str, tuple[Any, ...]]]) -> tuple[list[TensorSpec], list[Blob]]:
    """One blob per group of memory-overlapping tensors (per component); specs in ``found`` order."""
    # Group by (storage, device) and merge overlapping byte extents into clusters.
    by_storage: dict[tuple[str, int], list[int]] = {}
    for i, (t, _, _) in enumerate(found):
        if t.numel() > 0:
            by_storage.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(i)
    cluster_of: dict[int, list[int]] = {}
    for members in by_storage.values():
        members.sort(key=lambda i: _byte_extent(found[i][0]))
        cluster: list[int] = []
        cluster_end = -1
        for i in members:
            start, end = _byte_extent(found[i][0])
            if cluster and start < cluster_end and found[i][1] == found[cluster[0]][1]:
                cluster.append(i)
                cluster_end = max(cluster_end, end)
            else:
                cluster = [i]
                cluster_end = end
            cluster_of[i] = cluster

    names: set[tuple[str, str]] = set()

    def unique(component: str, name: str) -> str:
        candidate, n = name, 1
        while (component, candidate) in names:
            n += 1
            candidate = f"{name}#{n}"
        names.add((component, candidate))
        return candidate

    specs: list[TensorSpec] = []
    blobs: list[Blob] = []
    blob_of_cluster: dict[int, tuple[str, int]] = {}  # id(cluster) -> (blob name, cluster start byte)
    for i, (t, component, path) in enumerate(found):
        extra = {"requires_grad": t.requires_grad, "parameter": isinstance(t, torch.nn.Parameter)}
        t = t.detach()
        shape, device = tuple(t.shape), str(t.device)
        cluster = cluster_of.get(i)
        first = cluster is None or id(cluster) not in blob_of_cluster
        identical = cluster is not None and all(
            _same_view(found[j][0], found[cluster[0]][0]) for j in cluster
        )
        if cluster is None or len(cluster) == 1 or identical:
            if first:
                name = unique(component, tensor_name(component, path))
                blobs.append(Blob(component, name, t, t.dtype, shape, t.numel() * t.element_size()))
                if cluster is not None:
                    blob_of_cluster[id(cluster)] = (name, 0)
            else:
                name = blob_of_cluster[id(cluster)][0]
            specs.append(TensorSpec(component, path, name, t.dtype, shape, device, **extra))
            continue
        # Partially overlapping views: store the covering span once; each tensor is a strided view.
        if first:
            # Start the span at a multiple of every member's element size, so each view's offset
            # into it is a whole number of its elements (the storage itself starts aligned).
            widest = max(found[j][0].element_size() for j in cluster)
            lo = min(_byte_extent(found[j][0])[0] for j in cluster) // widest * widest
            hi = max(_byte_extent(found[j][0])[1] for j in cluster)
            dtypes = {found[j][0].dtype for j in cluster}
            span_dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
            item = torch.empty((), dtype=span_dtype).element_size()
            if lo % item or hi % item:
                span_dtype, item = torch.uint8, 1
            span = torch.empty(0, dtype=span_dtype, device=t.device).set_(
                t.untyped_storage(), lo // item, ((hi - lo) // item,), (1,)
            )
            name = unique(component, tensor_name(component, path) + ".__span__")
            blobs.append(Blob(component, name, span, span_dtype, ((hi - lo) // item,), hi - lo))
            blob_of_cluster[id(cluster)] = (name, lo)
        name, lo = blob_of_cluster[id(cluster)]
        start, _ = _byte_extent(t)
        specs.append(
            TensorSpec(component, path, name, t.dtype, shape, device, start - lo, tuple(t.stride()), **extra)
        )
    return specs, blobs


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
    )


def _pack(component: str, blobs: list[Blob], max_shard_size: int, file_tag: str = "") -> list[Shard]:
    """Greedy, order-preserving packing; a blob larger than the cap gets a shard of its own."""
    if not blobs:
        return []
    groups: list[list[Blob]] = []
    size = 0
    for blob in blobs:
        if not groups or (size + blob.nbytes > max_shard_size and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(blob)
        size += blob.nbytes
    n = len(groups)
    return [
        Shard(
            component,
            f"{component}-{file_tag + '-' if file_tag else ''}{i + 1:05d}-of-{n:05d}.safetensors",
            # Larger elements first: every blob then starts at a multiple of its element size.
            tuple(sorted(g, key=lambda b: -torch.empty((), dtype=b.dtype).element_size())),
        )
        for i, g in enumerate(groups)
    ]
