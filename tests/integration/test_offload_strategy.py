"""ChunkedOffloadStrategy under a real Trainer on the CPU: exactness against the default strategy
with ChunkedAdamW, budget adherence, streaming, tied and frozen parameters, accumulation,
clipping, and checkpoints moving between the two strategies."""

from __future__ import annotations

import time
from contextlib import nullcontext

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import MixedPrecision, TorchCheckpointIO
from models import cli_trainer_yaml, fit_chunked, trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt as lc

WIDTH = 128
VOCAB = 16


class Gain(torch.nn.Module):
    """A parameter without ``reset_parameters()``: on the meta device nothing can initialize it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Stack(LightningModule):
    """Tied embedding / head around a stack of linear layers; optionally one frozen layer, a
    BatchNorm (buffers) or a ``Gain`` after the stack. ``build_on``: built in ``configure_model``
    under that device (``"meta"``, ``"cpu"``) instead of here."""

    def __init__(
        self,
        layers: int = 8,
        frozen: bool = False,
        blocks: bool = False,
        compiled: bool = False,
        norm: bool = False,
        gain: bool = False,
        build_on: str | None = None,
    ) -> None:
        super().__init__()
        self.options = dict(layers=layers, frozen=frozen, blocks=blocks, compiled=compiled, norm=norm, gain=gain)
        self.build_on = build_on
        self.losses: list[float] = []
        self.val_logits: list[torch.Tensor] = []
        if build_on is None:
            self.build(**self.options)

    def configure_model(self) -> None:
        if self.build_on is not None and not hasattr(self, "embed"):
            with torch.device(self.build_on):
                self.build(**self.options)

    def build(self, layers: int, frozen: bool, blocks: bool, compiled: bool, norm: bool, gain: bool) -> None:
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        if blocks:  # pairs of linear layers, for activation checkpointing of a block
            pairs = (torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH)) for _ in range(layers // 2))
            self.layers = torch.nn.ModuleList(pairs)
        else:
            self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        if frozen:
            self.layers[2].requires_grad_(False)
        if compiled:  # one unit's forward compiled; the strategy's module hooks stay outside it
            self.layers[3].forward = torch.compile(self.layers[3].forward, backend="aot_eager")
        self.norm = torch.nn.BatchNorm1d(WIDTH) if norm else None
        self.gain = Gain() if gain else None

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        if self.norm is not None:
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        if self.gain is not None:
            x = self.gain(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.logits(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        (tokens,) = batch
        self.val_logits.append(self.logits(tokens).float())

    def val_dataloader(self):
        return self.train_dataloader()

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return lc.ChunkedAdamW(params, lr=1e-2, weight_decay=0.1, chunk_size="64KiB")

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(3)
        return DataLoader(TensorDataset(torch.randint(0, VOCAB, (12, 4), generator=gen)), batch_size=1)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def budget_for(model: torch.nn.Module) -> int:
    return param_bytes(model) // 3


def fit(strategy=None, max_steps: int = 6, ckpt_path=None, dirpath=None, model_options=None, empty_init=False, **overrides):
    """A seeded fit of a fresh ``Stack(**model_options)``; ``empty_init``: built inside
    ``trainer.init_module(empty_init=True)``. Returns (trainer, model)."""
    seed_everything(0, workers=True)
    callbacks = [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)] if dirpath else []
    kwargs = trainer_kwargs(max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(dirpath))
    kwargs.update(overrides)
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = Trainer(**kwargs)
    with trainer.init_module(empty_init=True) if empty_init else nullcontext():
        model = Stack(**(model_options or {}))
    fit_chunked(model, trainer=trainer, ckpt_path=ckpt_path)
    return trainer, model


def offload(**options) -> lc.ChunkedOffloadStrategy:
    budget = budget_for(Stack())
    return lc.ChunkedOffloadStrategy(device_memory_budget=budget, chunk_size="66KiB", **options)


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("prefetch", [0, 2])
def test_streams_within_budget_and_equals_the_default_strategy(prefetch):
    reference_trainer, reference = fit()
    strategy = offload(prefetch=prefetch)
    trainer, model = fit(strategy)
    assert model.losses == reference.losses
    assert_same(model, reference)
    stats = strategy.memory_stats()
    assert param_bytes(model) >= 3 * stats["device_memory_budget"]
    assert 0 < stats["peak_device_bytes"] <= stats["device_memory_budget"]
    assert stats["streamed_chunks"] > 0
    # Every step fetched more parameter bytes than the device may hold at once.
    assert stats["h2d_bytes"] > 6 * stats["device_memory_budget"]
    assert stats["d2h_bytes"] > 0


def test_frozen_layer_accumulation_and_clipping_equal_the_default_strategy():
    options = dict(model_options=dict(frozen=True), accumulate_grad_batches=2, gradient_clip_val=0.05)
    _, reference = fit(**options)
    strategy = offload()
    trainer, model = fit(strategy, **options)
    assert trainer.global_step == 6
    assert model.losses == reference.losses
    assert_same(model, reference)
    assert model.layers[2].weight.grad is None  # frozen: streamed for the forward, never stepped
    stats = strategy.memory_stats()
    assert stats["peak_device_bytes"] <= stats["device_memory_budget"]
    assert stats["streamed_chunks"] > 0


@pytest.mark.parametrize("selective", [False, True])
def test_activation_checkpointing_recomputes_a_block_within_the_budget(selective):
    callbacks = lambda: [lc.ActivationCheckpointing({torch.nn.Sequential}, selective=selective)]  # noqa: E731
    _, reference = fit(model_options=dict(blocks=True), callbacks=callbacks())
    strategy = offload(prefetch=0)  # without prefetch, one slot per unit would do
    _, model = fit(strategy, model_options=dict(blocks=True), callbacks=callbacks())
    assert model.losses == reference.losses
    assert_same(model, reference)
    stats = strategy.memory_stats()
    assert stats["slots"] == 2  # a block's two layers are on the device together while it recomputes
    assert stats["peak_device_bytes"] <= stats["device_memory_budget"]
    assert stats["streamed_chunks"] > 0


def test_bf16_autocast_and_validation_equal_the_default_strategy():
    options = dict(precision="bf16-mixed", limit_val_batches=2, val_check_interval=3, num_sanity_val_steps=1)
    _, reference = fit(**options)
    # Autocast keeps a bf16 copy of every weight for backward: activations, counted in the budget.
    strategy = lc.ChunkedOffloadStrategy(device_memory_budget=420_000, chunk_size="66KiB")
    _, model = fit(strategy, **options)
    assert model.losses == reference.losses
    assert_same(model, reference)
    assert len(model.val_logits) == len(reference.val_logits) == 5 and all(torch.equal(a, b) for a, b in zip(model.val_logits, reference.val_logits))
    stats = strategy.memory_stats()
    assert stats["peak_device_bytes"] <= stats["device_memory_budget"] and stats["streamed_chunks"] > 0


def test_a_compiled_unit_streams_without_recompiles():
    torch._dynamo.reset()
    _, reference = fit(model_options=dict(compiled=True))
    torch._dynamo.reset()
    strategy = offload()
    # Parameters change storage between host chunks and slots every step: that must not recompile.
    with torch._dynamo.config.patch(error_on_recompile=True):
        _, model = fit(strategy, model_options=dict(compiled=True))
    assert model.losses == reference.losses
    assert_same(model, reference)
    assert strategy.memory_stats()["streamed_chunks"] > 0


def test_a_budget_below_one_unit_fails_at_setup_naming_the_unit_and_bytes():
    strategy = lc.ChunkedOffloadStrategy(device_memory_budget=40_000, chunk_size="66KiB")
    with pytest.raises(lc.OffloadBudgetError, match=r"`device_memory_budget=40000`.* unit 'layers\.0': its parameter chunks take 66048 bytes"):
        fit(strategy)


def test_a_parameter_larger_than_the_budget_allows_is_named_not_chunk_size():
    # Each 64 KiB weight is larger than a 16 KiB chunk: a chunk (and a slot) of its own.
    strategy = lc.ChunkedOffloadStrategy(device_memory_budget=40_000, chunk_size="16KiB")
    with pytest.raises(
        lc.OffloadBudgetError,
        match=r"`device_memory_budget=40000` bytes cannot hold parameter 'layers\.0\.weight': it takes 65536 bytes"
        r" on its own.* needs at least 65536 bytes whatever `chunk_size` is, and 131072 bytes with this one"
        r".* Raise `device_memory_budget` to at least 131072 bytes; lowering `chunk_size` cannot help",
    ):
        fit(strategy)


def test_more_than_one_device_fails_at_setup_naming_the_devices():
    with pytest.raises(ValueError, match=r"trains on one device, but the Trainer was given 2 .*Pass `devices=1`"):
        fit(offload(), devices=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a process without CUDA")
def test_a_cuda_device_without_cuda_fails_at_setup():
    with pytest.raises(ValueError, match=r"device='cuda:0'\): CUDA is not available"):
        fit(offload(device="cuda:0"))


def test_unit_types_fetch_a_whole_block_as_one_unit():
    strategy = lc.ChunkedOffloadStrategy(device_memory_budget="10MB", chunk_size="66KiB", unit_types=[torch.nn.ModuleList])
    _, reference = fit()
    trainer, model = fit(strategy)
    assert model.losses == reference.losses
    assert [name for name, _ in strategy._units(model)] == ["layers"]


# Resumes from a checkpoint taken at the last batch of an epoch (12 batches).
EPOCH = 12


@pytest.mark.parametrize("offload_first", [True, False])
def test_checkpoints_resume_across_strategies_bit_identical(tmp_path, offload_first):
    _, reference = fit(max_steps=2 * EPOCH)
    folder = tmp_path / "ckpts"
    fit(offload() if offload_first else None, max_steps=EPOCH, dirpath=folder, plugins=[lc.ShardedCheckpointIO()])
    name = f"epoch=0-step={EPOCH}.ckpt"
    saved = lc.load_checkpoint(folder / name)
    assert set(saved["state_dict"]) == set(reference.state_dict())  # the standard key layout
    strategy = None if offload_first else offload()
    _, resumed = fit(strategy, max_steps=2 * EPOCH, ckpt_path=str(folder / name), plugins=[lc.ShardedCheckpointIO()])
    assert resumed.losses == reference.losses[EPOCH:]
    assert_same(resumed, reference)


def test_from_a_lightning_cli_config(tmp_path):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        cli_trainer_yaml(tmp_path)
        + """  strategy:
    class_path: lightning_ckpt.ChunkedOffloadStrategy
    init_args:
      device_memory_budget: 180KB
      chunk_size: 66KiB
      prefetch: 1
      unit_types: [torch.nn.Linear, torch.nn.Embedding]
"""
    )
    cli = LightningCLI(Stack, args=["fit", "--config", str(config)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, lc.ChunkedOffloadStrategy) and strategy.prefetch == 1
    stats = strategy.memory_stats()
    assert stats["device_memory_budget"] == 180_000 and stats["streamed_chunks"] > 0
    assert stats["peak_device_bytes"] <= 180_000


class Recorder(Logger):
    """Keeps what the callback logs."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append(dict(metrics))


def test_the_checkpoint_callback_logs_the_memory_stats(tmp_path):
    recorder = Recorder()
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_top_k=-1, metrics_file=None)
    fit(offload(), max_steps=3, logger=recorder, callbacks=[callback], enable_checkpointing=True)
    saves = [m for m in recorder.logged if "ckpt/stall_s" in m]
    assert saves, recorder.logged
    assert {"offload/device_memory_budget", "offload/peak_device_bytes", "offload/h2d_bytes"} <= set(saves[-1])
    assert 0 < saves[-1]["offload/peak_device_bytes"] <= saves[-1]["offload/device_memory_budget"]


class AdamWStack(Stack):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def test_any_optimizer_steps_the_host_chunks():
    def run(strategy=None) -> Stack:
        seed_everything(0, workers=True)
        model = AdamWStack()
        kwargs = trainer_kwargs(max_steps=6, enable_checkpointing=False)
        Trainer(**kwargs, **({"strategy": strategy} if strategy else {})).fit(model)
        return model

    reference = run()
    model = run(offload())
    assert model.losses == reference.losses
    assert_same(model, reference)


class SlowOptimizerSteps(Callback):
    """Delays every chunk ChunkedAdamW's worker steps: the next forward overlaps the steps."""

    def on_train_start(self, trainer, pl_module) -> None:
        worker = trainer.optimizers[0]._worker
        run = worker.run

        def slow(job) -> None:
            time.sleep(0.01)
            run(job)

        worker.run = slow


def test_a_chunk_shared_by_two_units_waits_for_both_steps():
    _, reference = fit()
    # Two layers per strategy chunk, one (or less) per ChunkedAdamW chunk: a fetch for one layer
    # must also wait for the step of the other layer in its chunk.
    strategy = lc.ChunkedOffloadStrategy(device_memory_budget=budget_for(Stack()), chunk_size="140KiB")
    _, model = fit(strategy, callbacks=[SlowOptimizerSteps()])
    assert model.losses == reference.losses
    assert_same(model, reference)
    assert strategy.memory_stats()["streamed_chunks"] > 0


class SlowCopies(Callback):
    """Every copy between host chunks and the stand-in device runs late, on a thread of its own
    (``HostStreams.copy_delay``), and is logged: a use that does not wait for its fetch reads the
    slot's previous chunk."""

    def __init__(self) -> None:
        self.entries: list[tuple] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        streams = trainer.strategy._streamer.streams
        streams.copy_delay = 0.002
        streams.log = self.entries


def test_delayed_copies_are_waited_for_and_slots_released_before_reuse():
    _, reference = fit()
    slow = SlowCopies()
    strategy = offload(prefetch=2)
    _, model = fit(strategy, callbacks=[slow])
    assert model.losses == reference.losses
    assert_same(model, reference)
    copies = [e for e in slow.entries if e[0] == "copy_in" and isinstance(e[3][2], int)]
    assert len(copies) > 6 * strategy.memory_stats()["slots"]  # slots were reused many times
    last_copy: dict[int, int] = {}  # chunk -> event of its last copy
    last_use: dict[int, int] = {}  # slot -> log position of the last use of what it holds
    release: dict[int, tuple[int, int]] = {}  # slot -> (log position, event) of its last release
    for i, entry in enumerate(slow.entries):
        kind, event = entry[0], entry[1]
        if kind == "copy_in":
            _, chunk, slot = entry[3]
            if isinstance(slot, int) and slot in last_use:
                # Never overwritten while a kernel may read it: after the release that follows its last use.
                assert slot in release and release[slot][0] > last_use[slot], entry
                assert entry[2] == release[slot][1], entry
            last_copy[chunk] = event
        elif kind == "wait":
            _, chunk, slot = entry[2]
            assert event == last_copy[chunk], entry  # a use waits for the copy of that chunk
            if isinstance(slot, int):
                last_use[slot] = i
        elif kind == "record" and entry[2][0] == "release":
            release[entry[2][2]] = (i, event)
        elif kind == "record" and entry[2][0] == "idle":
            release.update({slot: (i, event) for slot in range(strategy.memory_stats()["slots"])})
    # On the CPU a resident chunk's memory is its host chunk: its fetch moves no bytes, so no
    # stale value shows a missing wait; the log does: each of its fetches is waited for.
    resident = [e[1] for e in slow.entries if e[0] == "copy_in" and e[3][2] == "resident"]
    assert resident and set(resident) <= {e[1] for e in slow.entries if e[0] == "wait"}


class ArenaCheck(Callback):
    """After setup (the optimizer built), before any step: where each parameter's data lies."""

    def on_fit_start(self, trainer, pl_module) -> None:
        self.in_arena = [trainer.optimizers[0]._arena.holds(p) for p in pl_module.parameters()]


def test_chunkedadamw_leaves_parameters_in_the_host_chunks():
    # A chunk holding one parameter of exactly its size (a layer's weight): ChunkedAdamW must not
    # take the parameter into its own arena (the strategy's fetches read the host chunk).
    check = ArenaCheck()
    fit(lc.ChunkedOffloadStrategy(device_memory_budget="10MB", chunk_size=WIDTH * WIDTH * 4), max_steps=1, callbacks=[check])
    assert check.in_arena and not any(check.in_arena)


class InitialWeights(Callback):
    """The model's weights when training starts: after setup (and a model built on the meta device
    materialized and initialized), before any step."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {name: p.detach().clone() for name, p in pl_module.named_parameters()}
        self.buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}


@pytest.mark.parametrize("how", ["init_module", "configure_model"])
def test_a_model_built_on_meta_trains_equal_to_the_same_model_built_on_the_cpu(how):
    options = dict(norm=True)  # BatchNorm: buffers on the meta device too
    cpu_start = InitialWeights()
    _, reference = fit(model_options=options, callbacks=[cpu_start])
    meta_start = InitialWeights()
    strategy = offload()
    if how == "init_module":  # Trainer.init_module(empty_init=True): the strategy builds on meta
        trainer, model = fit(strategy, model_options=options, empty_init=True, callbacks=[meta_start])
    else:  # configure_model under `torch.device("meta")`
        trainer, model = fit(strategy, model_options=dict(options, build_on="meta"), callbacks=[meta_start])
    # Each module's reset_parameters() in registration order draws what the CPU construction drew;
    # the tied head's draws are made and dropped, as on the CPU.
    assert meta_start.weights.keys() == cpu_start.weights.keys()
    assert all(torch.equal(meta_start.weights[k], cpu_start.weights[k]) for k in cpu_start.weights)
    assert all(torch.equal(meta_start.buffers[k], cpu_start.buffers[k]) for k in cpu_start.buffers)
    assert model.head.weight is model.embed.weight  # still tied
    assert model.losses == reference.losses
    assert_same(model, reference)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))
    assert strategy.memory_stats()["streamed_chunks"] > 0


def test_a_model_built_on_meta_resumes_from_a_checkpoint(tmp_path):
    _, reference = fit(max_steps=2 * EPOCH)
    folder = tmp_path / "ckpts"
    fit(offload(), max_steps=EPOCH, dirpath=folder, plugins=[lc.ShardedCheckpointIO()])
    name = f"epoch=0-step={EPOCH}.ckpt"
    # The checkpoint is restored after setup, into the host chunks of the materialized model.
    _, resumed = fit(offload(), max_steps=2 * EPOCH, empty_init=True, ckpt_path=str(folder / name), plugins=[lc.ShardedCheckpointIO()])
    assert resumed.losses == reference.losses[EPOCH:]
    assert_same(resumed, reference)


def test_a_meta_parameter_nothing_initializes_fails_naming_it_unless_a_checkpoint_fills_it(tmp_path):
    with pytest.raises(ValueError, match=r"built on the meta device and nothing initialized 'gain\.scale' \(a Gain, which has no `reset_parameters\(\)`\)"):
        fit(offload(), model_options=dict(gain=True), empty_init=True)
    # The same model built on the CPU writes a checkpoint; the meta-built one resumes from it.
    _, reference = fit(model_options=dict(gain=True), max_steps=2 * EPOCH)
    folder = tmp_path / "ckpts"
    fit(offload(), model_options=dict(gain=True), max_steps=EPOCH, dirpath=folder)
    _, resumed = fit(offload(), model_options=dict(gain=True), max_steps=2 * EPOCH, empty_init=True, ckpt_path=str(folder / f"epoch=0-step={EPOCH}.ckpt"))
    assert resumed.losses == reference.losses[EPOCH:]
    assert_same(resumed, reference)


def in_host_chunks(strategy: lc.ChunkedOffloadStrategy, t: torch.Tensor) -> bool:
    return any(h.data_ptr() <= t.data_ptr() < h.data_ptr() + h.numel() for h in strategy._streamer.host)


class HostCheckingIO(TorchCheckpointIO):
    """Records, for each save, whether every parameter in the checkpoint views a host chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.strategy: lc.ChunkedOffloadStrategy | None = None
        self.saves: list[bool] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        names = {name for name, _ in self.strategy.lightning_module.named_parameters()}
        self.saves.append(all(in_host_chunks(self.strategy, t) for k, t in checkpoint["state_dict"].items() if k in names))
        super().save_checkpoint(checkpoint, path, storage_options)


class SaveAtValidationEnd(Callback):
    """Saves where ``ModelCheckpoint(monitor=...)`` does (before the strategy's own end of
    validation); then, at the next training batch, checks where the parameters point."""

    def __init__(self, path) -> None:
        self.path = path
        self.after_validation: list[bool] = []
        self._validated = False

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            trainer.save_checkpoint(self.path / f"val-{trainer.global_step}.ckpt")
            self._validated = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._validated:
            self.after_validation.append(all(in_host_chunks(trainer.strategy, p) for p in pl_module.parameters()))
            self._validated = False


def test_saves_during_and_after_validation_read_the_host_chunks(tmp_path):
    io = HostCheckingIO()
    # After validation the streamed parameters point at slots (on the CPU a resident chunk's memory
    # is its host chunk already).
    strategy = offload(checkpoint_io=io)
    io.strategy = strategy
    saver = SaveAtValidationEnd(tmp_path)
    options = dict(limit_val_batches=2, val_check_interval=3, max_steps=7)
    _, reference = fit(**options)
    _, model = fit(strategy, callbacks=[saver], **options)
    assert io.saves == [True, True]  # after steps 3 and 6
    assert saver.after_validation == [True, True]
    assert model.losses == reference.losses
    assert_same(model, reference)
    assert strategy.memory_stats()["resident_chunks"] > 0 and strategy.memory_stats()["streamed_chunks"] > 0


def test_fp16_autocast_with_a_grad_scaler_over_host_gradients_equals_the_default_strategy():
    # Trainer(precision="16-mixed", accelerator="cpu") becomes bf16-mixed in Lightning; the plugin
    # itself runs fp16 autocast and torch's GradScaler on the CPU.
    _, reference = fit(plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=8)
    # Autocast's fp16 weight copies count as activations (as in the bf16 test).
    strategy = lc.ChunkedOffloadStrategy(device_memory_budget=420_000, chunk_size="66KiB")
    trainer, model = fit(strategy, plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=8)
    scaler = trainer.precision_plugin.scaler
    assert scaler is not None and scaler.get_scale() < 2.0**16  # steps with inf gradients were skipped
    assert model.losses == reference.losses
    assert_same(model, reference)
    stats = strategy.memory_stats()
    assert stats["peak_device_bytes"] <= stats["device_memory_budget"] and stats["streamed_chunks"] > 0


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_chunkedadamw_reads_the_host_gradients_in_place(precision):
    # No copy of the gradients into ChunkedAdamW's own buffers: it never allocates them.
    reference_trainer, reference = fit(precision=precision)
    assert all(c.grad_buffer is not None for c in reference_trainer.optimizers[0]._chunks)
    trainer, model = fit(offload(), precision=precision)
    assert all(c.grad_buffer is None for c in trainer.optimizers[0]._chunks)
    # fp32 host chunks are the master weights (test_offload_inplace.py); bf16 ones keep an fp32 master.
    assert all(c.params_are_master == (precision == "32-true") for c in trainer.optimizers[0]._chunks)
    assert all(c.master_flat.numel() == c.spec.numel for c in trainer.optimizers[0]._chunks if precision == "bf16-true")
    assert model.losses == reference.losses
    assert_same(model, reference)
    assert trainer.strategy.memory_stats()["streamed_chunks"] > 0
