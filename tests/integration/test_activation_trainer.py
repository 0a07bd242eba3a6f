"""ActivationCheckpointing in a real Trainer on CPU: bit-identical training (dropout, bf16
autocast, gradient accumulation, layers built in ``configure_model``), checkpoints that load with
and without the callback through both IOs, errors surfaced at fit start."""

from __future__ import annotations

import functools

import pytest
import torch
from activation_models import Block, Decoder, fit_decoder
from lightning.pytorch import seed_everything
from torch import nn

import lightning_ckpt as lc
from lightning_ckpt.lightning.activation import checkpointed_paths

LAYERS = 3


def fit(callbacks=(), max_steps=4, ckpt_path=None, model=None, **kwargs):
    seed_everything(0)
    return fit_decoder(model or Decoder(layers=LAYERS), callbacks, max_steps=max_steps, ckpt_path=ckpt_path, **kwargs)


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


MODES = {"every layer": {}, "every 2nd layer": {"every_n_layers": 2}, "selective": {"selective": True}}


@functools.lru_cache(maxsize=1)
def _reference() -> Decoder:
    return fit()[1]


@pytest.mark.parametrize("options", MODES.values(), ids=MODES.keys())
def test_fit_is_bit_identical_with_layers_from_configure_model(options):
    reference = _reference()
    callback = lc.ActivationCheckpointing(policy={Block}, **options)
    _, model = fit([callback])
    assert model.losses == reference.losses
    assert _same_weights(model, reference)
    every = options.get("every_n_layers", 1)
    expected = [f"blocks.{i}" for i in range(LAYERS) if (i + 1) % every == 0]
    assert model.seen_checkpointed == expected
    assert [b.runs for b in model.blocks] == [8 if f"blocks.{i}" in expected else 4 for i in range(LAYERS)]
    assert checkpointed_paths(model) == [] and callback.checkpointed == []  # removed at teardown


def test_bf16_autocast_and_gradient_accumulation_are_bit_identical():
    kwargs = dict(precision="bf16-mixed", accumulate_grad_batches=2, max_steps=2)
    _, reference = fit(**kwargs)
    _, model = fit([lc.ActivationCheckpointing(policy={Block})], **kwargs)
    assert model.losses == reference.losses and len(model.losses) == 4
    assert _same_weights(model, reference)


def _state_dict(path, io: str) -> dict:
    if io == "sharded":
        return lc.load_checkpoint(path)["state_dict"]
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.mark.parametrize("io", ["sharded", "lightning"])
def test_checkpoints_load_with_and_without_the_callback(tmp_path, io):
    plugins = [lc.ShardedCheckpointIO()] if io == "sharded" else []
    with_ac, _ = fit([lc.ActivationCheckpointing(policy={Block})], plugins=plugins)
    plain, _ = fit(plugins=plugins)
    with_ac.save_checkpoint(tmp_path / "with.ckpt")
    plain.save_checkpoint(tmp_path / "plain.ckpt")
    written_with, written_without = _state_dict(tmp_path / "with.ckpt", io), _state_dict(tmp_path / "plain.ckpt", io)
    assert "blocks.0.fc1.weight" in written_with and list(written_with) == list(written_without)
    assert all(torch.equal(written_with[k], written_without[k]) for k in written_with)

    # Written with the callback, resumed without it, and the other way round: the same run.
    _, resumed_plain = fit(max_steps=6, ckpt_path=tmp_path / "with.ckpt", plugins=plugins)
    _, resumed_ac = fit(
        [lc.ActivationCheckpointing(policy={Block})], max_steps=6, ckpt_path=tmp_path / "plain.ckpt", plugins=plugins
    )
    assert len(resumed_plain.losses) == 2 and resumed_plain.losses == resumed_ac.losses
    assert _same_weights(resumed_plain, resumed_ac)

    # Outside a Trainer: a model that never saw the callback loads it strictly.
    fresh = Decoder()
    fresh.configure_model()
    fresh.load_state_dict(written_with)


def test_policy_matching_nothing_fails_at_fit_start_naming_the_types():
    with pytest.raises(ValueError, match=r"matched no submodule of Decoder\. Module types present: .*Block x3"):
        fit([lc.ActivationCheckpointing(policy={nn.Conv2d})])


class InPlaceBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(0.5)
        return super().forward(x)


def test_inplace_forward_fails_with_the_module_path():
    model = Decoder()
    model.blocks = nn.ModuleList([Block(), InPlaceBlock()])
    with pytest.raises(lc.ActivationCheckpointingError, match=r"`blocks\.1` \(InPlaceBlock\) modified input 0 in place"):
        fit([lc.ActivationCheckpointing(policy={Block})], model=model)
    assert checkpointed_paths(model) == []  # removed on the exception too
