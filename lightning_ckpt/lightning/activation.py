"""Activation (gradient) checkpointing for any strategy, with state-dict keys left unchanged.

A checkpointed module keeps only its inputs for the backward pass; the activations inside it are
recomputed when the gradient reaches it (``torch.utils.checkpoint``, non-reentrant). Torch's own
``CheckpointWrapper`` (what Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)``
applies) inserts a ``_checkpoint_wrapped_module`` level into the module tree; here the module tree
is left alone: the matched module's ``forward`` is replaced *on the instance* by a
``functools.partial`` of :func:`_checkpointed_forward`, which calls the class's ``forward`` under
``checkpoint(..., use_reentrant=False)``. Consequences:

* ``state_dict`` / ``named_parameters`` keys are those of the plain model, so checkpoints move
  freely between runs with and without checkpointing, through any CheckpointIO;
* module hooks (FSDP2's unshard / reshard, DDP's, user hooks) run in ``Module.__call__`` around
  ``forward``, so they stay *outside* the checkpointed region whether the forward is replaced
  before or after ``fully_shard``: the recompute runs inside the FSDP unit, after its pre-backward
  all-gather, as with torchtitan's "checkpoint wrapper, then fully_shard" order;
* ``copy.deepcopy`` of the model (EMA, SWA) gives a copy whose replaced forward calls the copy
  (the partial's arguments are deep-copied with the module), and the model pickles;
* :func:`remove_activation_checkpointing` restores the instance exactly (the callback does it at
  ``teardown``).

Without gradients (validation, ``no_grad``, ``inference_mode``) the original forward runs
directly. In eager mode every checkpointed call checks that the forward did not modify its
tensor inputs or the module's buffers in place (the recompute would apply the update twice and
give wrong gradients or statistics) and raises :class:`ActivationCheckpointingError` naming the
module; under ``torch.compile`` that check is skipped (it would add graph breaks).

Layers with a key/value cache (Hugging Face's: a ``past_key_value(s)``, ``layer_past`` or
``cache`` argument) extend it in forward, and the recompute would extend it again (a cache twice
as long; with some layers wrong gradients or torch's "Recomputed values ... different metadata"
error). In eager training such a call gets ``None`` for its cache, with one warning per layer
class, as Hugging Face's own gradient checkpointing runs its layers. Any other recompute that
differs from its forward still fails in torch; the callback's ``on_exception`` then names the
layer recomputed last, the likely cause and the fix in that error's message
(:func:`explain_recompute_mismatch`).

Call order in a ``Trainer.fit`` (checked against Lightning 2.6's ``Trainer._run``)::

    callback.setup -> LightningModule.configure_model (user's fully_shard) -> strategy.setup
    (DDP / FSDP1 wrapping, FSDP2 materialization) -> callback.on_fit_start  <- applied here
    -> training ... -> callback.teardown                                     <- removed here

Lightning has no callback hook between ``configure_model`` and ``strategy.setup``. Applying at
``on_fit_start`` is correct for every strategy (see the second point above); to apply it
explicitly before ``fully_shard``, call :func:`apply_activation_checkpointing` inside
``configure_model`` (the callback then finds those modules already done and leaves them).
Every hook runs on every rank; nothing here communicates.
"""

import functools
import inspect
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from typing_extensions import override

Policy = Union[set[type[torch.nn.Module]], Callable[[torch.nn.Module], bool]]

# Selective mode keeps the outputs of these ops (the expensive ones: matmuls, attention) and
# recomputes everything else (norms, activations, dropout, residual adds, views). Names that this
# torch build lacks are skipped.
SELECTIVE_MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm")
SELECTIVE_SAVE_OPS = (
    *SELECTIVE_MATMUL_OPS,
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)


class ActivationCheckpointingError(RuntimeError):
    """A checkpointed module cannot be recomputed safely (it updates its inputs or buffers in place)."""


# The values of ``selective``: what a checkpointed layer keeps (True means "matmuls").
SELECTIVE_MODES = ("matmuls", "every_other_matmul")


@dataclass(frozen=True)
class _Options:
    preserve_rng_state: bool
    selective: Optional[str]  # one of SELECTIVE_MODES, or None: recompute everything
    check_inplace: bool


class _Installed:
    """What one replaced ``forward`` needs: the module, the forward it replaced, the options.

    ``impl`` is the class's ``forward`` function (called with the module) when the instance had no
    ``forward`` of its own, else the instance's previous ``forward`` (restored on removal).
    """

    __slots__ = ("module", "impl", "bound", "options", "path", "cache_parameters")

    def __init__(self, module: torch.nn.Module, impl: Callable[..., Any], bound: bool, options: _Options, path: str):
        self.module = module
        self.impl = impl
        self.bound = bound
        self.options = options
        self.path = path
        self.cache_parameters = _cache_parameters(impl, bound)  # read on every checkpointed call

    def __reduce__(self) -> Any:  # slots: pickle / deepcopy through the constructor
        return (_Installed, (self.module, self.impl, self.bound, self.options, self.path))


def _aten_ops(names: tuple[str, ...]) -> frozenset[Any]:
    ops = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


@functools.lru_cache(maxsize=1)
def _selective_save_ops() -> frozenset[Any]:
    return _aten_ops(SELECTIVE_SAVE_OPS)


@functools.lru_cache(maxsize=1)
def _matmul_ops() -> frozenset[Any]:
    return _aten_ops(SELECTIVE_MATMUL_OPS)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _selective_save_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _every_other_matmul_policy() -> Callable[..., CheckpointPolicy]:
    """Keep attention outputs and the 1st, 3rd, ... matmul of one layer call; recompute the rest.

    The forward and the recompute count their matmuls separately (``ctx.is_recompute``), so both
    pick the same ones: the recompute replays the forward's ops in the same order.
    """
    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _matmul_ops():
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _selective_policy(ctx, op)

    return policy


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def _every_other_matmul_context() -> Any:  # a fresh count for every checkpointed call
    return create_selective_checkpoint_contexts(_every_other_matmul_policy())


_CONTEXTS = {"matmuls": _selective_context, "every_other_matmul": _every_other_matmul_context}


def _selective_mode(selective: Any) -> Optional[str]:
    """``selective`` as one of ``SELECTIVE_MODES`` (None for False); a clear error otherwise."""
    if selective is False or selective is None:
        return None
    if selective is True:
        return "matmuls"
    if isinstance(selective, str) and selective in SELECTIVE_MODES:
        return selective
    raise ValueError(
        f"`selective={selective!r}` must be False (recompute everything), True or 'matmuls' (keep every matmul and"
        " attention output), or 'every_other_matmul' (keep attention outputs and every other matmul: more memory"
        " saved, more recompute)."
    )


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in an argument, one container level deep (what a forward typically receives)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value if isinstance(v, torch.Tensor))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor))


def _version(tensor: torch.Tensor) -> Optional[int]:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors have no version counter (and cannot be updated under grad)
        return None


def _inplace_report(installed: _Installed, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor, Optional[int]]]:
    named: list[tuple[str, torch.Tensor]] = []
    for i, arg in enumerate(args):
        named.extend((f"input {i}", t) for t in _tensors(arg))
    for key, arg in kwargs.items():
        named.extend((f"input {key!r}", t) for t in _tensors(arg))
    named.extend((f"buffer {name!r}", b) for name, b in installed.module.named_buffers())
    return [(name, t, _version(t)) for name, t in named]


def _check_versions(installed: _Installed, before: list[tuple[str, torch.Tensor, Optional[int]]]) -> None:
    changed = [name for name, t, version in before if version is not None and _version(t) != version]
    if not changed:
        return
    if all(name.startswith("buffer") for name in changed):
        why = "(e.g. BatchNorm statistics): the recompute in backward would update them a second time"
        fix = "or keep such layers out of the checkpointed blocks"
    else:
        why = (
            "(e.g. `x.mul_(...)`, `x += ...`, `relu_(x)`): the recompute in backward would see the updated"
            " values and give wrong gradients"
        )
        fix = "or make its forward out-of-place (`x = x * ...`)"
    raise ActivationCheckpointingError(
        f"Activation checkpointing: `{installed.path}` ({type(installed.module).__qualname__}) modified"
        f" {', '.join(changed)} in place during forward {why}. HINT: exclude it from the policy (a set of"
        f" types without {type(installed.module).__qualname__}, or a callable returning False for it), {fix}."
        " `check_inplace=False` skips this check."
    )


# Arguments through which Hugging Face style layers read and extend a key/value cache. Run
# checkpointed, the recompute in backward extends the cache a second time: a cache twice as long,
# and with some layers (GPT-2) wrong gradients. Hugging Face's own gradient checkpointing runs
# its layers without a cache in training; so do these.
CACHE_ARGUMENTS = ("past_key_value", "past_key_values", "layer_past", "cache")
_warned_cache: set[str] = set()  # layer classes warned about, once each
_recomputing = threading.local()  # ``path``, ``cls``: the layer recomputed last in this thread


def _cache_parameters(impl: Callable[..., Any], bound: bool) -> tuple[tuple[str, Optional[int]], ...]:
    """``impl``'s cache arguments (``CACHE_ARGUMENTS``) and their positions in a call (``None``:
    keyword only); the module itself is not counted where ``impl`` takes it first (``bound``)."""
    try:
        parameters = list(inspect.signature(impl).parameters.values())
    except (TypeError, ValueError):  # a builtin or C forward: nothing to find
        return ()
    if bound:
        parameters = parameters[1:]
    found = []
    for position, parameter in enumerate(parameters):
        if parameter.name in CACHE_ARGUMENTS:
            positional = parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
            found.append((parameter.name, position if positional else None))
    return tuple(found)


# Frames of these packages are not the caller a warning should point at (torch's ``Module.__call__``
# sits between a model's forward and the checkpointed layer).
_NOT_THE_CALLER = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__name__.split(".")[0]]))


def _caller_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in the function calling this: the innermost frame
    outside torch and this package (the model code that called the layer)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_NOT_THE_CALLER):
        frame, level = frame.f_back, level + 1
    return level


def _without_cache(installed: _Installed, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with every key/value cache it passes replaced by ``None`` (see
    ``CACHE_ARGUMENTS``); warns once per layer class when one was passed."""
    parameters = installed.cache_parameters
    stripped = [name for name in CACHE_ARGUMENTS if kwargs.get(name) is not None]
    if stripped:
        kwargs = {k: (None if k in CACHE_ARGUMENTS else v) for k, v in kwargs.items()}
    for name, position in parameters:
        if position is not None and position < len(args) and args[position] is not None:
            args = (*args[:position], None, *args[position + 1 :])
            stripped.append(name)
    if stripped:
        cls = type(installed.module).__qualname__
        if cls not in _warned_cache:
            _warned_cache.add(cls)
            warnings.warn(
                f"Activation checkpointing runs `{cls}` layers without their key/value cache"
                f" (`{stripped[0]}`) while training: the recompute in backward would extend the cache a second"
                " time (and give some layers wrong gradients). Hugging Face's own gradient checkpointing does"
                " the same. Pass `use_cache=False` to the model (or set `model.config.use_cache = False`) for"
                " training to silence this.",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )
    return args, kwargs


def _checkpointed_forward(installed: _Installed, *args: Any, **kwargs: Any) -> Any:
    """The replacement ``forward``: the original one under non-reentrant checkpointing."""
    impl = functools.partial(installed.impl, installed.module) if installed.bound else installed.impl
    if not torch.is_grad_enabled():
        return impl(*args, **kwargs)
    compiling = torch.compiler.is_compiling()
    if not compiling:  # both would break the graph: under torch.compile, pass use_cache=False yourself
        args, kwargs = _without_cache(installed, args, kwargs)
        impl = _noting_recomputes(installed, impl)
    options = installed.options
    # Keyword arguments go in through a partial, so that a user's ``debug=`` or ``context_fn=``
    # never collides with checkpoint's own (non-reentrant checkpointing tracks tensors it closes over).
    fn = functools.partial(impl, **kwargs) if kwargs else impl
    check = options.check_inplace and not compiling
    before = _inplace_report(installed, args, kwargs) if check else None
    if options.selective is not None:
        out = checkpoint(
            fn,
            *args,
            use_reentrant=False,
            preserve_rng_state=options.preserve_rng_state,
            context_fn=_CONTEXTS[options.selective],
        )
    else:  # no ``context_fn`` at all: dynamo rejects an explicit ``noop_context_fn``
        out = checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=options.preserve_rng_state)
    if before is not None:
        _check_versions(installed, before)
    return out


def _noting_recomputes(installed: _Installed, impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` noting, when it runs inside backward (the recompute), which layer it recomputes:
    a recompute that does not match the forward fails in torch after this returns, naming no
    layer (see :func:`explain_recompute_mismatch`)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() != -1:
            _recomputing.path, _recomputing.cls = installed.path, type(installed.module).__qualname__
        return impl(*args, **kwargs)

    return run


def explain_recompute_mismatch(exception: BaseException) -> None:
    """Torch's bare "Recomputed values ... have different metadata" error, explained in place
    (its type kept): the layer recomputed last, the likely cause, the fix."""
    message = str(exception)
    if not isinstance(exception, CheckpointError) or "different metadata" not in message or "lightning_ckpt" in message:
        return
    path, cls = getattr(_recomputing, "path", None), getattr(_recomputing, "cls", "the layer")
    where = f"`{path}` ({cls})" if path is not None else "a checkpointed layer"
    exception.args = (
        f"lightning_ckpt activation checkpointing: recomputing {where} in backward did not give the tensors its"
        " forward saved. Its forward depends on state it changes itself: most often a key/value cache it extends"
        " (`use_cache=True`), else a counter, a growing buffer or Python state read in forward. HINT: pass"
        f" `use_cache=False` for training, keep such state out of forward, or exclude {cls} from the policy."
        f"\n\nTorch's error: {message}",
        *exception.args[1:],
    )


def installed_checkpointing(module: torch.nn.Module) -> Optional[_Installed]:
    """The checkpointing installed on ``module`` by this module (its record), or ``None``."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, functools.partial) and forward.func is _checkpointed_forward:
        return forward.args[0]
    return None


def module_matcher(policy: Any, argument: str = "policy") -> Callable[[torch.nn.Module], bool]:
    """A predicate over modules from a user's policy (layer types, their import paths, or a
    callable); a bad policy is a ``ValueError`` naming ``argument``."""
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        types = tuple(_resolve_type(t, argument) for t in policy)
        if not types:
            raise ValueError(f"`{argument}` is empty; give the layer types to checkpoint, e.g. `{argument}={{Block}}`.")
        return lambda module: isinstance(module, types)
    if callable(policy):
        return policy
    raise ValueError(
        f"`{argument}={policy!r}` must be a set of module types (as `FSDPStrategy(activation_checkpointing_policy=...)`)"
        " or a callable `module -> bool`."
    )


def _resolve_type(value: Any, argument: str) -> type[torch.nn.Module]:
    if isinstance(value, str):  # "package.module.Block", as written in a LightningCLI YAML config
        module_name, _, name = value.rpartition(".")
        try:
            value = getattr(__import__(module_name, fromlist=[name]), name)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"`{argument}`: cannot import {value!r} ({err}); give the full dotted path of the class.") from err
    if not (isinstance(value, type) and issubclass(value, torch.nn.Module)):
        raise ValueError(f"`{argument}`: {value!r} is not a `torch.nn.Module` subclass.")
    return value


def _present_types(module: torch.nn.Module) -> str:
    counts = Counter(type(m).__qualname__ for m in module.modules() if m is not module)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common()) or "none"


def _matches(root: torch.nn.Module, match: Callable[[torch.nn.Module], bool]) -> list[tuple[str, torch.nn.Module]]:
    """Outermost matching submodules of ``root`` (not ``root`` itself), in ``named_modules`` order.

    A match inside another match is skipped: the outer recompute already covers it. Modules
    under torch's ``CheckpointWrapper`` are counted as matches already checkpointed.
    """
    found: list[tuple[str, torch.nn.Module]] = []
    skip: list[str] = []
    for path, module in root.named_modules(remove_duplicate=True):
        if module is root or any(path.startswith(prefix) for prefix in skip):
            continue
        if installed_checkpointing(module) is not None or match(module):
            found.append((path, module))
            skip.append(path + ".")
    return found


def _is_torch_checkpoint_wrapped(root: torch.nn.Module) -> bool:
    return any(type(m).__name__ == "CheckpointWrapper" for m in root.modules())


def apply_activation_checkpointing(
    module: torch.nn.Module,
    policy: Policy,
    *,
    every_n_layers: int = 1,
    selective: Union[bool, str] = False,
    preserve_rng_state: bool = True,
    check_inplace: bool = True,
) -> list[str]:
    """Checkpoint the submodules of ``module`` that ``policy`` matches; returns their paths.

    Use it where no callback hook fits: inside ``configure_model`` before ``fully_shard``, with
    Fabric, or in plain PyTorch. Arguments as :class:`ActivationCheckpointing`. Modules already
    checkpointed are left as they are (and not counted in the returned list). Raises
    ``ValueError`` if ``policy`` matches nothing, naming the module types present.
    """
    match = module_matcher(policy)
    _check_every_n(every_n_layers)
    options = _Options(preserve_rng_state=preserve_rng_state, selective=_selective_mode(selective), check_inplace=check_inplace)
    found = _matches(module, match)
    if not found:
        raise ValueError(
            f"Activation checkpointing: `policy` matched no submodule of {type(module).__qualname__}. Module types"
            f" present: {_present_types(module)}. HINT: pass the layer class (e.g. `policy={{TransformerBlock}}`) or"
            " a callable `module -> bool`; layers created in `configure_model` exist from `on_fit_start` on."
        )
    done = []
    for index, (path, sub) in enumerate(found):
        if (index + 1) % every_n_layers or installed_checkpointing(sub) is not None:
            continue
        _install(sub, options, path)
        done.append(path)
    return done


def remove_activation_checkpointing(module: torch.nn.Module) -> list[str]:
    """Undo :func:`apply_activation_checkpointing` on every submodule of ``module``; returns their paths."""
    removed = []
    for path, sub in module.named_modules(remove_duplicate=True):
        if _uninstall(sub):
            removed.append(path)
    return removed


def _install(module: torch.nn.Module, options: _Options, path: str) -> None:
    own = module.__dict__.get("forward")
    if own is not None:
        installed = _Installed(module, own, False, options, path)
    else:
        installed = _Installed(module, type(module).forward, True, options, path)
    module.forward = functools.partial(_checkpointed_forward, installed)  # type: ignore[method-assign]


def _check_every_n(every_n_layers: Any) -> None:
    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise ValueError(
            f"`every_n_layers={every_n_layers!r}` must be a positive integer: 1 checkpoints every matching layer,"
            " 2 every second one (the 2nd, 4th, ...), and so on."
        )


class ActivationCheckpointing(Callback):
    """Trade recompute for activation memory, with any strategy and unchanged checkpoint keys.

    Args:
        policy: which submodules to checkpoint: a set of module types (as Lightning's
            ``FSDPStrategy(activation_checkpointing_policy=...)``; dotted class paths are accepted
            for YAML configs) or a callable ``module -> bool``. Only the outermost match is
            checkpointed when matches nest.
        every_n_layers: checkpoint only every n-th matching layer (the n-th, 2n-th, ... in module
            order); the others keep their activations. Less recompute, less memory saved.
        selective: ``True`` (or ``"matmuls"``): keep the outputs of matmuls and attention
            (``SELECTIVE_SAVE_OPS``) inside each checkpointed layer and recompute only the cheap
            ops (norms, activations, dropout, adds), via
            ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
            ``"every_other_matmul"``: keep attention outputs and the 1st, 3rd, ... matmul of each
            layer, recompute the others too (torchtitan's op-level selective policy): more memory
            saved than ``"matmuls"``, for more recompute.
        preserve_rng_state: restore the RNG state for the recompute so dropout draws the same mask
            (``torch.utils.checkpoint``'s option; leave it on unless the layers draw no random numbers).
        check_inplace: in eager mode, raise :class:`ActivationCheckpointingError` when a
            checkpointed forward modifies its inputs or buffers in place (the recompute would apply
            the update twice).

    Applied at ``on_fit_start`` (after ``configure_model`` and the strategy's wrapping), removed at
    ``teardown``. Raises ``ValueError`` at ``on_fit_start`` if ``policy`` matches nothing, and at
    ``setup`` when ``FSDPStrategy(activation_checkpointing_policy=...)`` is also set.
    """

    def __init__(
        self,
        policy: Union[set[Union[type[torch.nn.Module], str]], Callable[[torch.nn.Module], bool]],
        every_n_layers: int = 1,
        selective: Union[bool, str] = False,
        preserve_rng_state: bool = True,
        check_inplace: bool = True,
    ) -> None:
        self._match = module_matcher(policy)
        _check_every_n(every_n_layers)
        _selective_mode(selective)
        self.policy = policy
        self.every_n_layers = every_n_layers
        self.selective = selective
        self.preserve_rng_state = preserve_rng_state
        self.check_inplace = check_inplace
        self.checkpointed: list[str] = []  # paths this callback applied checkpointing to

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if getattr(trainer.strategy, "_activation_checkpointing_kwargs", None):
            raise ValueError(
                "`ActivationCheckpointing` and `FSDPStrategy(activation_checkpointing_policy=...)` are both set;"
                " the layers would be checkpointed twice. HINT: keep one of the two (the callback keeps"
                " state-dict and parameter names unchanged)."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _is_torch_checkpoint_wrapped(pl_module):
            raise ValueError(
                "`ActivationCheckpointing`: the model already contains torch `CheckpointWrapper` modules"
                " (`apply_activation_checkpointing` from torch.distributed); the layers would be checkpointed twice."
                " HINT: remove one of the two."
            )
        self.checkpointed = apply_activation_checkpointing(
            pl_module,
            self._match,
            every_n_layers=self.every_n_layers,
            selective=self.selective,
            preserve_rng_state=self.preserve_rng_state,
            check_inplace=self.check_inplace,
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._remove(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        explain_recompute_mismatch(exception)
        self._remove(pl_module)

    def _remove(self, pl_module: pl.LightningModule) -> None:
        if not self.checkpointed:
            return
        mine = set(self.checkpointed)
        for path, module in pl_module.named_modules():
            if path in mine and installed_checkpointing(module) is not None:
                _uninstall(module)
        self.checkpointed = []


def _uninstall(module: torch.nn.Module) -> bool:
    installed = installed_checkpointing(module)
    if installed is None:
        return False
    del module.__dict__["forward"]
    if not installed.bound:  # the instance had a forward of its own: put it back
        module.forward = installed.impl  # type: ignore[method-assign]
    return True


def checkpointed_paths(module: torch.nn.Module) -> list[str]:
    """Paths of the submodules of ``module`` whose forward is currently checkpointed."""
    return [path for path, sub in module.named_modules() if installed_checkpointing(sub) is not None]


__all__ = [
    "ActivationCheckpointing",
    "ActivationCheckpointingError",
    "apply_activation_checkpointing",
    "checkpointed_paths",
    "remove_activation_checkpointing",
]
