"""The placement plan of ``ChunkedOffloadStrategy`` (pure): which parameter chunks stay on the
device, how many streaming slots the others share.

Inputs are plain numbers: the bytes of each chunk, each unit's chunks, the traced order of unit
calls in one forward and the peak non-parameter ("activation") bytes seen while each unit ran.
The device then holds, at every moment: the resident chunks, a fixed pool of slots (one streamed
chunk each, all of the largest streamed chunk's size, allocated once) and the activations. The
plan keeps ``resident + slots * slot_bytes + peak activations <= budget``. Nothing here imports
Lightning or touches a tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


class OffloadBudgetError(ValueError):
    """``device_memory_budget`` cannot hold one unit's chunks and its activations."""


@dataclass(frozen=True, slots=True)
class Unit:
    """A module whose parameters are fetched together: its name and the chunks holding them."""

    name: str
    chunks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    budget: int
    resident: frozenset[int]  # chunk indices kept on the device for the whole run
    slots: int  # streaming slots, each holding one non-resident chunk
    slot_bytes: int
    resident_bytes: int
    activation_bytes: int  # the traced peak (0 before the warm-up step)

    @property
    def device_bytes(self) -> int:
        """Bytes the plan puts on the device at its peak."""
        return self.resident_bytes + self.slots * self.slot_bytes + self.activation_bytes


def plan_offload(
    chunk_bytes: Sequence[int],
    units: Sequence[Unit],
    budget: int,
    *,
    trace: Sequence[int] = (),
    activation: Sequence[int] | None = None,
    prefetch: int = 0,
    together: Sequence[Sequence[int]] = (),
    activation_peak: int = 0,
) -> OffloadPlan:
    """Choose resident chunks and the slot count for ``budget`` bytes.

    Without a trace (before the warm-up step) the plan is the smallest streaming one: chunks used
    by no unit resident, as many slots as the unit with the most chunks needs. With a trace, the
    slots grow to hold the ``prefetch`` units after the running one (as far as the budget allows),
    then the remaining bytes make chunks resident, the most used first. When everything fits with
    the traced activations, everything is resident. ``together``: sets of units whose chunks must be on the device at
    once (a checkpointed block recomputed in backward); each counts as one more unit. Raises
    :class:`OffloadBudgetError` naming the unit (or set) that does not fit. ``activation_peak``:
    the step's peak activation bytes where it is above every unit's (e.g. in the loss after the
    last unit).
    """
    activation = list(activation) if activation is not None else [0] * len(units)
    units = list(units)
    for group in together:
        chunks = tuple(sorted({c for u in group for c in units[u].chunks}))
        units.append(Unit(" + ".join(units[u].name for u in group) + " (recomputed together)", chunks))
        activation.append(max((activation[u] for u in group), default=0))
    peak_activation = max(max(activation, default=0), activation_peak)
    total = sum(chunk_bytes)
    every = range(len(chunk_bytes))
    used = {c for unit in units for c in unit.chunks}
    # Before the warm-up the activations are unknown: all resident could already be too much.
    if (trace and total + peak_activation <= budget) or not used:
        return OffloadPlan(budget, frozenset(every), 0, 0, total, peak_activation)
    # A chunk no unit holds is read outside every unit's hooks: it cannot be streamed.
    resident = {c for c in every if c not in used}
    resident_bytes = sum(chunk_bytes[c] for c in resident)
    streamed = [c for c in every if c not in resident]
    slot_bytes = max(chunk_bytes[c] for c in streamed)
    per_unit = [len(set(unit.chunks) - resident) for unit in units]
    min_slots = max(per_unit, default=0)
    floor = resident_bytes + min_slots * slot_bytes + peak_activation
    if floor > budget:
        own = [sum(chunk_bytes[c] for c in set(unit.chunks) - resident) for unit in units]
        worst = max(range(len(units)), key=lambda u: (own[u] + activation[u], -u))
        unit = units[worst]
        raise OffloadBudgetError(
            f"ChunkedOffloadStrategy: `device_memory_budget={budget}` bytes cannot hold unit {unit.name!r}:"
            f" its parameter chunks take {own[worst]} bytes and its activations {activation[worst]} bytes; with"
            f" {min_slots} streaming slot(s) of {slot_bytes} bytes (each as large as the largest streamed chunk),"
            f" {resident_bytes} bytes of resident chunks and {peak_activation} bytes of peak activations the run"
            f" needs {floor} bytes. Raise `device_memory_budget`, lower `chunk_size`, or name smaller units"
            " (`unit_types`)."
        )
    want = min_slots
    for i in range(len(trace)):
        window = {c for u in trace[i : i + prefetch + 1] for c in units[u].chunks} - resident
        want = max(want, len(window))
    spare = budget - resident_bytes - peak_activation
    slots = max(min_slots, min(want, spare // slot_bytes))
    left = spare - slots * slot_bytes
    if trace:
        # Each use of a resident chunk saves a fetch in forward and one in backward.
        uses = Counter(c for u in trace for c in set(units[u].chunks))
        for c in sorted(streamed, key=lambda c: (-uses[c], c)):
            if chunk_bytes[c] <= left:
                resident.add(c)
                resident_bytes += chunk_bytes[c]
                left -= chunk_bytes[c]
    return OffloadPlan(budget, frozenset(resident), slots, slot_bytes, resident_bytes, peak_activation)
