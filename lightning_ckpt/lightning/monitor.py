"""Self-measurement of saves: stall, durability, memory, and the post-save slowdown window.

A save's *stall* is every moment of training it costs, wherever it lands: the save call, the
memory release after it, and the time the training stream later idles waiting for the save's
device-to-host copies (``copy_wait_s``, GPU time measured with CUDA events, known a step later).
A heap trim on a background thread (``background_trim_s``) is not part of the stall: it runs while
training does, and what it costs the training thread (an allocation waiting on an arena lock)
shows in the post-save step times.

Step durations are the intervals between consecutive training-batch starts, so a step's duration
includes a save made at its end. For a save at the end of step ``s``, the slowdown compares the
median of the ``window`` steps after it with the median of the ``window`` steps before it;
``worst_slowdown`` is the slowest of those steps against the same median (the step right after a
save is where a cost the median hides shows); ``lost_s`` adds up what the save step and the window
took beyond that median (the total lost time, noise included); ``recovery_steps`` counts the steps
after the save that stayed more than 10% slower than before (the field's "POST-CKPT" window).
Nothing here imports Lightning.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

RECOVERED_WITHIN = 1.10  # a step is "back to normal" within 10% of the pre-save median


@dataclass
class SaveRecord:
    """One save, as measured by ``ShardedModelCheckpoint`` (``None``: not known (yet))."""

    index: int
    path: str
    global_step: int
    step_index: int  # training steps completed when the save happened
    call_s: float  # training loop blocked by the save call
    release_s: float  # memory release after the save, on the training thread (measurement included)
    nbytes: int | None
    durable_s: float | None  # from the save call until committed and durable
    host_rss_before: int
    host_rss_after: int
    cuda_reserved_before: int
    cuda_reserved_after: int
    cuda_cache_emptied: bool
    copy_wait_s: float | None = None  # training stream idle for the device copies (0: none)
    cuda_fragmentation: float = 0.0  # before the release: free bytes stranded in partly used segments
    cuda_alloc_retries: int = 0  # allocator retries (free the cache, retry) since the previous save
    heap_left_bytes: int = 0  # freed host heap the save call left resident (``memory.heap_left``)
    release_skipped: bool = True  # the host heap was not trimmed after this save
    release_reason: str = ""  # why it was trimmed or skipped
    released_bytes: int | None = None  # host memory the trim gave back (background: known once done)
    background_trim_s: float | None = None  # ``malloc_trim`` off the training thread (None: none ran)
    pre_step_median_s: float | None = None
    post_step_median_s: float | None = None
    slowdown: float | None = None  # post / pre median step time
    worst_slowdown: float | None = None  # slowest post-save step / pre median
    lost_s: float | None = None  # save step + window beyond the pre median, summed
    recovery_steps: int | None = None
    reused_bytes: int | None = None  # of ``nbytes``: files reused from an earlier checkpoint (incremental)

    @property
    def written_bytes(self) -> int | None:
        """Bytes the save wrote (``nbytes`` less what it reused)."""
        return None if self.nbytes is None else self.nbytes - (self.reused_bytes or 0)

    @property
    def stall_s(self) -> float:
        """Training time the save cost: call + release + copy wait (so far)."""
        return self.call_s + self.release_s + (self.copy_wait_s or 0.0)

    @property
    def throughput_gbps(self) -> float | None:
        if self.nbytes is None or not self.durable_s:
            return None
        return self.nbytes / self.durable_s / 1e9

    def metrics(self) -> dict[str, float]:
        """The ``ckpt/...`` metrics known so far."""
        values = {
            "ckpt/stall_s": self.stall_s,
            "ckpt/call_s": self.call_s,
            "ckpt/release_s": self.release_s,
            "ckpt/host_rss_before_gb": self.host_rss_before / 1e9,
            "ckpt/host_rss_after_gb": self.host_rss_after / 1e9,
            "ckpt/heap_left_gb": self.heap_left_bytes / 1e9,
            "ckpt/release_skipped": float(self.release_skipped),
        }
        if self.cuda_reserved_before:
            values["ckpt/cuda_reserved_before_gb"] = self.cuda_reserved_before / 1e9
            values["ckpt/cuda_reserved_after_gb"] = self.cuda_reserved_after / 1e9
            values["ckpt/cuda_fragmentation"] = self.cuda_fragmentation
            values["ckpt/cuda_alloc_retries"] = float(self.cuda_alloc_retries)
        optional = {
            "ckpt/bytes_gb": None if self.nbytes is None else self.nbytes / 1e9,
            "ckpt/written_gb": None if self.written_bytes is None else self.written_bytes / 1e9,
            "ckpt/reused_gb": None if self.reused_bytes is None else self.reused_bytes / 1e9,
            "ckpt/durable_s": self.durable_s,
            "ckpt/write_gbps": self.throughput_gbps,
            "ckpt/copy_wait_s": self.copy_wait_s,
            "ckpt/released_gb": None if self.released_bytes is None else self.released_bytes / 1e9,
            "ckpt/background_trim_s": self.background_trim_s,
            "ckpt/post_save_slowdown": self.slowdown,
            "ckpt/post_save_worst_slowdown": self.worst_slowdown,
            "ckpt/lost_s": self.lost_s,
            "ckpt/post_save_recovery_steps": None if self.recovery_steps is None else float(self.recovery_steps),
        }
        values.update({k: float(v) for k, v in optional.items() if v is not None})
        return values

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "written_bytes": self.written_bytes,
            "stall_s": self.stall_s,
            "throughput_gbps": self.throughput_gbps,
        }


@dataclass(frozen=True)
class LoadRecord:
    """One load by ``ShardedCheckpointIO.load_checkpoint`` (its ``last_load``): wall seconds of
    the call, the checkpoint's bytes, and those this rank read from storage (fewer than the
    checkpoint's when ranks read once and broadcast; ``None``: not known, a remote load)."""

    path: str
    seconds: float
    total_bytes: int | None
    bytes_read: int | None
    read_once: bool = False

    @property
    def gbps(self) -> float | None:
        """The checkpoint's GB (1e9 bytes) delivered per second of the load."""
        if self.total_bytes is None or self.seconds <= 0:
            return None
        return self.total_bytes / self.seconds / 1e9

    def metrics(self) -> dict[str, float]:
        """``ckpt/load_s``, ``ckpt/load_gbps`` and ``ckpt/load_read_gb`` (those known)."""
        values = {
            "ckpt/load_s": self.seconds,
            "ckpt/load_gbps": self.gbps,
            "ckpt/load_read_gb": None if self.bytes_read is None else self.bytes_read / 1e9,
        }
        return {k: float(v) for k, v in values.items() if v is not None}

    def line(self) -> str:
        """One line for ``verbose=True``."""
        read = "" if self.bytes_read is None or self.bytes_read == self.total_bytes else f", {_size(self.bytes_read)} read here"
        size = "" if self.total_bytes is None else f" {_size(self.total_bytes)}"
        speed = "" if self.gbps is None else f" ({self.gbps:.2f} GB/s{read})"
        return f"loaded{size} from {self.path} in {_seconds(self.seconds)}{speed}"


@dataclass
class SaveMonitor:
    """Step timing and save records (rank 0 only)."""

    window: int = 20
    step_times: list[float] = field(default_factory=list)
    records: list[SaveRecord] = field(default_factory=list)
    _open: list[SaveRecord] = field(default_factory=list)  # records whose window is not closed yet
    _last_start: float | None = None

    def add(self, record: SaveRecord) -> None:
        self.records.append(record)
        self._open.append(record)

    def on_step_start(self, now: float) -> list[SaveRecord]:
        """Record the previous step's duration; return records whose slowdown window just closed."""
        if self._last_start is not None:
            self.step_times.append(now - self._last_start)
        self._last_start = now
        return self._close(final=False)

    def pause(self, now: float) -> None:
        """Validation (not training) starts: the current step ends here, and the time until the
        next step starts is not counted as a step."""
        if self._last_start is not None:
            self.step_times.append(now - self._last_start)
        self._last_start = None

    def finish(self) -> list[SaveRecord]:
        """End of training: close every open window with the steps there are."""
        return self._close(final=True)

    def _close(self, final: bool) -> list[SaveRecord]:
        closed = [r for r in self._open if self._close_window(r, final)]
        if closed:
            self._open = [r for r in self._open if r.slowdown is None]
        return closed

    def _close_window(self, record: SaveRecord, final: bool) -> bool:
        save_step = record.step_index  # step_times[save_step] is the step containing the save
        after = self.step_times[save_step + 1 : save_step + 1 + self.window]
        before = self.step_times[max(0, save_step - self.window) : save_step]
        if not before or not after or (len(after) < self.window and not final):
            return False
        record.pre_step_median_s = baseline = statistics.median(before)
        record.post_step_median_s = statistics.median(after)
        record.slowdown = record.post_step_median_s / baseline
        record.worst_slowdown = max(after) / baseline
        record.lost_s = sum(t - baseline for t in self.step_times[save_step : save_step + 1 + len(after)])
        limit = RECOVERED_WITHIN * baseline
        record.recovery_steps = next((i for i, t in enumerate(after) if t <= limit), len(after))
        return True

    def append_jsonl(self, path: str) -> None:
        """Append this run's saves and step times as one JSON line (earlier runs' lines are kept)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        line = json.dumps({"saves": [r.as_dict() for r in self.records], "step_times_s": self.step_times})
        with open(path, "a") as f:
            f.write(line + "\n")

    def plot(self, path: str) -> bool:
        """PNG of step time over training with the saves marked; False without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.plot(range(len(self.step_times)), self.step_times, lw=0.8, label="step time")
        for r in self.records:
            ax.axvline(r.step_index, color="tab:red", alpha=0.4, lw=0.8)
        ax.set_xlabel("training step")
        ax.set_ylabel("seconds")
        ax.set_title("step time (red: checkpoint saves)")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return True


def _fmt(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def save_line(record: SaveRecord) -> str:
    """One rich-markup line for a save, every figure labelled, about 100 columns wide with
    Lightning's default names. The step is named where the checkpoint's name does not already say
    it; a figure an async save learns later (its size, when it is durable) reads "pending" (the
    ``ckpt/...`` metrics and the summary table get it once known)."""
    name = os.path.basename(record.path)
    step = "" if f"step={record.global_step}" in name else f" (step {record.global_step})"
    size = "pending" if record.nbytes is None else _size(record.nbytes)
    durable = "pending" if record.durable_s is None else _seconds(record.durable_s)
    return (
        f"[bold]ckpt[/bold] {name}{step}: size {size}, stall {_seconds(record.stall_s)}, durable {durable},"
        f" {_release_text(record)}"
    )


def _size(nbytes: int) -> str:
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.2f} GB"
    return f"{nbytes / 1e6:.0f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.0f} kB"


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def _release_text(record: SaveRecord) -> str:
    """The freed heap the save left resident and what the release did with it: left untrimmed,
    trimming (in the background), or the bytes the trim gave back."""
    if record.release_skipped:
        return f"untrimmed heap {_size(record.heap_left_bytes)}"
    if record.released_bytes is None:
        return f"trimming heap {_size(record.heap_left_bytes)}"
    return f"heap {_size(record.released_bytes)} released"


def summary_table(records: list[SaveRecord]) -> Table:
    table = Table(title="checkpoint saves")
    columns = (
        "step", "checkpoint", "GB", "stall s", "copy wait s", "durable s", "GB/s",
        "slowdown", "worst step", "lost s", "recovery", "RSS after GB", "heap left GB", "released GB",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "checkpoint" else "right", no_wrap=True)
    for r in records:
        table.add_row(
            str(r.global_step),
            os.path.basename(r.path),
            _fmt(None if r.nbytes is None else r.nbytes / 1e9),
            _fmt(r.stall_s, digits=3),
            _fmt(r.copy_wait_s, digits=3),
            _fmt(r.durable_s),
            _fmt(r.throughput_gbps),
            _fmt(r.slowdown, "×"),
            _fmt(r.worst_slowdown, "×"),
            _fmt(r.lost_s, digits=3),
            "-" if r.recovery_steps is None else str(r.recovery_steps),
            _fmt(r.host_rss_after / 1e9),
            _fmt(r.heap_left_bytes / 1e9),
            "skipped" if r.release_skipped else _fmt(None if r.released_bytes is None else r.released_bytes / 1e9),
        )
    return table


def print_summary(records: list[SaveRecord], console: Console | None = None) -> None:
    """Print the summary table; off a terminal (piped, logged) the width fits the table, so no
    checkpoint name is cut or wrapped."""
    if not records:
        return
    table = summary_table(records)
    console = console or Console()
    if not console.is_terminal:
        needed = Measurement.get(console, console.options.update(width=10_000), table).maximum
        console = Console(file=console.file, width=max(needed, 20), force_terminal=False)
    console.print(table)
