"""The staging pool: image layout, the FIFO ring allocator, page-locking pieces, and giving
its memory back."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_ckpt.format.plan import make_plan
from lightning_ckpt.save import staging
from lightning_ckpt.save.staging import ALIGN, Ring, StagingPool, aligned, layout


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
    from lightning_ckpt.hostmem import PIN_CHUNK, pin_pieces
    from lightning_ckpt.save.staging import ALIGN

    rng = random.Random(0)
    for _ in range(200):
        sizes = [ALIGN * rng.choice([1, 7, 4096, 30_000, 65_536, 100_000, 200_000]) for _ in range(rng.randint(1, 40))]
        ends = list(itertools.accumulate(sizes))
        page = rng.choice([ALIGN, 16 * ALIGN])  # 4 KiB and 64 KiB pages
        pieces = pin_pieces(ends, ends[-1], page)
        assert pieces == sorted(set(pieces)) and pieces[-1] == ends[-1]
        assert set(pieces) <= set(ends)
        assert all(end % page == 0 for end in pieces[:-1])  # no page is in two registrations
        bounds = [e for e in ends if e % page == 0]
        for start, end in zip([0, *pieces], pieces):
            inside = [e for e in bounds if start < e < end]
            assert end - start <= PIN_CHUNK or not inside, (start, end)
    assert pin_pieces([], 4096) == [4096]


def test_preparer_registers_the_given_pieces_and_ready_is_a_registered_prefix(monkeypatch):
    """Preparer's registration logic with a fake cudart (no CUDA here): every piece registered
    once, in order, exactly as given; ``ready`` never runs ahead of what is registered."""
    import ctypes
    import threading

    from lightning_ckpt import hostmem as pinning
    from lightning_ckpt.save import staging

    calls: list[tuple[int, int]] = []
    lock = threading.Lock()

    class FakeCudart:
        def cudaHostRegister(self, address, n, flags):
            with lock:
                calls.append((address, n))
            return 0

        def cudaHostUnregister(self, address):
            return 0

    chunk = 64 * 1024
    monkeypatch.setattr(pinning, "PIN_CHUNK", chunk)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    rng = random.Random(1)
    for trial in range(30):
        sizes = [4096 * rng.choice([1, 3, 7, 16, 40]) for _ in range(rng.randint(1, 30))]
        ends = list(itertools.accumulate(sizes))
        nbytes = ends[-1]
        pieces = pinning.pin_pieces(ends, nbytes)
        calls.clear()
        pool = staging.StagingPool()
        pool.reserve(nbytes, pin=True, pieces=pieces)
        base = ctypes.addressof(ctypes.c_char.from_buffer(pool.buffer))
        for end in ends:
            pool.wait_writable(end)
            with lock:
                registered = sum(n for _, n in calls)
            assert registered >= end, (trial, end, registered)
        pool.preparer._thread.join()
        starts = [0, *pieces[:-1]]
        assert calls == [(base + s, e - s) for s, e in zip(starts, pieces)], trial
        assert pool.pinned_bytes == nbytes
        pool.close()


def test_async_staging_refuses_tensors_on_two_cuda_devices_with_the_fix():
    """One side stream and one event per save cover one device: staging from two in one process
    would let the writer read bytes not landed yet. A plan-like object stands in (the
    check reads `cuda_devices()` only)."""
    from lightning_ckpt.save.staging import one_device

    class TwoDevices:
        def cuda_devices(self) -> set[torch.device]:
            return {torch.device("cuda", 0), torch.device("cuda", 1)}

    with pytest.raises(ValueError, match=r"more than one CUDA device.*async_save=False"):
        one_device(TwoDevices())  # type: ignore[arg-type]
    plan = make_plan({"w": torch.ones(4)}, max_shard_size=2**20)
    assert one_device(plan) is None


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_pool_collected_unclosed_gives_back_its_memory_and_ends_its_thread():
    # The descriptor keeps the shared memory alive after the mapping goes: left open, every pool
    # dropped without close() kept its whole size in RAM.
    before = _open_fds()
    pool = StagingPool()
    pool.reserve(8 * ALIGN)
    pool.wait_writable(8 * ALIGN)
    assert pool.fd is not None and str(pool.fd) in _open_fds()
    del pool
    gc.collect()
    assert _open_fds() <= before
    # Joined by the finalizer: the thread never drops the mapping's last reference (that aborted
    # the interpreter at exit, inside torch's buffer deleter).
    assert not [t for t in threading.enumerate() if t.name == "lightning_ckpt-pin"]


def test_an_interpreter_exiting_right_after_dropping_a_pool_exits_cleanly():
    script = (
        "from lightning_ckpt.save.staging import StagingPool\n"
        "pool = StagingPool(); pool.reserve(1 << 21); pool.wait_writable(1 << 21)\n"
        "del pool\n"
    )
    for _ in range(2):  # the abort was a race with the pool's thread: about one exit in two
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


def test_a_finalizer_run_on_the_pools_own_threads_does_not_wait_for_them(monkeypatch):
    """A garbage collection can run an unclosed pool's finalizer on one of its page-faulting
    threads, while the pool's thread waits for that very thread: the release must not join there."""
    from lightning_ckpt import hostmem as pinning

    pool = StagingPool()
    owned = pool._owned
    populate = pinning._populate
    calls = []
    reserved = threading.Event()

    def populate_collecting(view, address, nbytes):
        if not calls:
            calls.append(threading.current_thread().name)
            reserved.wait(30)
            owned.release()  # as the finalizer would, from a collection on this thread
        populate(view, address, nbytes)

    monkeypatch.setattr(pinning, "_populate", populate_collecting)
    pool.reserve(8 * ALIGN)
    reserved.set()
    deadline = time.monotonic() + 30
    while (owned.fd is not None or owned.preparer is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls and calls[0].startswith("lightning_ckpt-fault")
    assert owned.fd is None and owned.preparer is None and owned.mapping is None


def test_a_background_unmap_leaves_only_the_plain_mapping_to_its_thread():
    """``close(unmap_in_background=True)`` (teardown's): the pool's thread is joined and its
    ``frombuffer`` view dropped by the caller; a daemon thread dropping a ``frombuffer`` storage
    while the interpreter exits aborts the process (torch's deleter takes the GIL back there)."""
    pool = StagingPool()
    pool.reserve(8 * ALIGN)
    view = pool.view
    owned = pool._owned
    pool.close(unmap_in_background=True)
    assert owned.view is None and owned.preparer is None and owned.fd is None and owned.mapping is None
    assert sys.getrefcount(view) == 2  # ours and the call's: the pool's and its thread's went on this thread
    assert not [t for t in threading.enumerate() if t.name == "lightning_ckpt-pin"]


@pytest.mark.parametrize("max_shard_size", [1_000, 50_000, 10**9])
def test_largest_image_bounds_every_shard_image_of_the_plan(max_shard_size):
    # The warm-up's refusal of a small staging pool rests on this bound: never below a real image.
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight_with_a_rather_long_name": torch.randn(int(torch.randint(1, 5_000, (1,), generator=gen))) for i in range(40)}
    state = {i: {"exp_avg": torch.randn(v.numel()), "step": torch.tensor(1.0)} for i, v in enumerate(model.values())}
    checkpoint = {"state_dict": model, "optimizer_states": [{"state": state}]}
    image_layout, _ = staging.layout(make_plan(checkpoint, max_shard_size))
    largest_real = max(size for _, size in image_layout.images.values())
    optimizer = [t for s in state.values() for t in s.values()]
    bound = staging.largest_image([list(model.values()), optimizer], max_shard_size)
    assert largest_real <= bound <= largest_real + 512 * 80 + 4096 + max_shard_size
