"""The CUDA cache release policy: empty it only when the allocator was under pressure."""

from __future__ import annotations

import pytest

from lightning_ckpt.memory import MemoryStats, release_memory, under_pressure

GB = 10**9


def test_fragmentation_is_free_memory_stranded_in_partly_used_segments():
    # 10 GB reserved, 6 GB live, 1 GB free inside partly used segments, 3 GB in wholly free ones.
    stats = MemoryStats(0, 0, cuda_allocated=6 * GB, cuda_reserved=10 * GB, cuda_inactive_split=1 * GB)
    assert stats.cuda_fragmentation == pytest.approx(0.1)
    assert stats.cuda_releasable == 3 * GB
    assert MemoryStats(0, 0).cuda_fragmentation == 0.0


def test_pressure_is_allocator_retries_or_ooms_since_the_previous_save():
    calm = MemoryStats(0, 0, 6 * GB, 10 * GB, 0, cuda_alloc_retries=2, cuda_ooms=0)
    assert not under_pressure(calm, calm)  # a plain loop: cached memory, no new retries
    assert under_pressure(MemoryStats(0, 0, 6 * GB, 10 * GB, 0, 3, 0), calm)
    assert under_pressure(MemoryStats(0, 0, 6 * GB, 10 * GB, 0, 2, 1), calm)
    assert under_pressure(calm, None)  # the first save: any retry so far counts


def test_release_modes_are_checked():
    with pytest.raises(ValueError, match="empty_cuda_cache='sometimes'.*on_pressure"):
        release_memory("sometimes")  # type: ignore[arg-type]
    report = release_memory("on_pressure")  # on a host without CUDA: gc and malloc_trim only
    assert report.seconds >= 0 and not report.cuda_cache_emptied
