"""``ChunkedOffloadStrategy``: parameters in host chunks, streamed through fixed device slots.

The Lightning side only: where the model goes at setup, which device and budget, the backward
and step brackets, the stats. The chunks, slots, hooks and their ordering are
:mod:`lightning_ckpt.offload.streamer`; the device operations (CUDA streams and events, or the CPU
standing in for them) :mod:`lightning_ckpt.offload.streams`; the plan
:mod:`lightning_ckpt.offload.placement`.

Call order: ``setup_environment`` resolves the device (the accelerator's one device);
``configure_model`` builds in host memory, or on the meta device (``tensor_init_context``);
``setup`` moves every parameter into host chunks (``model_to_device``; meta ones get their place
there and are initialized: :mod:`lightning_ckpt.offload.materialize`; the device gets buffers
only), then the optimizers are built over the host chunks; a checkpoint is restored after setup,
into the host chunks; each step refreshes the resident chunks read outside the units,
``pre_backward`` puts earlier gradients aside, and ``post_backward`` ends the backward (the
warm-up's plan after the first). An evaluation's end and every ``state_dict()`` of the model point
the parameters back at their host chunks, so saves read host memory. Everything runs on the main
thread.
"""

import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_ckpt.format.plan import parse_size
from lightning_ckpt.lightning.activation import installed_checkpointing, module_matcher
from lightning_ckpt.offload.adamw import ChunkedAdamW
from lightning_ckpt.offload.materialize import (
    Pending,
    check_written,
    initialize,
    materialize_buffers,
    meta_parameters,
)
from lightning_ckpt.offload.placement import OffloadBudgetError
from lightning_ckpt.offload.streamer import Streamer, unique
from lightning_ckpt.offload.streams import streams_for

_AUTO_MARGIN = 0.9  # "auto": this share of the device's free memory


class ChunkedOffloadStrategy(SingleDeviceStrategy):
    """One device whose memory holds only part of the parameters: the rest live in host chunks and
    are streamed through a fixed pool of device slots, fetched ahead of use, planned from one
    traced warm-up step. Pair it with :class:`lightning_ckpt.ChunkedAdamW` for the optimizer state.

    Args:
        device_memory_budget: bytes the strategy may use on the device for parameters, slots and
            activations (``"16GB"``, an int), or ``"auto"``: 90% of the device's free memory (on
            the CPU, of the available host memory).
        chunk_size: bytes per parameter chunk (``"64MiB"``, an int); a larger parameter gets a
            chunk of its own.
        prefetch: units fetched ahead of the running one (in the traced order; in reverse during
            backward).
        unit_types: module types (or their import paths as strings) whose instances are fetched
            as one unit; ``None``: every module holding parameters of its own.
        device: the device (``"cuda:0"``, ``"cpu"``); ``None``: the Trainer's one device
            (``accelerator="gpu", devices=1`` gives ``cuda:0``; ``devices=[2]`` ``cuda:2``).
        accelerator, checkpoint_io, precision_plugin: as for ``SingleDeviceStrategy``.
    """

    strategy_name = "chunked_offload"

    def __init__(
        self,
        device_memory_budget: Union[int, str] = "auto",
        chunk_size: Union[int, str] = "64MiB",
        prefetch: int = 2,
        unit_types: Optional[list[Union[type[torch.nn.Module], str]]] = None,
        device: Optional[Union[str, torch.device]] = None,
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            device=device if device is not None else "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._device_arg = torch.device(device) if device is not None else None
        if self._device_arg is not None and self._device_arg.type not in ("cpu", "cuda"):
            raise ValueError(
                f"ChunkedOffloadStrategy(device={device!r}): only CUDA devices (and the CPU standing in for one)"
                " are supported. Pass `device='cuda:0'`, or leave it out to use the Trainer's device."
            )
        if device_memory_budget != "auto":
            parse_size(device_memory_budget, "device_memory_budget")
        self.device_memory_budget = device_memory_budget
        self.chunk_size = parse_size(chunk_size, "chunk_size")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"`prefetch={prefetch!r}` must be a non-negative int (units fetched ahead; 0: none).")
        self.prefetch = prefetch
        self._unit_match: Optional[Callable[[torch.nn.Module], bool]] = (
            module_matcher(list(unit_types), "unit_types") if unit_types is not None else None
        )
        self._streamer: Optional[Streamer] = None
        self._last_stats: dict[str, int] = {}
        self._pending: list[Pending] = []  # meta-born tensors nothing has initialized yet
        self._state_dict_hook: Any = None

    def _budget(self) -> int:
        if self.device_memory_budget != "auto":
            return parse_size(self.device_memory_budget, "device_memory_budget")
        if self.root_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.root_device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(free * _AUTO_MARGIN)

    def _units(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        units: list[tuple[str, torch.nn.Module]] = []
        inside: set[int] = set()
        for name, module in model.named_modules():
            if id(module) in inside:
                continue
            if self._unit_match is None:
                if any(p is not None for p in module._parameters.values()):
                    units.append((name or "<root>", module))
            elif self._unit_match(module):
                units.append((name, module))
                inside.update(id(m) for m in module.modules())  # the outermost match is the unit
        return units

    def _resolve_device(self) -> torch.device:
        """The one device: ``device`` as given, else the Trainer's (``accelerator``, ``devices``)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        # Lightning accepts a single-device strategy with devices=2 and uses the first: refuse it.
        devices = list(trainer._accelerator_connector._parallel_devices) if trainer is not None else []
        if len(devices) > 1:
            raise ValueError(
                f"ChunkedOffloadStrategy trains on one device, but the Trainer was given {len(devices)}"
                f" ({', '.join(map(str, devices))}). Pass `devices=1` (or `devices=[i]` for device i) to the Trainer;"
                " sharding the chunks across devices is not supported yet."
            )
        device = self._device_arg or (torch.device(devices[0]) if devices else torch.device("cpu"))
        if device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"ChunkedOffloadStrategy runs on CUDA devices (and the CPU standing in for one); the Trainer's"
                f" device is {device}. Use `accelerator='gpu'` (CUDA) or `accelerator='cpu'`."
            )
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"ChunkedOffloadStrategy(device={str(device)!r}): CUDA is not available in this process."
                    " Pass `device='cpu'`, or run where a CUDA device is visible."
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        return device

    @override
    def setup_environment(self) -> None:
        self._root_device = self._resolve_device()
        super().setup_environment()

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Where ``trainer.init_module()`` and ``configure_model`` create tensors: on the meta device
        with ``empty_init=True`` (given their memory in the host chunks at setup, then initialized:
        docs/offload.md), else in host memory. Never on the device: the model may not fit it."""
        with torch.device("meta" if empty_init else "cpu"), self.precision_plugin.tensor_init_context():
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A checkpoint's weights are loaded into the host chunks: a model built on the meta device
        # has no memory to load into before setup.
        return True

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        # Strategy.setup without its last move: optimizer state stays in host memory, next to the
        # parameters the optimizer steps (the host chunks).
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._setup_model(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and self.root_device.type == "cuda":
            unscale_on_the_host(scaler)

    @property  # type: ignore[override]
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        # Every assignment (setup, the learning-rate finder, ``trainer.optimizers = ...``) tells
        # the streamer which optimizers write the host chunks: it waits for their steps before it
        # reads or moves a chunk.
        SingleDeviceStrategy.optimizers.fset(self, optimizers)  # type: ignore[attr-defined]
        self._tell_streamer()

    def _tell_streamer(self) -> None:
        streamer = getattr(self, "_streamer", None)  # the base class sets ``optimizers`` first
        if streamer is not None:
            streamer.optimizers = [o for o in self._optimizers if isinstance(o, ChunkedAdamW)]

    @override
    def model_to_device(self) -> None:
        """Never moves the model whole: parameters go to host chunks (pinned on CUDA), buffers to
        the device; the plan's device memory is allocated, filled on first use."""
        assert self.model is not None
        if self._streamer is not None:
            return
        model = self.model
        units = self._units(model)
        if not units:
            raise ValueError(
                "ChunkedOffloadStrategy: no module of the model matches `unit_types`; name the module types"
                " (e.g. the transformer block) whose parameters are fetched together."
            )
        device = self.root_device
        streams = streams_for(device)
        # The allocator's peak (CUDA) counts from here, the model's tensors already on the device
        # included (a model built there is moved out next: it was device memory all the same).
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in (*model.parameters(), *model.buffers())
            if t.device == device
        }
        streams.reset_peak(held=sum(storages.values()))
        born = meta_parameters(model)
        # Buffers are small and read anywhere: they go to the device as they are (meta ones zeroed).
        born |= materialize_buffers(model, device)
        for module in model.modules():
            if isinstance(module, _DeviceDtypeModuleMixin):
                module._device = device  # `self.device` in the LightningModule: where its inputs go
        order = unique(p for _, m in units for p in m.parameters())
        params = unique([*order, *model.parameters()])
        self._streamer = Streamer(units, params, self.chunk_size, self._budget(), self.prefetch, device, streams)
        self._tell_streamer()
        if born:
            self._pending = initialize(model, born)  # checked before the first step
        # Any state dict of the model (a checkpoint's, a callback's) reads the host chunks.
        self._state_dict_hook = model.register_state_dict_pre_hook(lambda *_: self._to_host())

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        # As Lightning's, without moving the state to the device: it belongs next to the host chunks.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._streamer is None:
            return
        # ActivationCheckpointing applies at on_fit_start: its blocks are known from here on.
        index = {id(m): u for u, (_, m) in enumerate(self._streamer.unit_modules)}
        groups = []
        for module in self.model.modules():
            if installed_checkpointing(module) is not None:
                inside = tuple(sorted({index[id(m)] for m in module.modules() if id(m) in index}))
                if inside:
                    groups.append(inside)
        self._streamer.set_groups(groups)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._saved_tensor_hooks():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._refresh()
        return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._refresh()
        return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._refresh()
        return super().predict_step(*args, **kwargs)

    def _refresh(self) -> None:
        """Before each step: meta-born tensors written by now, resident chunks read outside the units filled."""
        if self._pending:
            check_written(self._pending)  # raises naming what nothing initialized
            self._pending = []
        if self._streamer is not None:
            self._streamer.refresh_unhooked()

    @contextmanager
    def _saved_tensor_hooks(self) -> Any:
        self._refresh()
        if self._streamer is None:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(self._streamer.pack_saved, self._streamer.unpack_saved):
            yield

    def _to_host(self) -> None:
        if self._streamer is not None:
            self._streamer.to_host()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self._to_host()

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self._to_host()

    @override
    def on_predict_end(self) -> None:
        super().on_predict_end()
        self._to_host()

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._streamer is not None:
            self._streamer.begin_backward()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._streamer is not None:
            self._streamer.end_backward()

    def memory_stats(self) -> dict[str, int]:
        """Device accounting: ``device_memory_budget``, ``peak_device_bytes`` (on CUDA the
        allocator's ``max_memory_allocated`` since setup less what was allocated before it, else
        this strategy's count),
        ``accounted_peak_bytes`` (this strategy's count: resident chunks + slots + saved
        activations), ``resident_chunks``, ``streamed_chunks``, ``slots``, ``slot_bytes``,
        ``resident_bytes``, ``activation_bytes``, ``h2d_bytes``, ``d2h_bytes`` (totals since setup;
        after teardown, those of the last run)."""
        if self._streamer is None:
            return dict(self._last_stats)
        return self._streamer.stats()

    @override
    def teardown(self) -> None:
        if self._streamer is not None:
            self._last_stats = self._streamer.stats()
            self._streamer.close()
            self._streamer = None
        if self._state_dict_hook is not None:
            self._state_dict_hook.remove()
            self._state_dict_hook = None
        self._pending = []
        super().teardown()


class _HostGradientsScaler:
    """A ``GradScaler`` whose scale lives on the device while the gradients are in host memory.

    torch hands each gradient's device a copy of ``inv_scale`` and ``found_inf`` made with
    ``non_blocking=True``: for the host, a page-locked buffer the CPU unscale kernel reads before
    the copy has landed (a stale or zero scale; an inf it found overwritten by the late copy of the
    zero). Here the two are copied to the host blocking first: the kernel reads settled values."""

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        if inv_scale.device.type != "cpu":
            inv_scale, found_inf = inv_scale.cpu(), found_inf.cpu()
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)  # type: ignore[misc]


def unscale_on_the_host(scaler: Any) -> None:
    """Make ``scaler`` (Lightning's precision plugin's, on a CUDA device) unscale host gradients
    safely: its class becomes a subclass with :class:`_HostGradientsScaler` first, so its state and
    settings stay as they are."""
    cls = type(scaler)
    if issubclass(cls, _HostGradientsScaler):
        return
    scaler.__class__ = type(f"HostGradients{cls.__name__}", (_HostGradientsScaler, cls), {})


__all__ = ["ChunkedOffloadStrategy", "OffloadBudgetError"]
