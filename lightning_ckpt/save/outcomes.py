"""The one place background errors surface: ``Outcomes`` holds the saves that became durable (for
``poll`` and ``last_save``) and raises or warns (``on_error``) each error of background work (the
writer process, uploads, the hand-off thread) once, at a defined point: the next save, ``wait()``,
``teardown()``."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

from lightning_ckpt.errors import CheckpointWriteError
from lightning_ckpt.store.commit import WriteResult


class Outcomes:
    """Durable saves not yet polled, the latest one, and the policy for background errors."""

    def __init__(self, on_error: Literal["raise", "warn"]) -> None:
        self.on_error = on_error
        self.unpolled: deque[WriteResult] = deque(maxlen=1024)
        self.last_save: WriteResult | None = None
        self.collectors: list[Callable[[], None]] = []  # each moves finished results in here

    def collect(self) -> None:
        for collect in self.collectors:
            collect()

    def report(self, errors: Sequence[CheckpointWriteError]) -> None:
        """Collect finished results, then raise ``errors`` (several: one error naming them all)
        or, with ``on_error="warn"``, warn about each."""
        self.collect()
        if not errors:
            return
        if self.on_error == "warn":
            for error in errors:
                warnings.warn(str(error), stacklevel=4)
            return
        if len(errors) > 1:
            raise CheckpointWriteError("; ".join(str(e) for e in errors), errors[-1].path) from errors[0]
        raise errors[0]

    def report_any(self, errors: Sequence[BaseException]) -> None:
        """As ``report``; an error that is not a ``CheckpointWriteError`` (a bug, an interrupt in a
        background thread) is raised whatever ``on_error`` says."""
        for error in errors:
            if not isinstance(error, CheckpointWriteError):
                raise error
        self.report(errors)  # type: ignore[arg-type]

    def take(self) -> list[WriteResult]:
        self.collect()
        done = list(self.unpolled)
        self.unpolled.clear()
        return done
