"""torch.compile'd submodules: clean keys, loadable both ways, and saving causes no recompilation."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from models import STEPS_PER_EPOCH, TinyRegressor, trainer_kwargs

import lightning_ckpt as lc
from lightning_ckpt.compile import align_keys_to, strip_compiled_prefixes


class CompiledRegressor(TinyRegressor):
    def __init__(self, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__(hidden, lr)
        self.net = torch.compile(self.net, backend="eager")


def _fit(model, callback, epochs=1, ckpt_path=None):
    seed_everything(0)
    trainer = Trainer(max_epochs=epochs, callbacks=[callback], plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs())
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def test_saved_keys_have_no_orig_mod_and_load_into_both_forms(tmp_path):
    compiled = CompiledRegressor()
    _fit(compiled, lc.ShardedModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True))
    state = lc.load_checkpoint(tmp_path / "last.ckpt")["state_dict"]
    assert state and not [k for k in state if "_orig_mod" in k]
    assert "_orig_mod" not in "".join(state._metadata)
    plain = lc.load_from_checkpoint(TinyRegressor, tmp_path / "last.ckpt")  # strict load, uncompiled
    for key, value in compiled.state_dict().items():
        assert torch.equal(plain.state_dict()[key.replace("_orig_mod.", "")], value)
    # ...and resuming a compiled model from it (optimizer state lines up: the run continues).
    resumed = CompiledRegressor()
    trainer = _fit(resumed, lc.ShardedModelCheckpoint(dirpath=tmp_path / "2", every_n_train_steps=2), 2, tmp_path / "last.ckpt")
    assert trainer.global_step == 8 and len(resumed.losses) == 4


def test_load_from_checkpoint_builds_a_model_that_compiles_a_submodule_in_init(tmp_path):
    compiled = CompiledRegressor()
    _fit(compiled, lc.ShardedModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True))
    loaded = lc.load_from_checkpoint(CompiledRegressor, tmp_path / "last.ckpt")  # strict: every key lines up
    assert any("_orig_mod" in k for k in loaded.state_dict())
    for key, value in compiled.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    # The hooks served that load only: the model is left as Lightning builds it.
    assert not loaded.net._load_state_dict_pre_hooks


def test_a_checkpoint_with_orig_mod_keys_loads_into_an_uncompiled_model(tmp_path):
    _fit(CompiledRegressor(), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="old"))
    assert any("_orig_mod" in k for k in lc.load_checkpoint(tmp_path / "old.ckpt")["state_dict"])
    plain = TinyRegressor()
    trainer = _fit(plain, lc.ShardedModelCheckpoint(dirpath=tmp_path / "new", every_n_train_steps=4), 2, tmp_path / "old.ckpt")
    assert trainer.global_step == 8


def test_saving_causes_no_recompilation(tmp_path):
    torch._dynamo.reset()
    model = CompiledRegressor()
    callback = lc.ShardedModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    seed_everything(0)
    trainer = Trainer(
        max_epochs=1, limit_train_batches=2, enable_checkpointing=False, plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs()
    )
    trainer.fit(model)  # warm-up: compile once
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    trainer = Trainer(max_epochs=3, callbacks=[callback], plugins=[lc.ShardedCheckpointIO()], **trainer_kwargs())
    with torch._dynamo.config.patch(error_on_recompile=True):
        trainer.fit(model)  # a save after every step
    assert len(callback.save_records) == 3 * STEPS_PER_EPOCH
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize(
    ("incoming", "expected", "result"),
    [
        (["net.0.weight"], ["net._orig_mod.0.weight"], ["net._orig_mod.0.weight"]),
        (["net._orig_mod.0.weight"], ["net.0.weight"], ["net.0.weight"]),
        (["a.weight", "b"], ["a.weight", "b"], ["a.weight", "b"]),
        (["unknown"], ["net.0.weight"], ["unknown"]),
    ],
)
def test_align_keys(incoming, expected, result):
    state = {k: i for i, k in enumerate(incoming)}
    align_keys_to(expected, state)
    assert list(state) == result


def test_strip_keeps_values_and_metadata():
    from collections import OrderedDict

    state = OrderedDict([("net._orig_mod.w", 1), ("head.b", 2)])
    state._metadata = OrderedDict([("", {"version": 1}), ("net", {}), ("net._orig_mod", {"version": 1})])
    stripped = strip_compiled_prefixes(state)
    assert list(stripped.items()) == [("net.w", 1), ("head.b", 2)]
    assert list(stripped._metadata) == ["", "net"]
