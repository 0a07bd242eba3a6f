"""Gradients of ``ChunkedOffloadStrategy``'s parameters: out of the device as they are made, into
each chunk's gradient buffer in host memory, handed to the optimizer after backward.

Call order, per backward (``begin`` and ``finish`` on the main thread, ``arrive`` on autograd's):

1. ``begin``: each parameter's gradient from earlier backwards (gradient accumulation; host
   memory) is put aside and ``.grad`` set to ``None``, so that autograd never adds a device
   gradient to a host tensor.
2. ``arrive`` (a post-accumulate-grad hook, registered before any optimizer's): the gradient autograd
   just made is copied on the gradient stream, after an event on the compute stream, into the
   parameter's view of its chunk's buffer (or, when it has to be added to one already there, into
   a host staging tensor), and ``.grad`` is set to ``None`` again (the device memory is reused once
   the copy is done). A parameter can arrive more than once in a backward: one whose data moved
   between devices gets a new gradient accumulator in autograd.
3. ``finish`` (the parameters back in host memory): waits for every copy, adds the staged
   gradients to what is there, in arrival order, and sets each ``.grad`` to its host tensor.

On the CPU the copies are plain copies; the arithmetic is autograd's own (``a + b`` per arrival),
so the gradients equal those of the default strategy bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_ckpt.offload.streams import Streams


class HostGrads:
    """The host gradient buffers of a chunk layout (page-locked when the device is CUDA)."""

    def __init__(
        self,
        streams: Streams,
        params: Sequence[torch.nn.Parameter],
        places: Sequence[tuple[int, int]],
        buffers: dict[int, torch.Tensor],
        pin: bool,
    ) -> None:
        """``places[i]``: (chunk, byte offset) of ``params[i]``; ``buffers``: the gradient buffer
        (bytes, laid out as the chunk) of each chunk holding a parameter that requires grad;
        ``pin``: page-lock the staging tensors of accumulated gradients."""
        self._streams = streams
        self._pin = pin
        self._view: dict[int, torch.Tensor] = {}  # id(parameter) -> its view of a buffer
        for p, (chunk, offset) in zip(params, places):
            if chunk in buffers and p.requires_grad:
                n = p.numel() * p.element_size()
                self._view[id(p)] = buffers[chunk][offset : offset + n].view(p.dtype).view(p.shape)
        self._params = {id(p): p for p in params}
        self._prior: dict[int, torch.Tensor] = {}
        self._arrived: dict[int, list[Optional[torch.Tensor]]] = {}  # id -> staged additions (None: in the view)
        # The event of the last copy out of this backward: copies out run in issue order on one
        # stream (CUDA's D2H stream, HostStreams' one copy thread), so when it is done all are.
        self._last_copy: Any = None
        self.open = False
        self.d2h_bytes = 0

    def adopt(self, old: HostGrads) -> None:
        """Gradients that ``old``'s buffers hold (a repacked layout): copied into these."""
        for key, p in self._params.items():
            grad = p.grad
            if grad is not None and key in old._view and grad.data_ptr() == old._view[key].data_ptr():
                self._view[key].copy_(grad)
                p.grad = self._view[key]

    def begin(self) -> None:
        if self.open:
            return
        self.open = True
        for key, p in self._params.items():
            if p.grad is not None:
                self._prior[key] = p.grad
                p.grad = None

    def arrive(self, p: torch.Tensor) -> None:
        grad = p.grad
        key = id(p)
        if grad is None or key not in self._view:
            return
        self.begin()  # a backward not started through the strategy: nothing was put aside
        staged = self._arrived.setdefault(key, [])
        if key in self._prior or staged:
            dst: Optional[torch.Tensor] = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self._pin)
            staged.append(dst)
        else:
            dst = None
            staged.append(None)
        target = self._view[key] if dst is None else dst
        # After every kernel issued so far, among them the one that wrote ``grad``.
        made = self._streams.record(("grad", key))
        self._last_copy = self._streams.copy_out(target, grad, after=made, label=("grad", key))
        self.d2h_bytes += grad.numel() * grad.element_size()
        p.grad = None

    def finish(self) -> None:
        """Call with every parameter's data in host memory (``.grad`` must match its device)."""
        if not self.open:
            return
        if self._last_copy is not None:
            self._streams.synchronize(self._last_copy)
            self._last_copy = None
        with torch.no_grad():
            for key, p in self._params.items():
                staged = self._arrived.get(key)
                prior = self._prior.get(key)
                if not staged:
                    if prior is not None:
                        p.grad = prior
                    continue
                total = prior if prior is not None else self._view[key]
                for addition in staged:
                    if addition is not None:
                        total.add_(addition)
                p.grad = total
        self._prior = {}
        self._arrived = {}
        self.open = False
