"""The optimizer pre-step hook that hands a pending async save's device copies over.

A pending save exists only with CUDA copies in flight, so these tests stand in for
``staging.Copies`` (the GPU side) and drive the real hook and hand-off through ``optimizer.step()``;
``tests/gpu/test_cuda.py`` runs the same path with real copies.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import lightning_ckpt as lc
from lightning_ckpt.save.background import Pending


class LandOnHandOver:
    """Copies that land once the training stream is ordered after them, and log when that was."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.handed = False

    def hand_over(self) -> None:
        self.handed = True
        self.log.append("hand_over")

    def landed(self) -> bool:
        return self.handed

    def wait(self) -> None:
        pass


def _pending_save(io: lc.ShardedCheckpointIO, log: list[str]) -> None:
    io.async_saver.pending = Pending(LandOnHandOver(log), [lambda: log.append("submitted")])


def _optimizer() -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    return torch.optim.SGD([p], lr=0.1)


@pytest.fixture
def io():
    io = lc.ShardedCheckpointIO(async_save=True)
    yield io
    io.async_saver.pending = None  # a stand-in never lands on its own
    io.teardown()


def test_a_pending_save_is_handed_to_the_writer_at_the_next_step(io) -> None:
    log: list[str] = []
    _optimizer().step()  # nothing pending: the hook does nothing
    assert log == []
    _pending_save(io, log)
    _optimizer().step()
    assert log == ["hand_over", "submitted"] and io.async_saver.pending is None


def test_with_a_closure_the_hand_over_follows_the_closure(io) -> None:
    log: list[str] = []
    _pending_save(io, log)
    optimizer = _optimizer()
    optimizer.step(lambda: log.append("forward and backward"))
    assert log == ["forward and backward", "hand_over", "submitted"]
    _pending_save(io, log)
    log.clear()
    optimizer.step(closure=lambda: log.append("forward and backward"))
    assert log == ["forward and backward", "hand_over", "submitted"]


def test_a_hook_registered_after_ours_still_runs_and_the_step_does_not_raise(io) -> None:
    # The hook used to remove itself inside torch's loop over the hooks: with any hook after it,
    # step() raised "OrderedDict mutated during iteration".
    log: list[str] = []
    later = register_optimizer_step_pre_hook(lambda *_: log.append("later hook"))
    try:
        _pending_save(io, log)
        _optimizer().step()
        assert log == ["hand_over", "submitted", "later hook"]
    finally:
        later.remove()
