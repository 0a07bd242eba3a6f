"""The file digests of format version 2 (XXH3-64) and version 1 (zlib crc32)."""

from __future__ import annotations

import json
import mmap
import os
import zlib

import pytest
import torch
import xxhash

import lightning_ckpt as lc
from lightning_ckpt.format import digests
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.store.shards import ShardWriter


def test_algorithms():
    data = os.urandom(3 * 2**20 + 17)
    assert fmt.FORMAT_VERSION == 2 and fmt.CHECKSUM_ALGORITHM == "xxh3_64"
    assert fmt.digest(data) == xxhash.xxh3_64_hexdigest(data)  # the same as `xxhsum -H3`
    assert fmt.digest(data, "crc32") == f"{zlib.crc32(data):08x}"
    for algorithm in fmt.HASHERS:
        running = fmt.hasher(algorithm)
        for start in range(0, len(data), 1 << 20):  # chunked == whole
            running.update(memoryview(data)[start : start + (1 << 20)])
        assert running.hexdigest() == fmt.digest(data, algorithm)


def test_manifest_records_the_algorithm_and_every_digest(tmp_path):
    path = tmp_path / "a.ckpt"
    lc.save_checkpoint({"state_dict": {"w": torch.randn(1000)}, "optimizer_states": [{"state": {0: {"m": torch.ones(5)}}}]}, path)
    body = json.loads((path / "manifest.json").read_text())
    assert body["format_version"] == 2 and body["checksum"] == "xxh3_64"
    for name, record in body["files"].items():
        assert set(record) == {"size", "digest"}
        assert record["digest"] == xxhash.xxh3_64_hexdigest((path / name).read_bytes()), name


def test_both_writer_paths_agree(tmp_path):
    """The streamed (copy/hash/write pipeline) and the staged-image (async writer) paths."""
    writer = ShardWriter(chunk_bytes=4096, direct_io=False)
    blob = torch.arange(10_000, dtype=torch.int32)
    from lightning_ckpt.format.plan import Blob

    header, _ = fmt.build_header([("x", torch.int32, (10_000,), blob.numel() * 4)])
    streamed = writer.write_shard(str(tmp_path / "s"), header, (Blob("model", "x", blob, torch.int32, (10_000,), 40_000),), False)
    data = (tmp_path / "s").read_bytes()
    image = mmap.mmap(-1, -(-len(data) // 4096) * 4096)
    image[: len(data)] = data
    for rate in (None, 10e9):  # full speed (hash thread) and rate-capped (hash in the paced loop)
        writer.max_rate = rate
        staged = writer.write_image(str(tmp_path / f"i{rate}"), image, 0, len(data), False)
        assert staged == streamed == fmt.FileRecord(len(data), xxhash.xxh3_64_hexdigest(data))
    writer.close()


def test_v1_manifest_round_trips():
    record = fmt.FileRecord(3, "0000abcd")
    m = fmt.Manifest(
        files={"metadata.json": record}, components={}, tensors=[], created_by={}, format_version=1, checksum="crc32"
    )
    body = json.loads(m.to_bytes())
    assert body["files"]["metadata.json"] == {"size": 3, "crc32": "0000abcd"}
    assert fmt.Manifest.from_bytes(m.to_bytes(), "x").files == {"metadata.json": record}


def _sealed(body: dict) -> bytes:
    body.pop("manifest_crc32", None)
    body["manifest_crc32"] = fmt.format_checksum(fmt.checksum(fmt._canonical(body)))
    return json.dumps(body).encode()


def test_unknown_algorithm_is_unsupported_and_v1_must_be_crc32(tmp_path):
    path = tmp_path / "a.ckpt"
    lc.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    body = json.loads((path / "manifest.json").read_text())
    with pytest.raises(lc.UnsupportedFormatError, match="blake9"):
        fmt.Manifest.from_bytes(_sealed({**body, "checksum": "blake9"}), "x")
    with pytest.raises(lc.CorruptCheckpointError, match="version 1"):
        fmt.Manifest.from_bytes(_sealed({**body, "format_version": 1}), "x")
    with pytest.raises(lc.UnsupportedFormatError, match=f"version {fmt.READ_FORMAT_VERSION + 1}"):
        fmt.Manifest.from_bytes(_sealed({**body, "format_version": fmt.READ_FORMAT_VERSION + 1}), "x")


def test_mapped_digest_matches_over_chunk_boundaries(tmp_path, monkeypatch):
    monkeypatch.setattr(digests, "CHUNK", mmap.PAGESIZE)
    data = os.urandom(5 * mmap.PAGESIZE + 123)
    file = tmp_path / "f"
    file.write_bytes(data)
    with open(file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    for algorithm in fmt.HASHERS:
        assert digests.mapped_digest(mapped, algorithm) == fmt.digest(data, algorithm)
    mapped.close()
