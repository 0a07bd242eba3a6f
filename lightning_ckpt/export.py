"""Export a checkpoint's model to a Hugging Face folder: ``from_pretrained(folder)`` loads it.

``export_hf`` reads the checkpoint's ``state_dict`` (lazily: CPU tensors are maps of the shard
files), finds the prefix under which the LightningModule holds the Hugging Face model (the
attribute name, e.g. ``model.`` or ``net.``), strips it, stores tied weights once (as
``save_pretrained`` does), casts to ``dtype`` if asked, and writes safetensors files of at most
``max_shard_size`` one at a time (so at most one output file's tensors are materialized), the
index when there are several, and ``config.json``.

The config comes from ``config`` (a ``PretrainedConfig``, a dict, or a path to a ``config.json`` or
a folder holding one), else from the checkpoint's ``hyper_parameters`` (a ``PretrainedConfig``, or
a dict with a ``model_type``, at the top level or one level down: what ``save_hyperparameters()``
stores). With transformers importable the config also tells which keys the model expects: the
prefix is the one under which they all are, and a checkpoint that lacks some is refused. Nothing
here imports Lightning; transformers only where a config needs it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from lightning_ckpt.errors import CheckpointError, UnsafeCheckpointError
from lightning_ckpt.format.plan import parse_size
from lightning_ckpt.functional import load_checkpoint

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_HF_INDEX = "model.safetensors.index.json"


class ExportError(CheckpointError, ValueError):
    """The checkpoint cannot be exported as asked (no config, an ambiguous or missing prefix)."""


def export_hf(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    prefix: str = "auto",
    dtype: str | torch.dtype | None = None,
    config: Any = None,
    max_shard_size: int | str = "5GB",
    weights_only: bool | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``checkpoint``'s model as a Hugging Face folder at ``out_dir``; what was written.

    Args:
        checkpoint: a checkpoint folder (local, a URL, or written by several ranks) or a legacy file.
        out_dir: the folder to write (created; files of an earlier export there are replaced).
        prefix: ``"auto"`` (the one attribute holding the model; refused, listing the candidates,
            when several could), ``""`` (keys as they are), or the attribute name (``"net"``).
        dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` or a torch dtype: floating tensors cast to it;
            ``None`` keeps each tensor's dtype.
        config: the model's config (see the module docstring); ``None``: from ``hyper_parameters``.
        max_shard_size: bytes per safetensors file (``"5GB"``, as ``save_pretrained``).
        weights_only: as for :func:`lightning_ckpt.load_checkpoint`; a config stored as a
            ``PretrainedConfig`` object needs ``False`` (trusted checkpoints only) or ``config``.
        storage_options: for a URL, passed to its fsspec filesystem.

    Returns: ``{"files": [...], "prefix": str, "tensors": int, "bytes": int, "dropped_tied": [...]}``.
    """
    target = _dtype(dtype)
    limit = parse_size(max_shard_size, "max_shard_size")
    try:
        loaded = load_checkpoint(checkpoint, weights_only=weights_only, storage_options=storage_options)
    except UnsafeCheckpointError as exc:
        if not (exc.key or "").startswith("checkpoint['hyper_parameters']"):
            raise
        raise ExportError(
            f"{os.fspath(checkpoint)}: its hyper_parameters need unpickling to load (at {exc.key}). Pass the"
            " model's config (`--config PATH` / `config=`: a config.json or its folder), or"
            " `weights_only=False` (`--unsafe-load`) if you trust this checkpoint."
        ) from exc
    state = loaded.get("state_dict")
    if not isinstance(state, Mapping) or not state:
        raise ExportError(f"{os.fspath(checkpoint)} holds no `state_dict` with tensors: nothing to export.")
    found = _config(config, loaded.get("hyper_parameters"), os.fspath(checkpoint))
    expected, tied_keys = _expected_keys(found)
    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
    chosen = _prefix(prefix, keys, expected, tied_keys, os.fspath(checkpoint))
    weights = {k[len(chosen):]: v for k, v in state.items() if k.startswith(chosen) and isinstance(v, torch.Tensor)}
    if expected is not None:
        missing = sorted(expected - weights.keys() - tied_keys)
        if missing:
            raise ExportError(
                f"{os.fspath(checkpoint)}: under the prefix {chosen!r} the state lacks {len(missing)} of the model's"
                f" weights ({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}). Name the attribute holding"
                " the model with `prefix=`, or check that the config is this model's."
            )
        weights = {k: v for k, v in weights.items() if k in expected}  # buffers HF does not save, extra heads
    weights, dropped = _untie(weights, tied_keys)
    if target is not None:
        weights = {k: v.to(target) if v.is_floating_point() else v for k, v in weights.items()}
    os.makedirs(out_dir, exist_ok=True)
    files = _write_shards(weights, os.fspath(out_dir), limit)
    _write_config(found, os.fspath(out_dir))
    return {
        "files": files,
        "prefix": chosen,
        "tensors": len(weights),
        "bytes": sum(v.numel() * v.element_size() for v in weights.values()),
        "dropped_tied": dropped,
    }


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ExportError(f"`dtype={dtype!r}`: use one of {', '.join(DTYPES)} (or leave it out to keep the saved dtypes).")
    return DTYPES[dtype]


def _config(config: Any, hparams: Any, where: str) -> Any:
    """The model's config: ``config`` as given (a path is read), else the one in ``hparams``."""
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else os.fspath(config)
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            raise ExportError(f"`config={os.fspath(config)!r}`: cannot read a config.json there ({exc}).") from exc
    if config is not None:
        return config
    candidates = [v for v in _hparam_values(hparams) if _is_pretrained_config(v) or (isinstance(v, Mapping) and "model_type" in v)]
    if not candidates:
        raise ExportError(
            f"{where}: no model config in its hyper_parameters (a transformers PretrainedConfig, or a dict with"
            " `model_type`, stored by `self.save_hyperparameters()`). Pass one: `--config PATH` (a config.json"
            " or its folder) / `config=`."
        )
    if len(candidates) > 1:
        raise ExportError(f"{where}: its hyper_parameters hold {len(candidates)} model configs; pass the one to export with `config=`.")
    return candidates[0]


def _hparam_values(hparams: Any) -> Iterator[Any]:
    """``hparams`` itself, then its values (one level down)."""
    yield hparams
    if isinstance(hparams, Mapping):
        yield from hparams.values()


def _is_pretrained_config(value: Any) -> bool:
    """A transformers config object (``PretrainedConfig``, ``PreTrainedConfig`` in transformers 5),
    told by what it does rather than imported: transformers is optional."""
    return not isinstance(value, Mapping) and all(hasattr(value, a) for a in ("model_type", "to_dict", "save_pretrained"))


def _expected_keys(config: Any) -> tuple[set[str] | None, set[str]]:
    """The keys ``save_pretrained`` writes for ``config``'s model and its tied keys (dropped there),
    from the model built on the meta device; ``(None, set())`` without transformers."""
    try:
        import transformers
    except ImportError:
        return None, set()
    if not _is_pretrained_config(config):
        config = transformers.AutoConfig.for_model(**dict(config))
    architectures = getattr(config, "architectures", None) or []
    with torch.device("meta"):
        model = None
        for name in architectures:
            cls = getattr(transformers, name, None)
            if cls is not None:
                model = cls(config)
                break
        if model is None:
            model = transformers.AutoModelForCausalLM.from_config(config)
    keys = set(model.state_dict().keys())
    tied: set[str] = set()
    declared = getattr(model, "_tied_weights_keys", None) or []
    if getattr(config, "tie_word_embeddings", False):
        tied.update(declared.keys() if isinstance(declared, Mapping) else declared)
    return keys, {k for k in tied if k in keys}


def _prefix(prefix: str, keys: list[str], expected: set[str] | None, tied: set[str], where: str) -> str:
    """The prefix to strip (ending in ``.``, or ``""``)."""
    if prefix != "auto":
        chosen = prefix if not prefix or prefix.endswith(".") else prefix + "."
        if not any(k.startswith(chosen) for k in keys):
            raise ExportError(f"{where}: no key of its state_dict starts with {chosen!r}; its attributes: {_tops(keys)}.")
        return chosen
    tops = sorted({k.split(".", 1)[0] + "." for k in keys if "." in k})
    if expected is not None:
        # the prefixes under which every weight the model expects is found (a tied one may be absent)
        fits = [p for p in ["", *tops] if expected <= {k[len(p):] for k in keys if k.startswith(p)} | tied]
        if len(fits) == 1:
            return fits[0]
        if fits:
            raise ExportError(
                f"{where}: several attributes of the LightningModule hold the model's weights"
                f" ({', '.join(repr(p[:-1]) for p in fits)}): name the one to export with `prefix=`."
            )
        raise ExportError(
            f"{where}: no attribute of the LightningModule holds all of the model's weights (attributes: {_tops(keys)})."
            " Name the one holding it with `prefix=`, or check that the config is this model's."
        )
    if len(tops) == 1:
        return tops[0]
    raise ExportError(
        f"{where}: its state_dict has several top-level attributes ({_tops(keys)}): name the one holding the"
        " Hugging Face model with `prefix=` (with transformers installed, `auto` picks it from the config)."
    )


def _tops(keys: list[str]) -> str:
    return ", ".join(sorted({repr(k.split(".", 1)[0]) for k in keys})) or "none"


def _untie(weights: dict[str, torch.Tensor], tied_keys: set[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tied weights stored once, as ``save_pretrained`` does: the keys the model declares tied
    (``from_pretrained`` ties them again) are dropped, and of other names of one memory the first kept."""
    kept: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...], torch.dtype]] = set()
    dropped = []
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if name in tied_keys or (tensor.numel() and key in seen):
            dropped.append(name)
            continue
        seen.add(key)
        kept[name] = tensor
    return kept, sorted(dropped)


def _write_shards(weights: dict[str, torch.Tensor], out_dir: str, limit: int) -> list[str]:
    """safetensors files of at most ``limit`` bytes (a tensor larger than that alone in its own),
    one at a time; the index when there are several."""
    from safetensors.torch import save_file

    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in weights.items():
        n = tensor.numel() * tensor.element_size()
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    names = ["model.safetensors"] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    stale = [n for n in os.listdir(out_dir) if n.startswith("model") and (n.endswith(".safetensors") or n == _HF_INDEX)]
    for name in stale:
        os.remove(os.path.join(out_dir, name))
    weight_map = {}
    for file, group in zip(names, groups):
        # materialized here, one file at a time: contiguous copies of the maps (and the casts)
        save_file({k: weights[k].contiguous() for k in group}, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    if len(names) > 1:
        total = sum(v.numel() * v.element_size() for v in weights.values())
        with open(os.path.join(out_dir, _HF_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        return [*names, _HF_INDEX]
    return names


def _write_config(config: Any, out_dir: str) -> None:
    if _is_pretrained_config(config):
        config.save_pretrained(out_dir)
        return
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(config), f, indent=2, sort_keys=True)
