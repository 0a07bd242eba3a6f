"""The module and parameter hooks of ``ChunkedAdamW``; each holds the optimizer weakly, so a
dropped optimizer is collected (and its worker ended) whatever modules outlive it.

All run on the main thread, from autograd (``GradMover``) or a module call (the others).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from lightning_ckpt.offload.stepper import Chunk

if TYPE_CHECKING:
    from lightning_ckpt.offload.adamw import ChunkedAdamW


class GradMover:
    """Post-accumulate-grad hook: a gradient autograd just created moves into its view at once, so
    clipping and scaling see the views and the fresh tensor is freed during backward."""

    def __init__(self, optimizer: weakref.ref[ChunkedAdamW]) -> None:
        self._optimizer = optimizer

    def __call__(self, p: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is None or p not in optimizer._where:
            return
        chunk, i = optimizer._where[p]
        grad = p.grad
        if grad is not None and grad.layout == torch.strided and grad.data_ptr() != chunk.grad_views()[i].data_ptr():
            chunk.done.wait()  # the buffer is not being read by a step still in flight
            with torch.no_grad():
                optimizer._into_view(chunk, i)


class Discover:
    """Global forward pre-hook until the first ``step()``: finds the modules holding our params."""

    def __init__(self, optimizer: weakref.ref[ChunkedAdamW]) -> None:
        self._optimizer = optimizer

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._adopt(module)


class ChunkWaiter:
    """Forward pre-hook and state_dict pre-hook of a module: waits for its parameters' chunks."""

    def __init__(self, optimizer: weakref.ref[ChunkedAdamW], chunks: list[Chunk]) -> None:
        self._optimizer = optimizer
        self._chunks = chunks

    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._wait(self._chunks)
