"""Command-line values of the research modes: byte sizes as argparse types, and counts
(``"1.3B"`` parameters)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def size_argument(option: str) -> Callable[[str], int]:
    """An argparse ``type`` for a byte size (``"512MB"``, ``"1GiB"``); its error names ``option``."""

    def parse(text: str) -> int:
        from lightning_ckpt.format.plan import parse_size

        try:
            return parse_size(text, option)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str, argument: str) -> int:
    """``"1.3B"``, ``"350M"``, ``"8e6"`` -> a count (B = billion). Raises ``ValueError`` naming ``argument``."""
    value = text.strip().upper()
    unit = value[-1] if value and value[-1] in _COUNT_UNITS else ""
    try:
        number = float(value[: len(value) - len(unit)]) * _COUNT_UNITS[unit]
    except ValueError:
        raise ValueError(f"{argument} {text!r} is not a count; give e.g. 1.3B, 350M or 8000000") from None
    if number < 1:
        raise ValueError(f"{argument} {text!r} must be at least 1")
    return int(number)
