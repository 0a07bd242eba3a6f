"""ChunkedOffloadStrategy on a CUDA device: the allocator's peak within the budget, exactness,
no stale parameters when copies or kernels run late, checkpoints across strategies.

Exactness: the reference is the default single-device strategy with ``ChunkedAdamW`` on the same
GPU, compared with ``torch.equal`` (no tolerance): the same kernels run on the same shapes, the
optimizer steps on the CPU in both. CUDA kernels differ from the CPU's in the last bits, so a GPU
run is never compared with a CPU one. The model avoids kernels that are not deterministic on CUDA
(embedding backward, atomics in reductions): inputs are dense, the loss a mean of squares.
"""

from __future__ import annotations

import gc

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from models import fit_chunked, trainer_kwargs
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt as lc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

WIDTH = 2048
LAYERS = 16  # 16 x 16.8 MB of fp32 parameters, one 17 MiB chunk per layer
HEADROOM = 128 * 2**20  # cuBLAS workspaces, the batch, activations and gradients before they leave


class Residual(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        loss = x.float().pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return lc.ChunkedAdamW(self.parameters(), lr=1e-3, weight_decay=0.1, chunk_size="32MiB")

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(3)
        return DataLoader(TensorDataset(torch.randn(16, 32, WIDTH, generator=gen)), batch_size=2)


def param_bytes() -> int:
    return LAYERS * (WIDTH * WIDTH + WIDTH) * 4


def autocast_copies(precision: str) -> int:
    """Under autocast, the half-precision copy of every weight: the backward keeps it (saved for
    its matmul) while the chunks stream, so it is device memory whatever the strategy."""
    return LAYERS * WIDTH * WIDTH * 2 if precision.endswith("-mixed") else 0


def budget(precision: str = "32-true") -> int:
    """A quarter of the parameters, the headroom and the autocast copies."""
    return param_bytes() // 4 + HEADROOM + autocast_copies(precision)


def offload(precision: str = "32-true", **options) -> lc.ChunkedOffloadStrategy:
    return lc.ChunkedOffloadStrategy(device_memory_budget=budget(precision), chunk_size="17MiB", **options)


def fit(strategy=None, max_steps: int = 6, callbacks=(), ckpt_path=None, dirpath=None, empty_init=False, **overrides):
    """A seeded fit of a fresh ``Residual``; ``empty_init``: built inside
    ``trainer.init_module(empty_init=True)`` (the meta device under ``ChunkedOffloadStrategy``)."""
    seed_everything(0)
    callbacks = list(callbacks)
    if dirpath is not None:
        callbacks.append(ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1))
    # deterministic=False: torch's deterministic mode refuses cuBLAS without CUBLAS_WORKSPACE_CONFIG;
    # the kernels used here are deterministic on one device anyway.
    kwargs = trainer_kwargs(
        accelerator="gpu", deterministic=False, max_steps=max_steps, callbacks=callbacks,
        enable_checkpointing=dirpath is not None,
    )
    kwargs.update(overrides)
    if strategy is not None:
        kwargs["strategy"] = strategy
    trainer = Trainer(**kwargs)
    if empty_init:
        with trainer.init_module(empty_init=True):
            model = Residual()
    else:
        model = Residual()  # on the CPU, as the meta-built model's reset_parameters() draw
    fit_chunked(model, trainer=trainer, ckpt_path=ckpt_path)
    torch.cuda.synchronize()
    return trainer, model


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x.detach().cpu(), y.detach().cpu()), name


# empty_init: built on the meta device, materialized in the host chunks and initialized there by
# reset_parameters() from the CPU generator: the CPU-built reference's weights.
@pytest.mark.parametrize(("precision", "empty_init"), [("32-true", False), ("bf16-mixed", False), ("32-true", True)])
def test_streams_within_the_budget_and_equals_the_default_strategy(precision, empty_init):
    _, reference = fit(precision=precision)
    gc.collect()  # the reference run's optimizer and its device buffers
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    strategy = offload(precision)
    _, model = fit(strategy, precision=precision, empty_init=empty_init)
    assert model.losses == reference.losses
    assert_same(model, reference)
    stats = strategy.memory_stats()
    # Resident, the parameters and the autocast copies alone would not fit.
    assert param_bytes() + autocast_copies(precision) > stats["device_memory_budget"]
    # The device's own count: its peak was reset when the strategy placed the model.
    assert 0 < stats["peak_device_bytes"] <= stats["device_memory_budget"]
    assert torch.cuda.max_memory_allocated() - before <= stats["device_memory_budget"]
    # Every streamed chunk (one layer's weights each) came in at least once in each of the 6 steps.
    assert stats["streamed_chunks"] > 0 and stats["h2d_bytes"] >= 6 * stats["streamed_chunks"] * WIDTH * WIDTH * 4
    assert stats["d2h_bytes"] >= 6 * param_bytes()  # every gradient left the device
    assert all(p.device.type == "cpu" for p in model.parameters())  # the host chunks


class LateCopies(Callback):
    """The copy stream sleeps before every copy: a kernel that does not wait for its fetch reads
    the slot's previous chunk."""

    def on_fit_start(self, trainer, pl_module) -> None:
        trainer.strategy._streamer.streams.copy_delay_cycles = 20_000_000


class LateKernels(Callback):
    """The compute stream sleeps before every step's kernels: a copy into a slot that does not
    wait for the slot's release overwrites parameters a queued kernel still reads."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda._sleep(200_000_000)


@pytest.mark.parametrize("late", [LateCopies, LateKernels], ids=["copies", "kernels"])
def test_no_stale_parameters_when_copies_or_kernels_run_late(late):
    _, reference = fit()
    strategy = offload(prefetch=2)
    _, model = fit(strategy, callbacks=[late()])
    assert model.losses == reference.losses
    assert_same(model, reference)
    assert strategy.memory_stats()["streamed_chunks"] > 0


def test_accumulation_and_clipping_equal_the_default_strategy():
    # Clipping by value (exact anywhere): a norm is computed where the gradients are, on the host
    # here and on the device by the reference, and differs in its last bits.
    options = dict(accumulate_grad_batches=2, gradient_clip_val=1e-4, gradient_clip_algorithm="value")
    _, reference = fit(**options)
    strategy = offload()
    trainer, model = fit(strategy, **options)
    assert trainer.global_step == 6
    assert model.losses == reference.losses
    assert_same(model, reference)


EPOCH = 8  # batches per epoch


@pytest.mark.parametrize("offload_first", [True, False])
def test_checkpoints_resume_across_strategies_bit_identical(tmp_path, offload_first):
    _, reference = fit(max_steps=2 * EPOCH)
    folder = tmp_path / "ckpts"
    fit(offload() if offload_first else None, max_steps=EPOCH, dirpath=folder, plugins=[lc.ShardedCheckpointIO()])
    name = f"epoch=0-step={EPOCH}.ckpt"
    _, resumed = fit(
        None if offload_first else offload(), max_steps=2 * EPOCH, ckpt_path=str(folder / name),
        plugins=[lc.ShardedCheckpointIO()],
    )
    assert resumed.losses == reference.losses[EPOCH:]
    assert_same(resumed, reference)


def test_auto_budget_comes_from_the_free_device_memory():
    free, _ = torch.cuda.mem_get_info()
    strategy = lc.ChunkedOffloadStrategy(chunk_size="17MiB")
    fit(strategy, max_steps=2)
    stats = strategy.memory_stats()
    assert 0 < stats["device_memory_budget"] <= free
    assert stats["resident_chunks"] > 0  # everything fits: nothing streams


def test_fp16_mixed_scales_the_host_gradients_equal_to_the_default_strategy():
    # Lightning's own 16-mixed: fp16 autocast and a CUDA GradScaler, here unscaling host gradients.
    trainer_ref, reference = fit(precision="16-mixed")
    strategy = offload("16-mixed")
    trainer, model = fit(strategy, precision="16-mixed")
    assert model.losses == reference.losses
    assert_same(model, reference)
    assert trainer.precision_plugin.scaler.get_scale() == trainer_ref.precision_plugin.scaler.get_scale()
    stats = strategy.memory_stats()
    assert stats["peak_device_bytes"] <= stats["device_memory_budget"] and stats["streamed_chunks"] > 0


def test_a_model_already_on_the_device_counts_in_the_peak():
    """Built on the GPU, the model is moved into the host chunks at setup: its device memory was
    this run's, so the peak counts it rather than hiding it in the baseline (freed, it would have
    made every later allocation look smaller)."""
    seed_everything(0)
    model = Residual().cuda()
    strategy = lc.ChunkedOffloadStrategy(device_memory_budget=2 * param_bytes() + 2 * HEADROOM, chunk_size="17MiB")
    fit_chunked(
        model, strategy, **trainer_kwargs(accelerator="gpu", deterministic=False, max_steps=2, enable_checkpointing=False)
    )
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert strategy.memory_stats()["peak_device_bytes"] >= param_bytes()
