"""The train_time_interval schedule of ShardedModelCheckpoint against a simulated clock: saves land
on the same steps as Lightning's every-batch check, also when the step time grows 10x, with far
fewer rank-0 broadcasts."""

from datetime import timedelta
from types import SimpleNamespace

import pytest

import lightning_ckpt.lightning.schedule as schedule_module
from lightning_ckpt import ShardedModelCheckpoint

INTERVAL = 60.0


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _stock_saves(step_times: list[float], interval: float) -> list[int]:
    """Lightning's rule: at the end of every step, save once `interval` has passed since the last save."""
    saves, now, reference = [], 0.0, 0.0
    for step, duration in enumerate(step_times, 1):
        now += duration
        if now - reference >= interval:
            saves.append(step)
            reference = now
    return saves


def _our_saves(monkeypatch, step_times: list[float], world_size: int = 2) -> tuple[list[int], int]:
    clock = _Clock()
    monkeypatch.setattr(schedule_module.time, "monotonic", clock)
    broadcasts = []

    def broadcast(obj):
        broadcasts.append(obj)
        return obj

    trainer = SimpleNamespace(is_global_zero=True, world_size=world_size, strategy=SimpleNamespace(broadcast=broadcast))
    callback = ShardedModelCheckpoint(train_time_interval=timedelta(seconds=INTERVAL))
    callback._schedule.reference = callback._schedule.last_check = 0.0  # as on_train_start does
    saves = []
    for step, duration in enumerate(step_times, 1):
        clock.now += duration
        if callback._time_to_save(trainer, INTERVAL):
            saves.append(step)
    return saves, len(broadcasts)


@pytest.mark.parametrize("slow_from", [1, 2, 3, 5, 8, 13, 30, 59, 60, 61, 100, 150])
def test_saves_stay_on_time_when_steps_become_10x_slower(monkeypatch, slow_from):
    steps = [1.0] * (slow_from - 1) + [10.0] * 60
    ours, _ = _our_saves(monkeypatch, steps)
    assert ours == _stock_saves(steps, INTERVAL)


def test_a_30x_slowdown_is_late_by_a_bounded_amount(monkeypatch):
    """Beyond the 10x tolerance a save can be late, by at most the look-ahead planned before the
    slowdown (here a few steps), never by orders of magnitude."""
    steps = [1.0] * 5 + [30.0] * 40
    ours, _ = _our_saves(monkeypatch, steps)
    stock = _stock_saves(steps, INTERVAL)
    assert ours[0] - stock[0] <= 5 and len(ours) >= len(stock) - 1


def test_steady_steps_need_few_broadcasts(monkeypatch):
    steps = [0.1] * 36_000  # one hour of 100 ms steps, a save per minute
    ours, broadcasts = _our_saves(monkeypatch, steps)
    assert ours == _stock_saves(steps, INTERVAL)
    assert broadcasts < len(steps) / 10  # Lightning broadcasts on every one of them


def test_one_process_checks_every_step_without_broadcasting(monkeypatch):
    steps = [1.0] * 5 + [30.0] * 40
    ours, broadcasts = _our_saves(monkeypatch, steps, world_size=1)
    assert ours == _stock_saves(steps, INTERVAL) and broadcasts == 0
