"""The release policies: the CUDA cache is emptied only when the allocator was under pressure,
the host heap trimmed only when a save left enough of it behind."""

from __future__ import annotations

import os

import pytest

from lightning_ckpt.lightning.release import (
    RELEASE_MODES,
    MemoryReleaser,
    MemoryStats,
    _malloc_trim,
    heap_free_bytes,
    heap_left,
    host_under_pressure,
    memory_stats,
    release_memory,
    release_mode,
    under_pressure,
)

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


# ------------------------------------------------------------------------------ the host heap

HAS_GLIBC_HEAP = heap_free_bytes() is not None and os.path.exists("/proc/self/status")
MB = 10**6


def test_release_memory_option_is_a_mode_or_a_bool():
    assert release_mode(True) == "auto" and release_mode(False) == "never"  # True was the default
    assert [release_mode(m) for m in RELEASE_MODES] == list(RELEASE_MODES)
    for bad in ("sometimes", None, 1):
        with pytest.raises(ValueError, match=r"release_memory=.*'auto'.*'always'.*'never'"):
            release_mode(bad)
    for bad in (-1, "10", True, float("nan")):
        with pytest.raises(ValueError, match="release_threshold_mb"):
            MemoryReleaser("auto", threshold_mb=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty_cuda_cache"):
        MemoryReleaser("auto", "sometimes")  # type: ignore[arg-type]


def test_heap_left_is_resident_growth_capped_by_the_free_heap():
    assert heap_left(MemoryStats(0, 5 * MB), MemoryStats(0, 1 * MB)) == 0  # shrank: nothing left
    free = heap_free_bytes()
    grown = heap_left(MemoryStats(0, 0), MemoryStats(0, 10**15))
    assert grown == 10**15 if free is None else grown < 10**15  # live growth beyond the free heap is not garbage


@pytest.fixture
def trimmed_heap():
    """Start from a trimmed heap and leave one: what a save leaves is measured against it."""
    _malloc_trim()
    yield
    _malloc_trim()


def _leave_freed_heap(nbytes: int, keep: list[bytearray]) -> None:
    """Free ``nbytes`` of 100 KB heap blocks (below glibc's mmap threshold) with a block kept alive
    after every third: free heap glibc cannot give back from the top, as a save's host copies
    leave it. (Small kept objects would not do: they may land in older holes of the heap.)"""
    blocks = []
    for i in range(nbytes // 100_000 * 4 // 3):
        (keep if i % 4 == 3 else blocks).append(bytearray(100_000))  # zero-filled: resident
    del blocks


@pytest.mark.skipif(not HAS_GLIBC_HEAP, reason="needs glibc 2.33+ (mallinfo2) and Linux /proc")
def test_auto_trims_off_the_training_thread_what_a_save_left_behind(trimmed_heap):
    keep: list[bytearray] = []
    releaser = MemoryReleaser("auto", threshold_mb=50)
    releaser.before_save()
    before = memory_stats()
    _leave_freed_heap(150 * MB, keep)
    after = memory_stats()
    release = releaser.after_save(before, after)
    assert release.heap_left > 100 * MB and not release.skipped
    assert "threshold 50 MB" in release.reason and release.released is None  # known once the trim ends
    assert release.trim is not None and not release.trim.done()  # pending until the step's saves are done
    second = releaser.after_save(after, memory_stats())  # save_last's save in the same step: nothing new
    assert second.skipped and second.trim is None
    releaser.start_pending()
    assert release.trim.wait(timeout=60)
    assert release.trim.trimmed and release.trim.released is not None and release.trim.released > 75 * MB
    assert memory_stats().host_anon < after.host_anon - 75 * MB
    releaser.wait()


@pytest.mark.skipif(not HAS_GLIBC_HEAP, reason="needs glibc 2.33+ (mallinfo2) and Linux /proc")
@pytest.mark.parametrize("mode", ["never", "auto"])
def test_heap_below_the_threshold_or_release_off_is_measured_and_kept(mode, trimmed_heap):
    keep: list[bytearray] = []
    releaser = MemoryReleaser(mode, threshold_mb=10_000)  # type: ignore[arg-type]
    before = memory_stats()
    _leave_freed_heap(60 * MB, keep)
    after = memory_stats()
    release = releaser.after_save(before, after)
    assert release.heap_left > 30 * MB and release.skipped and release.trim is None and release.released is None
    if mode == "never":
        assert release.reason == "release_memory='never'"
    else:
        assert "below the 10000 MB threshold" in release.reason
    releaser.start_pending()
    assert memory_stats().host_anon > after.host_anon - 30 * MB  # nothing was given back


@pytest.mark.skipif(not HAS_GLIBC_HEAP, reason="needs glibc 2.33+ (mallinfo2) and Linux /proc")
def test_always_collects_and_trims_on_the_calling_thread(trimmed_heap):
    keep: list[bytearray] = []
    releaser = MemoryReleaser("always")
    before = memory_stats()
    _leave_freed_heap(60 * MB, keep)
    release = releaser.after_save(before, memory_stats())
    assert not release.skipped and release.trim is None and release.reason == "release_memory='always'"
    assert release.released is not None and release.released > 30 * MB and release.seconds > 0


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux /proc/meminfo")
def test_host_pressure_is_a_share_of_memory_available():
    assert host_under_pressure(share=1.0)  # less than all of it is always available
    assert not host_under_pressure(share=0.0)
