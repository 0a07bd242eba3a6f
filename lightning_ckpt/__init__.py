"""lightning_ckpt: fast, memory-safe, crash-safe checkpointing for PyTorch Lightning.

    from lightning_ckpt import ShardedCheckpointIO
    trainer = Trainer(plugins=[ShardedCheckpointIO()])
"""

from __future__ import annotations

from lightning_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from lightning_ckpt.io import (
    ShardedCheckpointIO,
    load_checkpoint,
    load_from_checkpoint,
    remove_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from lightning_ckpt.manifest import FORMAT_VERSION

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "ShardedCheckpointIO",
    "UnsafeCheckpointError",
    "UnsupportedFormatError",
    "load_checkpoint",
    "load_from_checkpoint",
    "remove_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
