"""lightning_ckpt: fast, memory-safe, crash-safe checkpointing for PyTorch Lightning.

    from lightning_ckpt import ShardedCheckpointIO
    trainer = Trainer(plugins=[ShardedCheckpointIO()])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    MissingDependencyError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from lightning_ckpt.manifest import FORMAT_VERSION

__version__ = "0.1.0"

# Names that need Lightning are imported on first use, so the writer process (which only writes
# bytes) starts without importing Lightning.
_LAZY = {
    "ActivationCheckpointing": "lightning_ckpt.activation",
    "ActivationCheckpointingError": "lightning_ckpt.activation",
    "apply_activation_checkpointing": "lightning_ckpt.activation",
    "remove_activation_checkpointing": "lightning_ckpt.activation",
    "ChunkedAdamW": "lightning_ckpt.offload",
    "ChunkedOffloadStrategy": "lightning_ckpt.offload.strategy",
    "OffloadBudgetError": "lightning_ckpt.offload.placement",
    "ShardedCheckpointIO": "lightning_ckpt.io",
    "ShardedModelCheckpoint": "lightning_ckpt.callback",
    "ShardedFabricDDPStrategy": "lightning_ckpt.fabric",
    "ShardedFabricFSDPStrategy": "lightning_ckpt.fabric",
    "ShardedFabricModelParallelStrategy": "lightning_ckpt.fabric",
    "ShardedFSDPStrategy": "lightning_ckpt.strategies",
    "ShardedModelParallelStrategy": "lightning_ckpt.strategies",
    "ShardedStorageReader": "lightning_ckpt.distributed",
    "load_checkpoint": "lightning_ckpt.functional",
    "load_from_checkpoint": "lightning_ckpt.functional",
    "remove_checkpoint": "lightning_ckpt.functional",
    "save_checkpoint": "lightning_ckpt.functional",
    "verify_checkpoint": "lightning_ckpt.functional",
}

if TYPE_CHECKING:
    from lightning_ckpt.activation import (
        ActivationCheckpointing,
        ActivationCheckpointingError,
        apply_activation_checkpointing,
        remove_activation_checkpointing,
    )
    from lightning_ckpt.callback import ShardedModelCheckpoint
    from lightning_ckpt.offload import ChunkedAdamW
    from lightning_ckpt.offload.placement import OffloadBudgetError
    from lightning_ckpt.offload.strategy import ChunkedOffloadStrategy
    from lightning_ckpt.distributed import ShardedStorageReader
    from lightning_ckpt.fabric import (
        ShardedFabricDDPStrategy,
        ShardedFabricFSDPStrategy,
        ShardedFabricModelParallelStrategy,
    )
    from lightning_ckpt.strategies import ShardedFSDPStrategy, ShardedModelParallelStrategy
    from lightning_ckpt.functional import (
        load_checkpoint,
        load_from_checkpoint,
        remove_checkpoint,
        save_checkpoint,
        verify_checkpoint,
    )
    from lightning_ckpt.io import ShardedCheckpointIO


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_ckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "FORMAT_VERSION",
    "ActivationCheckpointing",
    "ActivationCheckpointingError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "ChunkedAdamW",
    "ChunkedOffloadStrategy",
    "CorruptCheckpointError",
    "MissingDependencyError",
    "OffloadBudgetError",
    "ShardedCheckpointIO",
    "ShardedModelCheckpoint",
    "ShardedFabricDDPStrategy",
    "ShardedFabricFSDPStrategy",
    "ShardedFabricModelParallelStrategy",
    "ShardedFSDPStrategy",
    "ShardedModelParallelStrategy",
    "ShardedStorageReader",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "apply_activation_checkpointing",
    "load_checkpoint",
    "load_from_checkpoint",
    "remove_activation_checkpointing",
    "remove_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
