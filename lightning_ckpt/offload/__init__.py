"""Optimizer state off the device: chunked host memory stepped on the CPU (``ChunkedAdamW``)."""

from lightning_ckpt.offload.adamw import ChunkedAdamW, ChunkedAdamWError

__all__ = ["ChunkedAdamW", "ChunkedAdamWError"]
