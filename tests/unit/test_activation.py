"""Activation checkpointing on plain modules: bit-identical training, unchanged keys, what is
recomputed and saved, clear errors, and ``torch.compile`` without recompiles."""

from __future__ import annotations

import copy
import pickle
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from activation_models import DIM, Block, Decoder
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ckpt.lightning.activation import (
    ActivationCheckpointing,
    ActivationCheckpointingError,
    apply_activation_checkpointing,
    checkpointed_paths,
    remove_activation_checkpointing,
)


def decoder(layers: int = 4, count: bool = True) -> Decoder:
    """``layers`` attention blocks (2 heads, dropout 0.2 on residuals and attention), built: a plain module."""
    return Decoder(layers=layers, build=True, heads=2, attention_dropout=0.2, count=count)


def train(options: dict | None, steps: int = 3, model: nn.Module | None = None, call=None):
    """Losses, last gradients and the model after ``steps`` SGD steps (fixed seeds)."""
    torch.manual_seed(0)
    model = decoder() if model is None else model
    if options is not None:
        apply_activation_checkpointing(model, {Block}, **options)
    call = model if call is None else call
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 32, (2, 8), generator=data)
        loss = F.cross_entropy(call(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads, model


MODES = {
    "every layer": {},
    "every 2nd layer": {"every_n_layers": 2},
    "selective": {"selective": True},
    "selective every other matmul": {"selective": "every_other_matmul"},
}


@pytest.mark.parametrize("options", MODES.values(), ids=MODES.keys())
def test_losses_and_gradients_are_bit_identical_with_dropout(options):
    ref_losses, ref_grads, ref_model = train(None)
    losses, grads, model = train(options)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref_model.state_dict().values()))
    every = options.get("every_n_layers", 1)
    # A checkpointed block runs its forward twice per step (forward + recompute), the others once.
    expected = [6 if (i + 1) % every == 0 else 3 for i in range(4)]
    assert [b.runs for b in model.blocks] == expected
    assert checkpointed_paths(model) == [f"blocks.{i}" for i in range(4) if (i + 1) % every == 0]


def test_state_dict_and_parameter_names_unchanged_and_removal_restores_the_instance():
    plain = decoder()
    model = copy.deepcopy(plain)
    assert apply_activation_checkpointing(model, {Block}) == [f"blocks.{i}" for i in range(4)]
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    plain.load_state_dict(model.state_dict())  # strict, both ways
    model.load_state_dict(plain.state_dict())
    assert remove_activation_checkpointing(model) == [f"blocks.{i}" for i in range(4)]
    assert all("forward" not in b.__dict__ for b in model.blocks)
    # A forward set on the instance before (another library's wrapper) is put back.
    own = model.blocks[0].forward
    model.blocks[0].forward = own
    apply_activation_checkpointing(model, {Block})
    remove_activation_checkpointing(model)
    assert model.blocks[0].__dict__["forward"] is own


def test_deepcopy_and_pickle_keep_checkpointing_bound_to_the_copy():
    _, _, model = train({}, steps=1)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert checkpointed_paths(clone) == [f"blocks.{i}" for i in range(4)]
        assert clone.blocks[0].forward.args[0].module is clone.blocks[0]
        before = clone.blocks[0].runs
        clone(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
        assert clone.blocks[0].runs == before + 2 and model.blocks[0].runs == 2


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


def _matmuls_per_step(options: dict | None) -> int:
    model = decoder().eval()  # no dropout: identical op sequence in every mode
    if options is not None:
        apply_activation_checkpointing(model, {Block}, **options)
    with _CountOps() as counter:
        model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    return counter.matmuls


def test_selective_mode_does_not_recompute_matmuls_full_mode_does():
    plain = _matmuls_per_step(None)
    assert _matmuls_per_step({"selective": True}) == plain
    assert _matmuls_per_step({"selective": "matmuls"}) == plain
    # qkv (1st) and fc1 (3rd) kept; proj (2nd) recomputed; fc2 (4th) would be, but backward needs
    # nothing the recompute would produce after it, so the recompute stops before it.
    assert _matmuls_per_step({"selective": "every_other_matmul"}) == plain + 4
    # qkv, proj and fc1 recomputed in each of 4 blocks; the recompute stops early, before fc2,
    # whose output backward does not need.
    assert _matmuls_per_step({}) == plain + 3 * 4


def _saved_bytes(options: dict | None) -> int:
    """Bytes autograd keeps for backward outside checkpointed regions."""
    model = decoder(layers=4)
    if options is not None:
        apply_activation_checkpointing(model, {Block}, **options)
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.zeros(4, 32, dtype=torch.long))
    return total


def test_checkpointing_every_layer_keeps_only_block_inputs():
    plain, every, half = _saved_bytes(None), _saved_bytes({}), _saved_bytes({"every_n_layers": 2})
    assert every < half < plain
    assert every < 0.25 * plain


def test_no_grad_runs_the_original_forward_once():
    model = decoder()
    apply_activation_checkpointing(model, {Block})
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert [b.runs for b in model.blocks] == [1] * 4


def test_policy_matching_nothing_names_the_types_present():
    with pytest.raises(ValueError, match=r"matched no submodule of Decoder\. Module types present: Linear x17, LayerNorm x8, Block x4"):
        apply_activation_checkpointing(decoder(), {nn.Conv1d})


def test_callable_policy_dotted_names_and_outermost_matches_only():
    model = decoder()
    paths = apply_activation_checkpointing(model, lambda m: isinstance(m, (Block, nn.Linear)))
    assert paths == [f"blocks.{i}" for i in range(4)] + ["head"]  # Linears inside Blocks are covered
    assert ActivationCheckpointing(policy={f"{Block.__module__}.Block"})._match(Block())
    # Already checkpointed modules are left alone (the callback after configure_model's own call).
    assert apply_activation_checkpointing(model, {Block}) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": set()}, "`policy` is empty"),
        ({"policy": "not.a.Module"}, "must be a set of module types"),
        ({"policy": {"no_such_module.Block"}}, "cannot import 'no_such_module.Block'"),
        ({"policy": {int}}, "is not a `torch.nn.Module` subclass"),
        ({"policy": {Block}, "every_n_layers": 0}, "`every_n_layers=0` must be a positive integer"),
        ({"policy": {Block}, "selective": "attention"}, "`selective='attention'` must be False .* or 'every_other_matmul'"),
    ],
)
def test_configuration_errors_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ActivationCheckpointing(**kwargs)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.lin(x)


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_inplace_update_of_an_input_is_reported_with_the_module_path():
    model = nn.Sequential(nn.Linear(DIM, DIM), InPlace())
    apply_activation_checkpointing(model, {InPlace})
    with pytest.raises(ActivationCheckpointingError, match=r"`1` \(InPlace\) modified input 0 in place.*exclude it"):
        model(torch.randn(2, DIM, requires_grad=True))
    apply_activation_checkpointing(nn.Sequential(InPlace()), {InPlace}, check_inplace=False)


def test_buffer_updates_in_forward_are_reported():
    model = nn.Sequential(WithBatchNorm())
    apply_activation_checkpointing(model, {WithBatchNorm})
    with pytest.raises(ActivationCheckpointingError, match=r"`0` \(WithBatchNorm\) modified buffer 'norm.num_batches_tracked'.*a second time"):
        model(torch.randn(4, DIM))
    model.eval()  # no statistics update: fine
    model(torch.randn(4, DIM)).sum().backward()


def test_keyword_arguments_reach_the_forward_even_with_checkpoint_option_names():
    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)

        def forward(self, x, debug=None, scale=1.0):
            return self.lin(x) * scale + (0 if debug is None else debug)

    model = nn.Sequential()
    model.add_module("k", Keywords())
    apply_activation_checkpointing(model, {Keywords})
    x = torch.randn(2, DIM, requires_grad=True)
    out = model.k(x, debug=torch.ones(DIM), scale=2.0)
    torch.manual_seed(0)
    assert torch.equal(out, model.k.lin(x) * 2.0 + 1)
    out.sum().backward()


def test_fsdp_strategy_policy_conflict_is_reported_at_setup():
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(_activation_checkpointing_kwargs={"x": 1}))
    with pytest.raises(ValueError, match="checkpointed twice"):
        ActivationCheckpointing(policy={Block}).setup(trainer, None, "fit")


@pytest.mark.parametrize(
    "selective", [False, True, "every_other_matmul"], ids=["every layer", "selective", "selective every other matmul"]
)
def test_compiled_model_no_recompiles_and_checkpoint_in_the_graph(selective):
    """Through AOTAutograd (as inductor): bit-identical with dropout. Dynamo's debug backend
    ``"eager"`` runs the checkpoint op without restoring the RNG state: dropout masks differ."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs = []

    def backend(gm, example_inputs):  # aot_eager, recording the graph dynamo captured
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def fresh():
        torch.manual_seed(0)
        return decoder(layers=1, count=False)

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            model = fresh()
            losses, _, _ = train({"selective": selective}, steps=3, model=model, call=torch.compile(model, backend=backend))
    finally:
        torch._dynamo.reset()
    assert losses == train(None, steps=3, model=fresh())[0]
    assert len(graphs) == 1  # one graph, no recompile (fail_on_recompile_limit_hit would have raised)
    assert [n for n in graphs[0].graph.nodes if "checkpoint" in str(n.target)]  # the region is in the graph


class _CachedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, past_key_value: Any = None) -> torch.Tensor:
        return self.linear(x)


class _CachedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = _CachedLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, past_key_value=object())  # the model code a cache warning points at


def test_the_cache_warning_points_at_the_model_code_that_passed_the_cache():
    # Not at torch's module.py (Module.__call__), where a fixed stacklevel landed.
    import warnings

    from lightning_ckpt.lightning import activation

    activation._warned_cache.discard("_CachedLayer")
    model = _CachedModel()
    apply_activation_checkpointing(model, {_CachedLayer})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, DIM, requires_grad=True)).sum().backward()
    (warning,) = [w for w in caught if "key/value cache" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, _CachedModel.forward.__code__.co_firstlineno + 1)
