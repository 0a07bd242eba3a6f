"""``train_time_interval`` decided alike on every rank with few collectives: rank 0 decides at
scheduled check steps only, and broadcasts the decision together with the number of steps until
the next check, planned from the measured step time so that the check lands before the deadline
even if steps become ``SLOWDOWN_TOLERANCE`` times slower. Nothing here imports Lightning.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A check plans at most 1/this of the remaining time ahead at the measured step time: the save
# stays on the first step past the interval (as Lightning's, which checks every batch) unless
# steps become more than this many times slower between two checks.
SLOWDOWN_TOLERANCE = 10


@dataclass
class TimeSchedule:
    """The time trigger's state: identical on every rank except the clocks (rank 0's). Plain data,
    compared by value (the callback holding it pickles and compares as ``ModelCheckpoint`` does)."""

    reference: float = 0.0  # rank 0: when the interval started
    last_check: float = 0.0  # rank 0: when the last check ran
    steps_to_check: int = 1
    steps_since_check: int = 0

    def start(self) -> None:
        """Training starts: the interval starts now, and the first step checks."""
        self.reference = self.last_check = time.monotonic()
        self.steps_to_check, self.steps_since_check = 1, 0

    def due(self, interval: float, is_global_zero: bool, world_size: int, broadcast: Callable[[Any], Any]) -> bool:
        """At the end of a step: is a save due? Every rank calls it; ``broadcast`` (rank 0's
        decision to every rank) runs on scheduled check steps only, and only with several ranks."""
        self.steps_since_check += 1
        self.steps_to_check -= 1
        if self.steps_to_check > 0:
            return False
        decision: tuple[bool, int] | None = None
        if is_global_zero:
            now = time.monotonic()
            step_time = (now - self.last_check) / self.steps_since_check  # the recent pace
            save = now - self.reference >= interval
            remaining = interval if save else interval - (now - self.reference)
            decision = (save, steps_until_check(remaining, step_time, world_size))
            self.last_check = now
            if save:
                self.reference = now
        if world_size > 1:
            decision = broadcast(decision)
        assert decision is not None  # rank 0's, or received from it
        save, self.steps_to_check = decision
        self.steps_since_check = 0
        return save


def steps_until_check(remaining: float, step_time: float, world_size: int) -> int:
    """Steps until the next time check: every step in one process (no collective to save), else a
    ``SLOWDOWN_TOLERANCE``-th of the remaining time at the measured pace."""
    if world_size == 1 or step_time <= 0:
        return 1
    return max(1, math.floor(remaining / (SLOWDOWN_TOLERANCE * step_time)))
