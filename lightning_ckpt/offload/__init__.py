"""Training memory off the device, no Lightning: the optimizer engine (``ChunkedAdamW``:
optimizer state in host chunks, stepped on the CPU) and the streaming engine (``streamer``:
parameters streamed from host chunks under a budget; ``lightning.offload_strategy`` adapts it
into ``ChunkedOffloadStrategy``). Imports ``hostmem`` and ``format`` helpers only."""

from lightning_ckpt.offload.adamw import ChunkedAdamW, ChunkedAdamWError
from lightning_ckpt.offload.placement import OffloadBudgetError

__all__ = ["ChunkedAdamW", "ChunkedAdamWError", "OffloadBudgetError"]
