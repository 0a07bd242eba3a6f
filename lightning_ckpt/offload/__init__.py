"""Training memory off the device: optimizer state stepped on the CPU (``ChunkedAdamW``) and
parameters streamed from host chunks (``ChunkedOffloadStrategy``)."""

from lightning_ckpt.offload.adamw import ChunkedAdamW, ChunkedAdamWError

from lightning_ckpt.offload.placement import OffloadBudgetError

__all__ = ["ChunkedAdamW", "ChunkedAdamWError", "ChunkedOffloadStrategy", "OffloadBudgetError"]


def __getattr__(name: str) -> object:
    if name == "ChunkedOffloadStrategy":  # imports Lightning: only on use
        from lightning_ckpt.offload.strategy import ChunkedOffloadStrategy

        return ChunkedOffloadStrategy
    raise AttributeError(f"module 'lightning_ckpt.offload' has no attribute {name!r}")
