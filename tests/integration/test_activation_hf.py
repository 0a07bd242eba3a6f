"""Activation checkpointing of Hugging Face layers built from small configs (random init, no
downloads): their key/value cache is left out of checkpointed calls in training, as Hugging
Face's own gradient checkpointing does, and a recompute that differs from its forward is named."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from models import trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt as lc
from lightning_ckpt.lightning import activation

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 128, 16


def _llama() -> tuple[nn.Module, type[nn.Module]]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config), LlamaDecoderLayer


def _gpt2() -> tuple[nn.Module, type[nn.Module]]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), GPT2Block


MODELS = {"llama": _llama, "gpt2": _gpt2}


def _step(model: nn.Module, ids: torch.Tensor, **kwargs):
    torch.manual_seed(1)  # the same dropout masks in both models
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    return out


def _cache_length(out) -> int:
    return 0 if out.past_key_values is None else out.past_key_values.get_seq_length()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_checkpointed_layers_train_without_a_cache_with_identical_gradients(name):
    activation._warned_cache.clear()  # warned once per process: this test counts its own
    torch.manual_seed(0)
    plain, layer = MODELS[name]()
    checkpointed = copy.deepcopy(plain)
    plain.train(), checkpointed.train()
    assert lc.apply_activation_checkpointing(checkpointed, policy={layer})
    ids = torch.randint(0, VOCAB, (2, SEQ))
    reference = _step(plain, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _step(checkpointed, ids)
        assert torch.equal(out.loss, reference.loss)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), checkpointed.parameters()))
        _step(checkpointed, ids)  # a second step: warned once per layer class, not per call
    cache_warnings = [w for w in caught if "without their key/value cache" in str(w.message)]
    assert len(cache_warnings) == 1 and layer.__qualname__ in str(cache_warnings[0].message)
    # Without the fix, the recompute extended the cache a second time (2 x SEQ).
    assert _cache_length(reference) == SEQ and _cache_length(out) == 0
    # Out of training (no gradients) the layers run as they are, cache included.
    checkpointed.eval()
    with torch.no_grad():
        assert _cache_length(checkpointed(input_ids=ids, use_cache=True)) == SEQ


@pytest.mark.parametrize("name", sorted(MODELS))
def test_use_cache_false_trains_checkpointed_without_a_warning(name):
    model, layer = MODELS[name]()
    lc.apply_activation_checkpointing(model, policy={layer})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model.train(), torch.randint(0, VOCAB, (2, SEQ)), use_cache=False)
    assert not [w for w in caught if "key/value cache" in str(w.message)]


class _HFModule(LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.net, _ = MODELS[name]()

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.net(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(0))), batch_size=2)


def test_a_trainer_fit_of_llama_with_the_callback_equals_the_plain_fit(tmp_path):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    weights = {}
    for run, callbacks in (("plain", []), ("checkpointed", [lc.ActivationCheckpointing(policy={LlamaDecoderLayer})])):
        seed_everything(0)
        module = _HFModule("llama")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            Trainer(max_steps=3, callbacks=callbacks, default_root_dir=tmp_path / run, **trainer_kwargs()).fit(module)
        weights[run] = module.state_dict()
    assert weights["plain"].keys() == weights["checkpointed"].keys()
    assert all(torch.equal(weights["plain"][k], weights["checkpointed"][k]) for k in weights["plain"])


class _Growing(nn.Module):
    """Saves a tensor for backward whose shape grows with every call: its recompute cannot match."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) @ torch.ones(4, self.calls)


class _GrowingModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = _Growing()

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2)


def test_a_recompute_that_differs_from_its_forward_is_named_with_the_cause_and_the_fix(tmp_path):
    trainer = Trainer(max_steps=1, callbacks=[lc.ActivationCheckpointing(policy={_Growing})], default_root_dir=tmp_path, **trainer_kwargs())
    with pytest.raises(torch.utils.checkpoint.CheckpointError) as raised:
        trainer.fit(_GrowingModule())
    message = str(raised.value)
    assert "recomputing `layer` (_Growing)" in message and "use_cache=False" in message and "exclude _Growing" in message
    assert "different metadata" in message  # torch's own words are kept after ours
