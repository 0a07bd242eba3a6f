"""The on-disk format: file names, FORMAT_VERSION, safetensors headers and the manifest schema.

A checkpoint is a directory::

    manifest.json                      # written last: format version, versions, every file with
                                       # size + digest, the index of every tensor, its own crc32
    metadata.json                      # the checkpoint dict with tensors replaced by references
    model.safetensors.index.json       # Hugging Face style {"metadata": {...}, "weight_map": {...}}
    model-00001-of-0000N.safetensors   # state_dict tensors, keys = state-dict keys
    optimizer-00001-of-0000M.safetensors
    <component>-00001-of-0000K.safetensors  # any other top-level key holding tensors

A directory without a valid manifest is not a checkpoint. Readers refuse a newer FORMAT_VERSION.

Versions: 1 recorded each file's zlib crc32 (``"crc32"``); 2 records an XXH3-64 digest
(``"xxh3_64"``, about 4x faster than zlib's crc32, so every load can afford to verify every byte).
Both are read. The manifest's own ``manifest_crc32`` stays a zlib crc32 in every version: it is
checked before the version and the algorithm inside the manifest can be trusted.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import xxhash

from lightning_ckpt.errors import CorruptCheckpointError, UnsupportedFormatError

FORMAT_NAME = "lightning_ckpt"
FORMAT_VERSION = 2  # what a single-process save writes
SHARDED_FORMAT_VERSION = 3  # a multi-rank save: per-file ranks, tensors stored as chunks
READ_FORMAT_VERSION = SHARDED_FORMAT_VERSION  # the newest version this release reads
MANIFEST_FILE = "manifest.json"
METADATA_FILE = "metadata.json"
MODEL_INDEX_FILE = "model.safetensors.index.json"
CHECKSUM_ALGORITHM = "xxh3_64"  # what the writer records (format version 2)
LEGACY_CHECKSUM_ALGORITHM = "crc32"  # format version 1
# Shard data starts at a multiple of this (the safetensors spec allows space padding of the header).
DATA_ALIGNMENT = 64
# A header larger than this is refused without reading it (hostile or corrupt length prefix).
MAX_HEADER_BYTES = 256 * 2**20

# Safetensors dtype codes (https://github.com/huggingface/safetensors, `Dtype`). Dtypes missing here
# are stored as raw bytes ("U8") with the real dtype kept in the manifest.
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_ITEMSIZE = {code: torch.empty((), dtype=dt).element_size() for dt, code in SAFETENSORS_DTYPES.items()}


def checksum(data: Any, value: int = 0) -> int:
    """Running zlib crc32 of a bytes-like object: the manifest's own checksum (and v1 files)."""
    return zlib.crc32(data, value)


class Hasher(Protocol):
    """A running file digest: ``update`` with the file's bytes in order, then ``hexdigest``.

    Both algorithms release the GIL on large buffers, so a hashing thread runs beside the threads
    that read, copy or write the same bytes.
    """

    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: Any, /) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return format_checksum(self.value)


# Algorithm name (as recorded in the manifest's ``checksum``) -> a fresh running digest.
HASHERS: dict[str, Callable[[], Hasher]] = {"crc32": _Crc32, "xxh3_64": xxhash.xxh3_64}


def hasher(algorithm: str = CHECKSUM_ALGORITHM) -> Hasher:
    return HASHERS[algorithm]()


def digest(data: Any, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """The hex digest of a whole bytes-like object, as recorded in ``FileRecord.digest``."""
    running = hasher(algorithm)
    running.update(data)
    return running.hexdigest()


def format_checksum(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def is_safe_name(name: str) -> bool:
    """A file name the manifest may reference: a plain name inside the checkpoint directory."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and "\0" not in name


# ----------------------------------------------------------------------------------------------
# Safetensors headers


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the data section
    end: int


def build_header(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> tuple[bytes, dict[str, HeaderEntry]]:
    """``[(name, dtype, shape, nbytes)]`` in file order -> (header bytes incl. length prefix, entries)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    parsed: dict[str, HeaderEntry] = {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        code = SAFETENSORS_DTYPES.get(dtype)
        stored_shape = shape if code is not None else (nbytes,)
        entry = HeaderEntry(code or "U8", tuple(stored_shape), offset, offset + nbytes)
        header[name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [entry.begin, entry.end]}
        parsed[name] = entry
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    padded = -(-(8 + len(body)) // DATA_ALIGNMENT) * DATA_ALIGNMENT - 8
    body += b" " * (padded - len(body))
    return struct.pack("<Q", len(body)) + body, parsed


def parse_header(prefix: bytes, file_size: int, where: str) -> tuple[int, dict[str, HeaderEntry]]:
    """Validate a safetensors header. ``prefix`` holds at least the first 8 + header-length bytes.

    Returns (data start offset, entries). Offsets and shapes are checked against ``file_size`` so a
    hostile header cannot make a reader allocate or map beyond the file.
    """
    if len(prefix) < 8:
        raise CorruptCheckpointError(f"{where}: file is {file_size} bytes, too short for a safetensors header", file=where)
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise CorruptCheckpointError(
            f"{where}: header length {length} does not fit the file ({file_size} bytes); the file is truncated or corrupt",
            file=where,
        )
    try:
        raw = json.loads(prefix[8 : 8 + length])
        if not isinstance(raw, dict):
            raise ValueError("header is not a JSON object")
    except ValueError as err:
        raise CorruptCheckpointError(f"{where}: unreadable safetensors header ({err})", file=where) from err
    data_start = 8 + length
    data_size = file_size - data_start
    entries: dict[str, HeaderEntry] = {}
    for name, value in raw.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = value["dtype"], tuple(value["shape"]), value["data_offsets"]
            ok = (
                code in _ITEMSIZE
                and len(shape) <= 64
                and all(type(n) is int and n >= 0 for n in shape)
                and type(begin) is int
                and type(end) is int
                and 0 <= begin <= end <= data_size
            )
            # Only now multiply: the checks above bound every factor (no huge intermediate values).
            ok = ok and math.prod(shape) * _ITEMSIZE[code] == end - begin
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} has an invalid header entry {value!r} (data section is {data_size} bytes)",
                file=where,
            )
        entries[name] = HeaderEntry(code, shape, begin, end)
    return data_start, entries


# ----------------------------------------------------------------------------------------------
# Manifest


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One file's size and digest (algorithm: the manifest's ``checksum``).

    On disk the digest is ``"digest"`` since version 2, ``"crc32"`` in version 1.
    """

    size: int
    digest: str
    rank: int | None = None  # global rank that wrote the file; only in sharded (multi-rank) saves


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """Where tensor ``id`` (its position in ``Manifest.tensors``) comes from."""

    component: str
    path: list[Any]  # key path inside the checkpoint dict (informational)
    file: str
    blob: str  # name inside the safetensors file
    dtype: str
    shape: list[int]
    device: str  # device at save time
    byte_offset: int | None = None  # set when the tensor is a strided view into a shared blob
    stride: list[int] | None = None
    requires_grad: bool = False
    parameter: bool = False
    # Sharded saves (version 3): the pieces of a tensor cut along its dimensions, each
    # {"file", "blob", "offsets", "shape"} (and "byte_offset"/"stride" for a view into a blob);
    # ``shape`` above is then the whole tensor's, and ``file``/``blob`` name the first piece.
    chunks: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Manifest:
    files: dict[str, FileRecord]
    components: dict[str, list[str]]  # component -> its shard files, in order
    tensors: list[TensorRecord]
    created_by: dict[str, str]
    global_step: int | None = None
    epoch: int | None = None
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    checksum: str = CHECKSUM_ALGORITHM
    metadata_file: str = METADATA_FILE
    model_index_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_bytes(self) -> bytes:
        body = asdict(self)
        if self.format_version == 1:  # version 1 names each file's digest "crc32"
            body["files"] = {k: {"size": v["size"], "crc32": v["digest"]} for k, v in body["files"].items()}
        # Fields of sharded saves are left out when unset: single-process manifests keep the
        # version-2 layout byte for byte.
        for record in body["files"].values():
            if record.get("rank", 0) is None:
                del record["rank"]
        for record in body["tensors"]:
            if record.get("chunks", 0) is None:
                del record["chunks"]
        body["manifest_crc32"] = format_checksum(checksum(_canonical(body)))
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate. Raises ``UnsupportedFormatError`` for newer versions, else ``CorruptCheckpointError``."""

        def corrupt(reason: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: {reason}", file=MANIFEST_FILE)

        try:
            body = json.loads(data)
        except ValueError as err:
            raise corrupt(f"manifest is not valid JSON ({err}); the checkpoint is damaged") from err
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise corrupt(f"not a {FORMAT_NAME} manifest")
        version = body.get("format_version")
        if not isinstance(version, int) or version < 1:
            raise corrupt(f"invalid format_version {version!r}")
        if version > READ_FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{where}: checkpoint format version {version} is newer than this lightning_ckpt reads"
                f" (up to {READ_FORMAT_VERSION}). Upgrade lightning_ckpt to load it."
            )
        stored = body.pop("manifest_crc32", None)
        if stored != format_checksum(checksum(_canonical(body))):
            raise corrupt("manifest checksum mismatch; the manifest was modified or damaged")
        algorithm = body.get("checksum")
        if version == 1 and algorithm != LEGACY_CHECKSUM_ALGORITHM:
            raise corrupt(f"format version 1 records crc32 checksums, not {algorithm!r}")
        if algorithm not in HASHERS:
            raise UnsupportedFormatError(
                f"{where}: checksum algorithm {algorithm!r} is unknown to this lightning_ckpt (it knows"
                f" {sorted(HASHERS)}). Upgrade lightning_ckpt to load it."
            )
        digest_key = "crc32" if version == 1 else "digest"
        try:
            manifest = cls(
                files={k: FileRecord(v["size"], v[digest_key], v.get("rank")) for k, v in body.pop("files").items()},
                tensors=[TensorRecord(**t) for t in body.pop("tensors")],
                **body,
            )
            manifest._validate(corrupt)
        except (TypeError, AttributeError, KeyError, ValueError) as err:
            raise corrupt(f"manifest does not match format version {version} ({err})") from err
        return manifest

    def _validate(self, corrupt: Any) -> None:
        for name, record in self.files.items():
            if not is_safe_name(name):
                raise corrupt(f"manifest names file {name!r}, which is outside the checkpoint directory; refusing it")
            if not isinstance(record.size, int) or record.size < 0:
                raise corrupt(f"invalid size for {name!r}")
            if not isinstance(record.digest, str):
                raise corrupt(f"invalid digest for {name!r}")
        if self.metadata_file not in self.files:
            raise corrupt(f"metadata file {self.metadata_file!r} is not listed in the manifest")
        for component, files in self.components.items():
            for name in files:
                if name not in self.files:
                    raise corrupt(f"component {component!r} names {name!r}, which is not listed in the manifest")
        def ints(values: Any, minimum: int) -> bool:
            return isinstance(values, list) and len(values) <= 64 and all(type(v) is int and v >= minimum for v in values)

        for i, t in enumerate(self.tensors):
            if not isinstance(t.file, str) or t.file not in self.files:
                raise corrupt(f"tensor {i} names file {t.file!r}, which is not listed in the manifest")
            dtype = getattr(torch, t.dtype, None) if isinstance(t.dtype, str) else None
            if not isinstance(dtype, torch.dtype):
                raise corrupt(f"tensor {i} has unknown dtype {t.dtype!r}")
            if not ints(t.shape, 0) or (t.stride is not None and not ints(t.stride, 0)) or (
                t.byte_offset is not None and (type(t.byte_offset) is not int or t.byte_offset < 0)
            ):
                raise corrupt(f"tensor {i} has an invalid shape, stride or offset")
            for chunk in t.chunks or ():
                if (
                    not isinstance(chunk, dict)
                    or chunk.get("file") not in self.files
                    or not isinstance(chunk.get("blob"), str)
                    or not ints(chunk.get("offsets"), 0)
                    or not ints(chunk.get("shape"), 0)
                    or len(chunk["offsets"]) != len(t.shape)
                    or len(chunk["shape"]) != len(t.shape)
                    or any(o + n > size for o, n, size in zip(chunk["offsets"], chunk["shape"], t.shape))
                ):
                    raise corrupt(f"tensor {i} has an invalid piece {chunk!r}")


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
