"""``torch.compile`` and state dicts: keys without ``_orig_mod.``, loadable both ways.

Compiling a submodule (``self.net = torch.compile(net)``) inserts ``_orig_mod.`` into its
state-dict keys, so a checkpoint of a compiled model does not load into an uncompiled one and
vice versa. ``strip_compiled_prefixes`` writes keys as the uncompiled model has them;
``align_keys_to`` renames incoming keys to whatever form a module expects. Neither touches the
compiled module itself, so no guard fails and nothing recompiles. Nothing here imports Lightning.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch

COMPILED_SEGMENT = "_orig_mod."


def normalize_key(key: str) -> str:
    """``net._orig_mod.layer.weight`` -> ``net.layer.weight``."""
    return key.replace(COMPILED_SEGMENT, "") if COMPILED_SEGMENT in key else key


def strip_compiled_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict with ``_orig_mod.`` removed from every key (and from ``_metadata``)."""
    if not any(COMPILED_SEGMENT in k for k in state_dict):
        return state_dict
    result: dict[str, Any] = OrderedDict((normalize_key(k), v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        stripped = OrderedDict()
        for prefix, value in metadata.items():  # module prefixes: "", "net", "net._orig_mod", ...
            stripped.setdefault(normalize_key(prefix + ".").removesuffix("."), value)
        result._metadata = stripped  # type: ignore[attr-defined]
    return result


def align_keys_to(expected: list[str], state_dict: MutableMapping[str, Any]) -> int:
    """Rename keys of ``state_dict`` in place to the form in ``expected`` (compiled or not).

    A key is renamed only when its normalized form matches exactly one expected key; returns the
    number of keys renamed.
    """
    by_normalized: dict[str, str] = {}
    for key in expected:
        by_normalized.setdefault(normalize_key(key), key)
    renamed = 0
    for key in list(state_dict.keys()):
        target = by_normalized.get(normalize_key(key))
        if target is not None and target != key and target not in state_dict:
            state_dict[target] = state_dict.pop(key)
            renamed += 1
    return renamed


def install_load_hook(module: torch.nn.Module) -> Any:
    """Make ``module.load_state_dict`` accept keys with or without ``_orig_mod.``.

    Returns the hook handle (``handle.remove()`` undoes it).
    """

    def hook(mod: torch.nn.Module, state_dict: MutableMapping[str, Any], prefix: str, *args: Any) -> None:
        if prefix:  # only the root call sees full keys
            return
        # Nothing compiled on either side: nothing to align, and no ``state_dict()`` call (under
        # FSDP that gathers or re-shards every parameter, with collectives).
        compiled = any(COMPILED_SEGMENT[:-1] in name.split(".") for name, _ in mod.named_modules())
        if not compiled and not any(COMPILED_SEGMENT in key for key in state_dict):
            return
        align_keys_to(list(mod.state_dict().keys()), state_dict)

    return module.register_load_state_dict_pre_hook(hook)


@contextmanager
def load_hooks_on_compiled_submodules() -> Iterator[None]:
    """While active, each compiled submodule assigned on this thread (``self.net =
    torch.compile(net)`` in a constructor) loads keys with or without ``_orig_mod.``.

    For loaders that build the module and load it in one call (Lightning's
    ``load_from_checkpoint``), so there is no module to hook between the two. Module
    registrations on other threads are left alone; the hooks are removed on exit.
    """
    thread = threading.get_ident()
    handles: list[Any] = []

    def on_register(parent: torch.nn.Module, name: str, submodule: torch.nn.Module | None) -> None:
        if threading.get_ident() == thread and isinstance(getattr(submodule, "_orig_mod", None), torch.nn.Module):
            handles.append(submodule.register_load_state_dict_pre_hook(_align_below))  # type: ignore[union-attr]

    registration = torch.nn.modules.module.register_module_module_registration_hook(on_register)
    try:
        yield
    finally:
        registration.remove()
        for handle in handles:
            handle.remove()


def _align_below(module: torch.nn.Module, state_dict: MutableMapping[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook of a compiled submodule: its keys (under ``prefix``) in the form it expects."""
    align_keys_to([prefix + key for key in module.state_dict().keys()], state_dict)
