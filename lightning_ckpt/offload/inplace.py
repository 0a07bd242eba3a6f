"""Host memory whose fp32 parameters ``ChunkedAdamW`` steps in place, with no master copy.

An owner of parameter memory (``ChunkedOffloadStrategy``'s streamer: its host chunks) registers
its regions here. A ``ChunkedAdamW`` built afterwards over a chunk whose parameters are all fp32
views of registered regions allocates no master weights for it: the parameters are the master
weights, and its worker runs the fused kernel on them where they are.

Invariant the registering owner promises: it reads and moves those bytes only after
``ChunkedAdamW.wait_for`` (or ``wait``) of the parameters viewing them, and when it re-lays them
out it copies the values and points the parameters at their new place (``p.data = ...``), which
the optimizer follows at its next ``step()``. Registrations are read only when an optimizer is
built; the owner unregisters before its memory goes (a repack, its end). Any thread may call in.
Nothing here imports Lightning.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Iterable

import torch

# Reentrant, and read through a snapshot: an owner's finalizer (``unregister``) may run from a
# garbage collection on a thread inside ``steps_in_place`` or ``register``.
_lock = threading.RLock()
_regions: dict[int, list[tuple[int, int]]] = {}  # id(owner) -> [start, end) addresses of its regions


def register(owner: object, regions: Iterable[torch.Tensor]) -> None:
    """``owner``'s host ``regions`` (replacing what it registered before); dropped when ``owner``
    is collected, if it did not ``unregister`` first."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in regions if t.numel())
    with _lock:
        fresh = id(owner) not in _regions
        _regions[id(owner)] = spans
    if fresh:
        weakref.finalize(owner, unregister, id(owner))


def unregister(owner: object | int) -> None:
    """Forget ``owner``'s regions (or those registered under the id ``owner``)."""
    with _lock:
        _regions.pop(owner if isinstance(owner, int) else id(owner), None)


def steps_in_place(p: torch.Tensor) -> bool:
    """Is ``p`` an fp32, contiguous host tensor lying within one registered region? An empty one
    holds no bytes: it is (it must not keep a master for its whole chunk)."""
    if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
        return False
    if p.numel() == 0:
        return True
    start = p.data_ptr()
    end = start + p.numel() * p.element_size()
    with _lock:
        registered = list(_regions.values())
    for spans in registered:  # each sorted by start, not overlapping
        i = bisect.bisect_right(spans, (start, float("inf"))) - 1
        if i >= 0 and end <= spans[i][1]:
            return True
    return False
