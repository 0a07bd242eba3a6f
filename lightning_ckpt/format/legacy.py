"""Checkpoints written by Lightning's own sharded strategies (``torch.distributed.checkpoint``).

``ModelParallelStrategy`` and ``FSDPStrategy(state_dict_type="sharded")`` save a checkpoint as a
folder: DCP's ``.metadata`` and ``__<rank>_<i>.distcp`` files hold ``{"state_dict": ...,
"optimizer_0": ..., ...}`` (FSDPStrategy: ``"model"`` for ``"state_dict"``) sharded over the
ranks, and ``meta.pt`` (``torch.save``) holds the rest of the Lightning checkpoint dict.
``load_dcp_checkpoint`` reassembles the dict a single-file checkpoint would hold: full tensors,
read in this one process with DCP's own reader and planner and no process group (so it runs the
same on any rank, or with no process group at all).

Safety and damage:

* DCP itself unpickles ``.metadata`` with ``pickle.load`` and every non-tensor value with
  ``torch.load(weights_only=False)``. Weights-only loading (the default) reads ``.metadata`` with
  an unpickler that builds DCP's metadata classes only, and every non-tensor value (and
  ``meta.pt``) with ``torch.load(weights_only=True)``: a refused value raises
  ``UnsafeCheckpointError``.
* These folders carry no checksums. Before any data is read, every data file the metadata names
  is checked to be inside the folder, present and long enough, and every tensor to be covered by
  stored chunks (``CorruptCheckpointError`` naming the file); damage inside a file is found only
  where it makes DCP fail.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from typing_extensions import override

from lightning_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from lightning_ckpt.format.kind import META_FILE, METADATA_FILE
from lightning_ckpt.format.manifest import is_safe_name
from lightning_ckpt.format.plan import format_key_path
from lightning_ckpt.format.reader import MapLocation, device_for, load_legacy

_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)")
_MAX_LIST_INDEX = 2**20  # far above any real list of optimizers or parameter groups


@dataclass(frozen=True, slots=True)
class Chunk:
    """One saved piece of a tensor: the block of ``shape`` at ``offsets`` in it, stored in ``file``."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str


@dataclass(frozen=True, slots=True)
class Layout:
    """What a DCP folder holds, read from its metadata and ``meta.pt`` alone (no tensor data).

    ``checkpoint`` is the dict ``load_dcp_checkpoint`` returns, with every DCP tensor a
    ``meta``-device placeholder of its full shape and dtype; ``chunks`` maps each placeholder's
    key path in it to the pieces its data is stored in.
    """

    checkpoint: dict[Any, Any]
    chunks: dict[tuple[Any, ...], tuple[Chunk, ...]]
    version: str | None  # DCP's metadata version (None before torch 2.6)
    has_meta: bool  # written by Lightning (``meta.pt`` present), or a plain ``dcp.save``


def load_dcp_checkpoint(path: str, map_location: MapLocation, weights_only: bool | None) -> dict[str, Any]:
    """Load a stock DCP checkpoint folder into the dict a single-file Lightning checkpoint holds.

    ``meta.pt``'s entries plus ``"state_dict"`` and ``"optimizer_states"`` (DCP's ``optimizer_<i>``
    in order), every tensor full and plain (no DTensor). DCP records no device: its tensors count
    as saved on ``"cpu"`` for ``map_location`` (``None``: CPU; a device; a ``{saved: new}`` dict;
    a ``torch.load``-style callable). A folder without ``meta.pt`` (a plain ``dcp.save``) loads
    as the dict that was saved. ``weights_only`` ``None``/``True`` refuses arbitrary unpickling.
    """
    safe = weights_only is None or bool(weights_only)
    device = device_for("cpu", map_location)  # a bad map_location fails here, before any read
    metadata = _read_metadata(path, safe)
    files = _check_storage(path, metadata)
    meta = _read_meta(path, map_location, safe)
    flat: dict[str, Any] = {
        fqn: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for fqn, md in metadata.state_dict_metadata.items()
    }
    planner = _Planner(path, files, safe)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(flat, storage_reader=_Reader(path, metadata), planner=planner, no_dist=True)
    except CheckpointException as err:  # DCP's BaseException: unwrap the one (this rank's) failure
        raise _load_error(path, err) from None
    if device.type != "cpu":
        flat = {fqn: v.to(device) if isinstance(v, torch.Tensor) else v for fqn, v in flat.items()}
    return _assemble(path, metadata, flat, meta)


def read_layout(path: str) -> Layout:
    """A DCP folder's contents without reading tensor data (weights-only: for describing it)."""
    metadata = _read_metadata(path, safe=True)
    files = _check_storage(path, metadata)
    flat: dict[str, Any] = {}
    pieces: dict[str, tuple[Chunk, ...]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.empty(md.size, dtype=md.properties.dtype, device="meta")
            pieces[fqn] = tuple(
                Chunk(tuple(c.offsets), tuple(c.sizes), files[MetadataIndex(fqn, c.offsets)]) for c in md.chunks
            )
        else:
            flat[fqn] = None  # a value: not read
    meta = _read_meta(path, None, safe=True)
    checkpoint = _assemble(path, metadata, flat, meta)
    chunks = {_lightning_path(_dcp_path(metadata, fqn), meta is not None): found for fqn, found in pieces.items()}
    return Layout(checkpoint, chunks, getattr(metadata, "version", None), meta is not None)


# ----------------------------------------------------------------------------------------------
# .metadata


# Globals a DCP ``.metadata`` pickle may name when read weights-only: DCP's metadata classes and
# the torch values they hold (sizes, dtypes, layouts, memory formats). Each is at most called with
# pickled arguments, none of which can run code.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePath", "PurePosixPath", "PureWindowsPath", "WindowsPath"},
    "collections": {"OrderedDict"},
}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    @override
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def _read_metadata(path: str, safe: bool) -> Metadata:
    where = os.path.join(path, METADATA_FILE)
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"{path!r} is not a folder: there is no DCP checkpoint there.", path)
    try:
        with open(where, "rb") as f:
            metadata = (_MetadataUnpickler(f) if safe else pickle.Unpickler(f)).load()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path!r}: DCP's {METADATA_FILE!r} is missing, so the folder is not a complete DCP checkpoint"
            " (DCP writes it last: the save was interrupted). Resume from another checkpoint.",
            path,
            METADATA_FILE,
        ) from None
    except OSError:
        raise
    except _Refused as err:
        _raise_if_newer(path, where)
        raise UnsafeCheckpointError(
            f"{where!r}: the DCP metadata names {err}, which weights-only loading refuses (it is not one of"
            " DCP's metadata classes). If you trust this checkpoint, load it with `weights_only=False`"
            " (e.g. `lightning_ckpt.load_checkpoint(path, weights_only=False)`).",
            path,
        ) from None
    except Exception as err:  # truncated or garbled (pickle raises many kinds), or from a newer torch
        _raise_if_newer(path, where)
        raise _corrupt_metadata(path, f"{type(err).__name__}: {err}") from err
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise _corrupt_metadata(path, f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class _Probe:
    """Stands in for a class while probing a ``.metadata`` that failed to unpickle: takes any
    arguments and any state, and records (per stand-in class) how many fields each state had."""

    state_sizes: set[int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            type(self).state_sizes.add(len(state))


def _stand_in(name: str) -> type[_Probe]:
    return type(name, (_Probe,), {"state_sizes": set()})


class _ProbeUnpickler(_MetadataUnpickler):
    """Reads a ``.metadata`` as far as the torch that wrote it would: a global of a torch module
    that this torch lacks, and each DCP class with its own ``__setstate__`` (whose state layout a
    newer torch may have extended), become ``_Probe`` stand-ins; anything else as weights-only."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.missing: list[str] = []  # torch globals this torch does not have
        self.probed: dict[type[_Probe], type] = {}  # stand-in -> the class it stands for

    @override
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "torch":
            try:
                found = getattr(__import__(module, fromlist=[name]), name)
            except (ImportError, AttributeError):
                self.missing.append(f"{module}.{name}")
                return _stand_in(name)
            if name in _METADATA_GLOBALS.get(module, ()) and isinstance(found, type) and "__setstate__" in vars(found):
                stand_in = _stand_in(name)
                self.probed[stand_in] = found
                return stand_in
        return super().find_class(module, name)


def _raise_if_newer(path: str, where: str) -> None:
    """Raise ``UnsupportedFormatError`` when ``.metadata`` failed to unpickle because a newer torch
    wrote it: it names a torch class this torch lacks, or pickles a DCP class with more fields
    than this torch's (torch 2.15 added ``strides`` to ``TensorProperties``, which 2.14's
    ``__setstate__`` cannot unpack). Return when the file is unreadable either way (damaged)."""
    try:
        with open(where, "rb") as f:
            probe = _ProbeUnpickler(f)
            probe.load()
    except Exception:
        return
    reasons = [f"it names {name}, which this torch lacks" for name in dict.fromkeys(probe.missing)]
    for stand_in, real in probe.probed.items():
        try:
            known = len(real().__getstate__())
        except Exception:  # no default construction: nothing to compare with
            continue
        if any(size > known for size in stand_in.state_sizes):
            reasons.append(f"its {real.__name__} has {max(stand_in.state_sizes)} fields, this torch's {known}")
    if reasons:
        raise UnsupportedFormatError(
            f"{where!r} was written by a newer torch than this one ({torch.__version__}): {'; '.join(reasons)}."
            " Upgrade torch (`pip install -U torch`) to load it, or convert it with the torch that wrote it"
            " (`python -m lightning_ckpt convert DIR OUT.ckpt`).",
            path,
        )


def _corrupt_metadata(path: str, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path!r}: DCP's {METADATA_FILE!r} is unreadable ({reason}); the checkpoint is damaged and cannot be"
        " loaded without it. Resume from another checkpoint (an earlier one of the run).",
        path,
        METADATA_FILE,
    )


def _check_storage(path: str, metadata: Metadata) -> dict[MetadataIndex, str]:
    """Each stored item's file, checked before any read: a plain name inside the folder, present,
    long enough; and each tensor's chunks cover it with stored bytes, so no tensor allocated for
    the load is larger than the bytes on disk that hold it (a hostile size allocates nothing)."""
    try:
        return _checked_storage(path, metadata)
    except (AttributeError, TypeError, ValueError) as err:  # a field of an unexpected type
        raise _corrupt_metadata(path, f"unexpected content: {type(err).__name__}: {err}") from err


def _checked_storage(path: str, metadata: Metadata) -> dict[MetadataIndex, str]:
    files: dict[MetadataIndex, str] = {}
    lengths: dict[MetadataIndex, int | None] = {}
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(name, str) or not is_safe_name(name):
            raise _corrupt_metadata(path, f"it names data file {name!r}, which is not a file inside the folder")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise _corrupt_metadata(path, f"it places {index.fqn!r} at offset {offset!r}, length {length!r}")
        if name not in sizes:
            try:
                sizes[name] = os.stat(os.path.join(path, name)).st_size
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"{path!r}: data file {name!r} named by DCP's {METADATA_FILE!r} is missing; the checkpoint is"
                    " incomplete (each rank writes its own files: copy the whole folder). Resume from another"
                    " checkpoint.",
                    path,
                    name,
                ) from None
        if sizes[name] < offset + length:
            raise CorruptCheckpointError(
                f"{path!r}: data file {name!r} is {sizes[name]} bytes, DCP's {METADATA_FILE!r} needs"
                f" {offset + length}; it is truncated. Resume from another checkpoint.",
                path,
                name,
            )
        files[index] = name
        # A transformed (e.g. compressed) item may be shorter than its tensor: no length to compare.
        lengths[index] = None if getattr(info, "transform_descriptors", None) else length
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            _check_chunks(path, fqn, md, lengths)
    return files


def _check_chunks(
    path: str, fqn: str, md: TensorStorageMetadata, lengths: dict[MetadataIndex, int | None]
) -> None:
    def shape(values: Any) -> bool:
        return isinstance(values, (tuple, list)) and len(values) == len(md.size) <= 64 and all(
            type(v) is int and v >= 0 for v in values
        )

    if not shape(md.size) or not isinstance(md.properties.dtype, torch.dtype):
        raise _corrupt_metadata(path, f"tensor {fqn!r} has an invalid size or dtype")
    item = torch.empty((), dtype=md.properties.dtype).element_size()
    covered = 0
    for chunk in md.chunks:
        if not shape(chunk.offsets) or not shape(chunk.sizes):
            raise _corrupt_metadata(path, f"tensor {fqn!r} has an invalid chunk")
        index = MetadataIndex(fqn, chunk.offsets)
        if index not in lengths:
            raise _corrupt_metadata(path, f"tensor {fqn!r} has a chunk at {list(chunk.offsets)} stored nowhere")
        stored = lengths[index]
        if stored is not None and stored < math.prod(chunk.sizes) * item:
            raise _corrupt_metadata(path, f"tensor {fqn!r} has a chunk at {list(chunk.offsets)} larger than its data")
        covered += math.prod(chunk.sizes)
    if covered != math.prod(md.size):
        raise _corrupt_metadata(path, f"the chunks of tensor {fqn!r} do not cover its size {list(md.size)}")


class _Reader(FileSystemReader):
    """DCP's file reader, handed the metadata already read (weights-only where asked)."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return self._metadata


class _Planner(DefaultLoadPlanner):
    """DCP's default planner over the flat ``{fqn: value}`` dict, each value unpickled weights-only
    unless allowed (DCP's own ``load_bytes`` always allows arbitrary unpickling)."""

    def __init__(self, path: str, files: dict[Any, str], safe: bool) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._path, self._files, self._safe = path, files, safe

    @override
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn, file = read_item.dest_index.fqn, self._files.get(read_item.storage_index)
        try:
            self.state_dict[fqn] = torch.load(value, map_location="cpu", weights_only=self._safe)
        except (RuntimeError, EOFError, ValueError) as err:
            raise CorruptCheckpointError(
                f"{self._path!r}: value {fqn!r} in {file!r} is unreadable ({type(err).__name__}: {err}); the"
                " checkpoint is damaged. Resume from another checkpoint.",
                self._path,
                file,
            ) from err
        except pickle.UnpicklingError as err:
            if not self._safe:
                raise CorruptCheckpointError(
                    f"{self._path!r}: value {fqn!r} in {file!r} is unreadable ({err}).", self._path, file
                ) from err
            raise UnsafeCheckpointError(
                f"{self._path!r}: loading DCP value {fqn!r} (in {file!r}) needs to unpickle an object that"
                f" weights-only loading refuses ({str(err).splitlines()[0] if str(err) else type(err).__name__})."
                " If you trust this checkpoint, load it with `weights_only=False`, or allow the type with"
                " `torch.serialization.add_safe_globals([...])`.",
                self._path,
                fqn,
            ) from err


def _load_error(path: str, err: CheckpointException) -> CheckpointError:
    failures = list(err.failures.values())
    cause = failures[0][0] if failures else err
    if isinstance(cause, (UnsafeCheckpointError, CorruptCheckpointError)):
        return cause
    return CorruptCheckpointError(
        f"{path!r}: DCP failed to read the checkpoint ({type(cause).__name__}: {cause}); a data file is damaged"
        " (these folders carry no checksums to say which). Resume from another checkpoint.",
        path,
    )


# ----------------------------------------------------------------------------------------------
# meta.pt and the assembled dict


def _read_meta(path: str, map_location: MapLocation, safe: bool) -> dict[Any, Any] | None:
    where = os.path.join(path, META_FILE)
    if not os.path.exists(where):
        return None
    try:
        meta = load_legacy(where, map_location, safe)
    except pickle.UnpicklingError as err:
        if not safe:
            raise CorruptCheckpointError(f"{where!r} is unreadable ({err}).", path, META_FILE) from err
        raise UnsafeCheckpointError(
            f"{where!r}: Lightning's {META_FILE!r} needs to unpickle an object that weights-only loading refuses"
            f" ({str(err).splitlines()[0] if str(err) else type(err).__name__}). If you trust this checkpoint,"
            " load it with `weights_only=False`, or allow the type with"
            " `torch.serialization.add_safe_globals([...])`.",
            path,
        ) from err
    except (RuntimeError, EOFError, ValueError) as err:
        raise CorruptCheckpointError(
            f"{where!r} is unreadable ({type(err).__name__}: {err}); the checkpoint is damaged. Resume from"
            " another checkpoint.",
            path,
            META_FILE,
        ) from err
    if not isinstance(meta, dict):
        message = f"{where!r} holds a {type(meta).__name__}, not a checkpoint dict; the checkpoint is damaged."
        raise CorruptCheckpointError(message, path, META_FILE)
    return meta


def _dcp_path(metadata: Metadata, fqn: str) -> tuple[Any, ...]:
    """The key path DCP flattened into ``fqn`` (``fqn`` itself when it was not flattened)."""
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    found = planner_data.get(fqn)
    return tuple(found) if isinstance(found, (tuple, list)) and found else (fqn,)


def _lightning_path(path: tuple[Any, ...], lightning: bool) -> tuple[Any, ...]:
    """In a Lightning checkpoint: ``("optimizer_1", ...)`` -> ``("optimizer_states", 1, ...)``, and
    FSDPStrategy's ``("model", ...)`` -> ``("state_dict", ...)``."""
    if not lightning:
        return path
    head, rest = path[0], path[1:]
    if head == "model":
        return ("state_dict", *rest)
    match = _OPTIMIZER_KEY.fullmatch(head) if isinstance(head, str) else None
    return ("optimizer_states", int(match.group(1)), *rest) if match else path


def _assemble(path: str, metadata: Metadata, flat: dict[str, Any], meta: dict[Any, Any] | None) -> dict[Any, Any]:
    tree: dict[Any, Any] = {}
    for fqn, value in flat.items():
        _insert(path, tree, _lightning_path(_dcp_path(metadata, fqn), meta is not None), value)
    if meta is None:
        return tree
    optimizers = tree.get("optimizer_states", [])
    if any(state is None for state in optimizers):
        missing = [i for i, state in enumerate(optimizers) if state is None]
        raise _corrupt_metadata(path, f"optimizer states {missing} are missing among {len(optimizers)}")
    return {**meta, **tree}


def _insert(path: str, tree: dict[Any, Any], keys: tuple[Any, ...], value: Any) -> None:
    """Set ``tree[k0][k1]...`` = ``value``, making a list under an int key, else a dict (as DCP does)."""
    node: Any = tree
    try:
        for key, below in zip(keys, keys[1:]):
            _make_room(node, key)
            if node[key] is None if isinstance(node, list) else key not in node:
                node[key] = [] if type(below) is int else {}
            node = node[key]
        _make_room(node, keys[-1])
        node[keys[-1]] = value
    except (TypeError, KeyError, IndexError, ValueError) as err:
        raise _corrupt_metadata(path, f"its key paths conflict at {format_key_path(keys)} ({err})") from err


def _make_room(node: Any, key: Any) -> None:
    if isinstance(node, list):
        if type(key) is not int or not 0 <= key < _MAX_LIST_INDEX:  # a hostile index must not allocate
            raise ValueError(f"list index {key!r}")
        node.extend([None] * (key + 1 - len(node)))
