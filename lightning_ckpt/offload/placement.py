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
from collections.abc import Mapping, Sequence
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
    single: Mapping[int, str] | None = None,
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
    last unit). ``single``: the chunks holding one parameter each, with its name; a parameter is
    never split, so no ``chunk_size`` makes such a chunk (and the slot streaming it) smaller, and
    the error names the parameter when it alone is what the budget cannot hold.
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
        single = single or {}
        # The largest streamed parameter that is a chunk of its own: one slot of its size whatever
        # ``chunk_size``. When that slot alone breaks the budget, the parameter is the blocker.
        alone = max((c for c in streamed if c in single), key=lambda c: (chunk_bytes[c], -c), default=None)
        least = resident_bytes + peak_activation + (chunk_bytes[alone] if alone is not None else 0)
        if alone is not None and least > budget:
            most = units[per_unit.index(min_slots)].name  # the unit needing the most slots
            layout = (
                f", and {floor} bytes with this one ({min_slots} slots of {slot_bytes} bytes for unit {most!r}; a larger"
                " `chunk_size` packing its parameters into fewer chunks needs fewer slots)"
                if floor > least
                else ""
            )
            raise OffloadBudgetError(
                f"ChunkedOffloadStrategy: `device_memory_budget={budget}` bytes cannot hold parameter"
                f" {single[alone]!r}: it takes {chunk_bytes[alone]} bytes on its own, and a parameter is never split"
                " across chunks, so the slot streaming it is that large whatever `chunk_size` is. With"
                f" {resident_bytes} bytes of resident chunks and {peak_activation} bytes of peak activations the run"
                f" needs at least {least} bytes whatever `chunk_size` is{layout}. Raise `device_memory_budget` to at"
                f" least {floor} bytes; lowering `chunk_size` cannot help."
            )
        own = [sum(chunk_bytes[c] for c in set(unit.chunks) - resident) for unit in units]
        worst = max(range(len(units)), key=lambda u: (own[u] + activation[u], -u))
        unit = units[worst]
        largest = max(streamed, key=lambda c: (chunk_bytes[c], -c))  # its size is the slots'
        fix = (
            f"or name smaller units (`unit_types`); lowering `chunk_size` cannot shrink the slots: parameter"
            f" {single[largest]!r} alone fills {slot_bytes} bytes"
            if largest in single
            else "lower `chunk_size`, or name smaller units (`unit_types`)"
        )
        raise OffloadBudgetError(
            f"ChunkedOffloadStrategy: `device_memory_budget={budget}` bytes cannot hold unit {unit.name!r}:"
            f" its parameter chunks take {own[worst]} bytes and its activations {activation[worst]} bytes; with"
            f" {min_slots} streaming slot(s) of {slot_bytes} bytes (each as large as the largest streamed chunk),"
            f" {resident_bytes} bytes of resident chunks and {peak_activation} bytes of peak activations the run"
            f" needs {floor} bytes. Raise `device_memory_budget`, {fix}."
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
