"""lightning_ckpt: fast, memory-safe, crash-safe checkpointing for PyTorch Lightning.

    from lightning_ckpt import ShardedCheckpointIO
    trainer = Trainer(plugins=[ShardedCheckpointIO()])
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from lightning_ckpt._version import __version__ as __version__
from lightning_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    MissingDependencyError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from lightning_ckpt.format.manifest import FORMAT_VERSION

# Names that need Lightning are imported on first use, so the writer process (which only writes
# bytes) starts without importing Lightning.
_LAZY = {
    "ActivationCheckpointing": "lightning_ckpt.lightning.activation",
    "ActivationCheckpointingError": "lightning_ckpt.lightning.activation",
    "apply_activation_checkpointing": "lightning_ckpt.lightning.activation",
    "remove_activation_checkpointing": "lightning_ckpt.lightning.activation",
    "ChunkedAdamW": "lightning_ckpt.offload",
    "ChunkedOffloadStrategy": "lightning_ckpt.lightning.offload_strategy",
    "OffloadBudgetError": "lightning_ckpt.offload.placement",
    "ShardedCheckpointIO": "lightning_ckpt.lightning.plugin",
    "ShardedModelCheckpoint": "lightning_ckpt.lightning.callback",
    "ShardedFabricDDPStrategy": "lightning_ckpt.lightning.fabric",
    "ShardedFabricFSDPStrategy": "lightning_ckpt.lightning.fabric",
    "ShardedFabricModelParallelStrategy": "lightning_ckpt.lightning.fabric",
    "ShardedFSDPStrategy": "lightning_ckpt.lightning.strategies",
    "ShardedModelParallelStrategy": "lightning_ckpt.lightning.strategies",
    "ShardedStorageReader": "lightning_ckpt.format.dcp",
    "ExportError": "lightning_ckpt.export",
    "export_hf": "lightning_ckpt.export",
    "load_checkpoint": "lightning_ckpt.functional",
    "load_from_checkpoint": "lightning_ckpt.lightning.loading",
    "remove_checkpoint": "lightning_ckpt.functional",
    "save_checkpoint": "lightning_ckpt.functional",
    "verify_checkpoint": "lightning_ckpt.functional",
}

if TYPE_CHECKING:
    from lightning_ckpt.export import ExportError, export_hf
    from lightning_ckpt.format.dcp import ShardedStorageReader
    from lightning_ckpt.functional import (
        load_checkpoint,
        remove_checkpoint,
        save_checkpoint,
        verify_checkpoint,
    )
    from lightning_ckpt.lightning.activation import (
        ActivationCheckpointing,
        ActivationCheckpointingError,
        apply_activation_checkpointing,
        remove_activation_checkpointing,
    )
    from lightning_ckpt.lightning.callback import ShardedModelCheckpoint
    from lightning_ckpt.lightning.fabric import (
        ShardedFabricDDPStrategy,
        ShardedFabricFSDPStrategy,
        ShardedFabricModelParallelStrategy,
    )
    from lightning_ckpt.lightning.loading import load_from_checkpoint
    from lightning_ckpt.lightning.offload_strategy import ChunkedOffloadStrategy
    from lightning_ckpt.lightning.plugin import ShardedCheckpointIO
    from lightning_ckpt.lightning.strategies import (
        ShardedFSDPStrategy,
        ShardedModelParallelStrategy,
    )
    from lightning_ckpt.offload import ChunkedAdamW
    from lightning_ckpt.offload.placement import OffloadBudgetError


# Module paths of the flat layout (before 0.2): LightningCLI configs, pickles and user code name
# them (``lightning_ckpt.io.ShardedCheckpointIO``). Each old path imports as a module that forwards
# every name to the module that holds it now: the classes are the same objects.
_MOVED = {
    "lightning_ckpt.activation": "lightning_ckpt.lightning.activation",
    "lightning_ckpt.callback": "lightning_ckpt.lightning.callback",
    "lightning_ckpt.digests": "lightning_ckpt.format.digests",
    "lightning_ckpt.distributed": "lightning_ckpt.format.dcp",
    "lightning_ckpt.fabric": "lightning_ckpt.lightning.fabric",
    "lightning_ckpt.incremental": "lightning_ckpt.save.changes",
    "lightning_ckpt.io": "lightning_ckpt.lightning.plugin",
    "lightning_ckpt.legacy_dcp": "lightning_ckpt.format.legacy",
    "lightning_ckpt.manifest": "lightning_ckpt.format.manifest",
    "lightning_ckpt.memory": "lightning_ckpt.lightning.release",
    "lightning_ckpt.monitor": "lightning_ckpt.lightning.monitor",
    "lightning_ckpt.offload.strategy": "lightning_ckpt.lightning.offload_strategy",
    "lightning_ckpt.parts": "lightning_ckpt.store.parts",
    "lightning_ckpt.pinning": "lightning_ckpt.hostmem",
    "lightning_ckpt.plan": "lightning_ckpt.format.plan",
    "lightning_ckpt.reader": "lightning_ckpt.format.reader",
    "lightning_ckpt.records": "lightning_ckpt.lightning.records",
    "lightning_ckpt.resume": "lightning_ckpt.lightning.resume",
    "lightning_ckpt.savejob": "lightning_ckpt.save.job",
    "lightning_ckpt.saver": "lightning_ckpt.save.background",
    "lightning_ckpt.schedule": "lightning_ckpt.lightning.schedule",
    "lightning_ckpt.server_copy": "lightning_ckpt.remote.server_copy",
    "lightning_ckpt.shards": "lightning_ckpt.store.shards",
    "lightning_ckpt.staging": "lightning_ckpt.save.staging",
    "lightning_ckpt.strategies": "lightning_ckpt.lightning.strategies",
    "lightning_ckpt.worker": "lightning_ckpt.save.worker",
    "lightning_ckpt.writer": "lightning_ckpt.store.commit",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path (``_MOVED``) as a module forwarding to the new one. First on
    ``sys.meta_path``: an old path is never a file (an editable install's finder of another
    checkout must not find one there)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def exec_module(self, module: ModuleType) -> None:
        target = importlib.import_module(_MOVED[module.__name__])
        module.__doc__ = f"Moved to ``{target.__name__}`` (this old path forwards every name there)."
        module.__getattr__ = lambda name: getattr(target, name)  # type: ignore[method-assign]
        module.__dir__ = lambda: dir(target)  # type: ignore[method-assign]


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())


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
    "ExportError",
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
    "export_hf",
    "load_checkpoint",
    "load_from_checkpoint",
    "remove_activation_checkpointing",
    "remove_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
