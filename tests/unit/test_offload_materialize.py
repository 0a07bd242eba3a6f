"""Materializing and initializing a model built on the meta device (``offload/materialize.py``),
without Lightning: the host chunk is a plain tensor here."""

from __future__ import annotations

import weakref

import pytest
import torch

from lightning_ckpt.offload.materialize import (
    check_written,
    initialize,
    materialize_buffers,
    materialize_parameter,
    meta_parameters,
)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.inner = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight


class Gain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(6))
        self.register_buffer("table", torch.arange(6.0), persistent=False)


class HalfReset(torch.nn.Linear):
    """``reset_parameters`` covers the weight only (its bias is left to something else)."""

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)


class Replacing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))

    def reset_parameters(self) -> None:
        self.weight = torch.nn.Parameter(torch.zeros(3))


def materialize(model: torch.nn.Module) -> tuple[torch.Tensor, set[int]]:
    """Every parameter into one flat host buffer (as the strategy's chunks), buffers to the CPU."""
    born = meta_parameters(model)
    params = list({id(p): p for p in model.parameters()}.values())
    memory = torch.full((sum(p.numel() for p in params),), float("nan"))
    offset = 0
    for p in params:
        materialize_parameter(p, memory[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return memory, born | materialize_buffers(model, torch.device("cpu"))


def test_initialized_in_place_equal_to_the_cpu_construction_with_ties_kept():
    torch.manual_seed(0)
    reference = Tied()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Tied()
    memory, born = materialize(model)
    assert model.head.weight is model.embed.weight and not model.head.weight.is_meta
    assert initialize(model, born) == []
    assert model.embed.weight.data_ptr() == memory.data_ptr()  # initialized where it lives
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_parameter_nothing_writes_is_pending_until_written():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), Gain(), HalfReset(6, 6))
    _, born = materialize(model)
    pending = initialize(model, born)
    # Neighbours in the same memory: the writes of the Linear do not count for the Gain.
    assert [(p.name, p.module_type, p.reason) for p in pending] == [
        ("1.scale", "Gain", "has no `reset_parameters()`"),
        ("1.table", "Gain", "has no `reset_parameters()`"),
        ("2.bias", "HalfReset", "`reset_parameters()` does not write it"),
    ]
    with pytest.raises(ValueError, match=r"nothing initialized '1\.scale' \(a Gain, which has no `reset_parameters\(\)`\);"):
        check_written(pending)
    with torch.no_grad():  # as a checkpoint load or a user's hook would
        model[1].scale.fill_(1.0)
        model[1].table.copy_(torch.arange(6.0))
        model[2].bias.zero_()
    check_written(pending)


def test_a_reset_that_replaces_a_parameter_fails_naming_the_module():
    with torch.device("meta"):
        model = torch.nn.Sequential(Replacing())
    _, born = materialize(model)
    with pytest.raises(ValueError, match=r"`Replacing.reset_parameters\(\)` of module '0' replaced 'weight'.*in place"):
        initialize(model, born)


def test_buffers_shared_by_two_modules_stay_shared():
    with torch.device("meta"):
        a, b = torch.nn.BatchNorm1d(4), torch.nn.BatchNorm1d(4)
    b.running_mean = a.running_mean
    model = torch.nn.Sequential(a, b)
    born = materialize_buffers(model, torch.device("cpu"))
    assert model[0].running_mean is model[1].running_mean and not model[0].running_mean.is_meta
    assert id(model[0].running_mean) in born and len(born) == 5  # 2 x (mean, var, count), one shared


def test_a_parameter_that_cannot_be_swapped_fails_with_the_fix():
    with torch.device("meta"):
        layer = torch.nn.Linear(2, 2)
    held = weakref.ref(layer.weight)  # noqa: F841 - what blocks the swap
    with pytest.raises(RuntimeError, match=r"meta parameter of shape \(2, 2\) could not be given its memory.*build the model on the\s+CPU"):
        materialize_parameter(layer.weight, torch.zeros(2, 2))
