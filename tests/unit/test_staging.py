"""Pure parts of the staging pool: image layout and the FIFO ring allocator."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from lightning_ckpt.plan import make_plan
from lightning_ckpt.staging import ALIGN, Ring, StagingPool, aligned, layout


def test_layout_puts_every_image_at_an_aligned_offset():
    plan = make_plan({"state_dict": {f"w{i}": torch.randn(1000 + i) for i in range(5)}}, max_shard_size=9000)
    image_layout, headers = layout(plan)
    offsets = sorted(image_layout.images.values())
    assert all(offset % ALIGN == 0 for offset, _ in offsets)
    for (offset, size), (next_offset, _) in zip(offsets, offsets[1:]):
        assert offset + size <= next_offset  # no overlap, padding to the next alignment
    assert image_layout.nbytes == sum(aligned(size) for _, size in offsets)
    for shard in plan.shards:
        header, _ = headers[shard.filename]
        assert image_layout.images[shard.filename][1] == len(header) + shard.nbytes


def test_ring_allocates_in_order_and_wraps():
    ring = Ring(10)
    assert [ring.alloc(4), ring.alloc(4), ring.alloc(4)] == [0, 4, None]
    ring.free_oldest()
    assert ring.alloc(4) == 0  # wraps into the freed head
    assert ring.alloc(1) is None  # [8, 10) is free but the ring is wrapped up to 4
    ring.free_oldest()
    assert ring.alloc(3) == 4
    with pytest.raises(ValueError):
        ring.alloc(11)


def test_pool_reuses_its_buffer_and_grows_only_when_needed():
    pool = StagingPool()
    pool.reserve(8192)
    generation = pool.generation
    pool.reserve(4096)
    assert pool.generation == generation and pool.nbytes == 8192
    pool.reserve(16384)
    assert pool.generation == generation + 1 and pool.nbytes == 16384
    pool.close()
    capped = StagingPool(max_bytes=4096)
    with pytest.raises(ValueError, match="staging_pool_size"):
        capped.reserve(8192)


def test_pin_pieces_end_at_range_ends_and_stay_within_a_registration_chunk():
    """An owner's ranges (ChunkedAdamW's chunks) never span two page-locked registrations: every
    piece ends where a range ends, holds at most PIN_CHUNK unless one range alone is longer, and
    the pieces cover the pool."""
    from lightning_ckpt.staging import ALIGN, PIN_CHUNK, pin_pieces

    rng = random.Random(0)
    for _ in range(200):
        sizes = [ALIGN * rng.choice([1, 7, 4096, 30_000, 65_536, 100_000, 200_000]) for _ in range(rng.randint(1, 40))]
        ends = list(itertools.accumulate(sizes))
        pieces = pin_pieces(ends, ends[-1])
        assert pieces == sorted(set(pieces)) and pieces[-1] == ends[-1]
        assert set(pieces) <= set(ends)
        for start, end in zip([0, *pieces], pieces):
            inside = [e for e in ends if start < e <= end]
            assert end - start <= PIN_CHUNK or len(inside) == 1, (start, end)
    assert pin_pieces([], 4096) == [4096]
