"""``load_from_checkpoint``: Lightning's ``LightningModule.load_from_checkpoint`` for checkpoint
directories too (Lightning's own reads single files only, bypassing the CheckpointIO)."""

from __future__ import annotations

import os
import threading
from typing import Any, TypeVar

from lightning.pytorch.core import saving

from lightning_ckpt.compile import load_hooks_on_compiled_submodules
from lightning_ckpt.format import reader
from lightning_ckpt.functional import load_checkpoint

_T = TypeVar("_T")


_load_patch_lock = threading.Lock()


def load_from_checkpoint(
    cls: type[_T],
    checkpoint_path: str | os.PathLike[str],
    map_location: reader.MapLocation = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> _T:
    """``cls.load_from_checkpoint`` that also reads checkpoint directories.

    Lightning's own ``LightningModule.load_from_checkpoint`` bypasses CheckpointIO and fails on a
    directory. This runs Lightning's implementation unchanged (hyper-parameters, migration,
    ``strict``, ``**kwargs`` overrides) with the file read by :func:`load_checkpoint`. A submodule
    compiled in ``__init__`` (``self.net = torch.compile(net)``) loads keys with or without
    ``_orig_mod.``, as ``ShardedModelCheckpoint(compile_safe=True)`` does for the Trainer::

        model = load_from_checkpoint(MyModel, "checkpoints/last.ckpt")
    """
    def _load(path: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        return load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    with _load_patch_lock, load_hooks_on_compiled_submodules():
        original = saving.pl_load
        saving.pl_load = _load
        try:
            return cls.load_from_checkpoint(  # type: ignore[attr-defined,no-any-return]
                checkpoint_path,
                map_location=map_location,
                hparams_file=hparams_file,
                strict=strict,
                weights_only=weights_only,
                **kwargs,
            )
        finally:
            saving.pl_load = original


__all__ = ["load_from_checkpoint"]
