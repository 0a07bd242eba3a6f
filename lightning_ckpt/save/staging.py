"""When a safe copy exists: the host staging pool of async saves.

The pool is one shared-memory file (``memfd``; an unlinked file in ``/dev/shm`` where memfd is
missing), allocated at the first save (or ahead of it, by ``prepare``) and reused by every later
one; it grows only when the state grows and is never shrunk. No name of it exists in the
filesystem, so a crash of both processes leaks nothing. The writer process maps it through a file
descriptor passed over a socket.

Staging lays out each shard as its exact *file image* (safetensors header + tensor bytes) at a
4096-aligned offset, so the writer process writes it with ``O_DIRECT`` straight from the pool,
without another copy.

On CUDA the pool is page-locked (``cudaHostRegister``) by a background thread, chunk by chunk, so
no save call waits for the whole pool to be pinned; a copy into a chunk not pinned yet waits for
that chunk only. Device copies run ``non_blocking`` on a side stream, and the training stream is
*not* made to wait for them at once (see :class:`Copies`): tensors that only ``optimizer.step()``
changes (parameters of an optimizer, optimizer state) are handed over just before the next step,
so the copy overlaps the next forward and backward; everything else (buffers such as BatchNorm's
running statistics, which the forward updates) is copied first and waited for at once.

Host memory whose owner changes it only at known points (``ChunkedAdamW``'s arena: its optimizer
state is already staged host memory) can be registered as a :class:`DeferredSource`: an async
save then does not copy it on the caller's thread; the owner copies it into the pool itself, in
the background or just before it next writes it (copy-on-write), see :class:`DeferredCopies`.
Nothing here imports Lightning.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_ckpt import hostmem
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format.plan import Blob, Plan, Shard
from lightning_ckpt.hostmem import (
    ALIGN,
    DeferredSource,
    SharedBuffer,
    aligned,
    claim_deferred,
)


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """Where each shard's file image lies in the pool: filename -> (offset, file size)."""

    nbytes: int  # pool bytes needed (images padded to ALIGN, so O_DIRECT can write the tails)
    images: dict[str, tuple[int, int]]


def layout(plan: Plan) -> tuple[ImageLayout, dict[str, tuple[bytes, dict[str, fmt.HeaderEntry]]]]:
    """Pure: the pool layout of ``plan`` and each shard's header (bytes, entries)."""
    offset = 0
    images: dict[str, tuple[int, int]] = {}
    headers = {}
    for shard in plan.shards:
        header, entries = fmt.build_header([(b.name, b.dtype, b.shape, b.nbytes) for b in shard.blobs])
        size = len(header) + shard.nbytes
        images[shard.filename] = (offset, size)
        headers[shard.filename] = (header, entries)
        offset += aligned(size)
    return ImageLayout(offset, images), headers


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of ``optimizer``'s state (its moments, step counters)."""
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def staging_need(tensors: list[torch.Tensor]) -> tuple[int, bool]:
    """(bytes, whether any is on CUDA) of ``tensors`` as this rank stages them: a DTensor's local
    shard only. What ``StagingPool.reserve`` is sized from ahead of the first save."""
    local = [getattr(t, "_local_tensor", t) for t in tensors]
    return sum(t.nbytes for t in local), any(t.is_cuda for t in local)


# Room for a tensor's entry in a shard image's safetensors header (name, dtype, shape, offsets: ~100
# bytes for a typical key path), with room for long names.
_HEADER_ENTRY_ROOM = 512


def pool_fix(needed: int) -> str:
    """The fix for a staging pool too small for a ``needed``-byte shard image, in one wording for
    every place that finds it (the first step's check, a save, the ring)."""
    return (
        f"Raise `ShardedCheckpointIO(staging_pool_size=...)` to at least {needed:,} bytes, or lower"
        " `max_shard_size` (a tensor larger than it still needs a shard of its own), or leave"
        " `staging_pool_size` unset (a pool as large as the state)."
    )


def largest_image(groups: list[list[torch.Tensor]], max_shard_size: int) -> int:
    """An upper bound on the largest shard image a save of ``groups`` makes (each group one
    component's tensors, as this rank stages them): the plan packs a component's tensors up to
    ``max_shard_size`` and gives a larger tensor a shard of its own. A staging pool below it cannot
    stage that shard (``Ring.alloc``); the header's room counts every tensor of the group."""
    largest = 0
    for group in groups:
        sizes = [getattr(t, "_local_tensor", t).nbytes for t in group]
        if sizes:
            data = max(max(sizes), min(max_shard_size, sum(sizes)))
            largest = max(largest, aligned(8 + data + _HEADER_ENTRY_ROOM * len(sizes)))
    return largest


def one_device(plan: Plan) -> torch.device | None:
    """The one CUDA device ``plan``'s tensors live on (``None``: host memory only). A pool has one
    side stream and one event per save: a copy from another device would run on that device's
    training stream, and the writer could read its bytes before they land. So more is refused."""
    devices = plan.cuda_devices()
    if len(devices) > 1:
        raise ValueError(
            f"an async save of tensors on more than one CUDA device in one process ({sorted(map(str, devices))})"
            " is not supported: save with `ShardedCheckpointIO(async_save=False)`, or keep each process's"
            " state on one device."
        )
    return next(iter(devices), None)


def _timed_wait(stream: torch.cuda.Stream, event: torch.cuda.Event) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Make ``stream`` wait for ``event`` (on the GPU: the host goes on) between two timing events,
    whose elapsed time is how long the stream idled for it."""
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record(stream)
    stream.wait_event(event)
    after.record(stream)
    return before, after


class Copies:
    """The device-to-pool copies of one save, queued on the pool's side stream.

    ``hand_over()`` orders the training stream after them, on the GPU (the host does not wait);
    ``ShardedCheckpointIO`` calls it just before the next ``optimizer.step()``, or before anything
    else that may change the copied tensors. ``landed()`` / ``wait()`` tell the host when the pool
    holds every byte. ``waited_seconds()`` is how long the training stream idled for the copies.
    """

    def __init__(
        self,
        done: torch.cuda.Event,
        early_wait: tuple[torch.cuda.Event, torch.cuda.Event] | None,
        device: torch.device,
    ) -> None:
        self._done = done
        self._waits = [early_wait] if early_wait is not None else []
        self._handed = False
        self._device = device  # the copied tensors' device, whose training stream waits for them

    @property
    def device(self) -> torch.device | None:
        """The CUDA device of the copies: a thread that waits for them sets it first (a new
        thread's is device 0, whose context it would otherwise open on every rank of the node)."""
        return self._device

    def hand_over(self) -> None:
        """Idempotent; a no-op once the copies have landed."""
        if self._handed:
            return
        self._handed = True
        if not self._done.query():
            self._waits.append(_timed_wait(torch.cuda.current_stream(self._device), self._done))

    def landed(self) -> bool:
        return self._done.query()

    def wait(self) -> None:
        self._done.synchronize()

    def waited_seconds(self) -> float | None:
        """GPU time the training stream waited for these copies; ``None`` until it is known (the
        copies landed before anything had to wait for them: only the early wait counts)."""
        if not (self._handed or self._done.query()) or not all(after.query() for _, after in self._waits):
            return None
        return sum(before.elapsed_time(after) for before, after in self._waits) / 1e3


class DeferredCopies(Copies):
    """The copies of one save whose host bytes are (partly) left to ``DeferredSource`` owners: lands
    once the device copies (``device``, if any) have and every owner has made its copies. ``wait``
    makes the owners' remaining copies in the waiting thread (the hand-off thread: in the
    background). The training stream waits only for the device copies, as with :class:`Copies`."""

    def __init__(self, sources: list[DeferredSource], device: Copies | None) -> None:
        # Not Copies.__init__: the device side, if any, is a Copies of its own.
        self._sources = sources
        self._device_copies = device

    @property
    def device(self) -> torch.device | None:
        return None if self._device_copies is None else self._device_copies.device

    def hand_over(self) -> None:
        if self._device_copies is not None:
            self._device_copies.hand_over()

    def landed(self) -> bool:
        device = self._device_copies
        return (device is None or device.landed()) and all(s.settled() for s in self._sources)

    def wait(self) -> None:
        for source in self._sources:
            source.flush()
        if self._device_copies is not None:
            self._device_copies.wait()

    def waited_seconds(self) -> float | None:
        return 0.0 if self._device_copies is None else self._device_copies.waited_seconds()


class StagingPool(SharedBuffer):
    """A reusable shared-memory buffer holding the file images of one checkpoint.

    Not thread-safe; the caller (``ShardedCheckpointIO``) guarantees that the writer process has
    finished reading the pool before it is staged again (one save in flight).

    Args:
        max_bytes: refuse to grow beyond this (``None``: no cap). See ``ShardedCheckpointIO``.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        super().__init__(max_bytes)
        self._stream: torch.cuda.Stream | None = None
        self._queued = False  # device copies queued since the last ``copies()``
        self._claimed: list[DeferredSource] = []  # owners of host bytes left to them by ``stage``
        self.host_bytes_copied = 0  # host bytes ``stage``/``stage_shard`` copied in the caller, ever

    def stage(
        self,
        plan: Plan,
        image_layout: ImageLayout,
        headers: dict[str, tuple[bytes, dict[str, fmt.HeaderEntry]]],
        deferrable: Callable[[Blob], bool] = lambda _: False,
        defer_host: bool = False,
    ) -> Copies | None:
        """Copy every blob of ``plan`` into the pool as laid out by ``layout(plan)`` (grows to fit).

        Device blobs for which ``deferrable(blob)`` holds are queued last and left for the caller
        to hand over (see :class:`Copies`); the others are queued first, and the training stream
        waits for them at once. ``defer_host``: host blobs a registered :class:`DeferredSource`
        claims are left to it (a :class:`DeferredCopies` comes back). Returns ``None`` when no
        copy is outstanding (the pool holds every byte).
        """
        self._claimed = []
        self.reserve(max(image_layout.nbytes, ALIGN), pin=bool(one_device(plan)))
        later: list[tuple[Blob, int]] = []
        try:
            for shard in plan.shards:
                offset = image_layout.images[shard.filename][0]
                later += self.stage_shard(shard, headers[shard.filename], offset, deferrable, defer_host)
        except BaseException:
            # Invariant: no claim outlives the save that made it. Left behind, it would be copied
            # later into the pool's bytes of the next save; made now, it lands in this failed one.
            claimed, self._claimed = self._claimed, []
            for source in claimed:
                source.flush()
            self.discard_copies()
            raise
        early_wait = None
        if later and self._queued:  # buffers and the like first: the forward may update them
            assert self._stream is not None
            early = torch.cuda.Event()
            early.record(self._stream)
            early_wait = _timed_wait(torch.cuda.current_stream(self._stream.device), early)
        for blob, start in later:
            self._copy_to_pool(blob, start)
        copies = self.copies(early_wait)
        if copies is not None and not later:
            copies.hand_over()  # nothing to defer: the training stream waits for the copies now
        if self._claimed:
            claimed, self._claimed = self._claimed, []
            return DeferredCopies(claimed, copies)
        return copies

    def stage_shard(
        self,
        shard: Shard,
        header: tuple[bytes, dict[str, fmt.HeaderEntry]],
        offset: int,
        deferrable: Callable[[Blob], bool] = lambda _: False,
        defer_host: bool = False,
    ) -> list[tuple[Blob, int]]:
        """Copy one shard's file image to ``offset``: host bytes at once (``defer_host``: but those
        a ``DeferredSource`` claims), device bytes queued (see ``copies``), except deferrable device
        blobs, returned as (blob, pool offset) to queue later."""
        view = self.view
        assert view is not None
        header_bytes, entries = header
        self.wait_writable(offset + len(header_bytes))
        view[offset : offset + len(header_bytes)].copy_(torch.frombuffer(bytearray(header_bytes), dtype=torch.uint8))
        data = offset + len(header_bytes)
        later = []
        for blob in shard.blobs:
            if blob.nbytes == 0:
                continue
            assert blob.source is not None
            start = data + entries[blob.name].begin
            if blob.source.device.type != "cuda":
                self.wait_writable(start + blob.nbytes)  # the owner of a claimed source writes it too
                destination = view[start : start + blob.nbytes].view(blob.source.dtype).view(blob.source.shape)
                owner = claim_deferred(blob.source.detach(), destination) if defer_host else None
                if owner is None:
                    destination.copy_(blob.source.detach())
                    self.host_bytes_copied += blob.nbytes
                elif owner not in self._claimed:
                    self._claimed.append(owner)
            elif deferrable(blob):
                later.append((blob, start))
            else:
                self._copy_to_pool(blob, start)
        return later

    def _copy_to_pool(self, blob: Blob, start: int) -> None:
        """Queue a device blob's copy to ``[start, start + nbytes)`` on the side stream, split at
        ``PIN_CHUNK`` boundaries (each chunk is its own registration), each piece waiting only for
        its own chunk to be pinned."""
        view, preparer = self.view, self.preparer
        assert view is not None and preparer is not None and blob.source is not None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=blob.source.device)
        if not self._queued:  # the copies read what the training stream has written so far
            self._stream.wait_stream(torch.cuda.current_stream(blob.source.device))
            self._queued = True
        end = start + blob.nbytes
        with torch.cuda.stream(self._stream):
            # On the side stream, after its wait: a non-contiguous tensor (channels_last weights
            # and their optimizer state) is packed here, in memory only this stream uses, never
            # in a temporary of the training stream's that the copy could read before it is written.
            source = blob.source.detach().contiguous().view(-1).view(torch.uint8)
            piece = start
            while piece < end:
                piece_end = min(end, (piece // hostmem.PIN_CHUNK + 1) * hostmem.PIN_CHUNK)
                preparer.wait_for(piece_end)
                view[piece:piece_end].copy_(source[piece - start : piece_end - start], non_blocking=True)
                piece = piece_end
            blob.source.record_stream(self._stream)

    def discard_copies(self) -> None:
        """A stage failed midway: let the device copies it queued finish, untracked. Invariant: no
        copy outlives its save. Left running, one would land over the next save's bytes (or in a
        pool already released), and the next save's copies would skip their wait for the training
        stream (``_queued``), reading parameters before the last step's kernels wrote them."""
        if self._queued:
            assert self._stream is not None
            self._stream.synchronize()
            self._queued = False

    def copies(self, early_wait: tuple[torch.cuda.Event, torch.cuda.Event] | None = None) -> Copies | None:
        """The device copies queued since the last call (``None`` if none)."""
        if not self._queued:
            return None
        self._queued = False
        assert self._stream is not None
        done = torch.cuda.Event(blocking=True)  # the hand-off thread sleeps on it, not spins
        done.record(self._stream)
        return Copies(done, early_wait, self._stream.device)


class Ring:
    """FIFO allocator over a pool smaller than the state: shards are written in the order they are
    staged, so regions are freed oldest first (``free_oldest``) and new ones wrap around."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._live: deque[tuple[int, int]] = deque()

    def alloc(self, size: int) -> int | None:
        """Start of a free region of ``size`` bytes, or ``None`` until older regions are freed."""
        if size > self.capacity:
            raise ValueError(f"A {size:,}-byte shard image cannot fit the {self.capacity:,}-byte staging pool. {pool_fix(size)}")
        if not self._live:
            start = 0
        else:
            oldest, newest_end = self._live[0][0], self._live[-1][1]
            wrapped = self._live[-1][0] < oldest
            if not wrapped and newest_end + size <= self.capacity:
                start = newest_end
            elif not wrapped and size <= oldest:
                start = 0
            elif wrapped and newest_end + size <= oldest:
                start = newest_end
            else:
                return None
        self._live.append((start, start + size))
        return start

    def free_oldest(self) -> None:
        self._live.popleft()
