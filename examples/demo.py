"""lightning_ckpt demo: what the plugin is for, on a CPU, in about a minute.

1. The same small training run three times, with a checkpoint every few steps: through Lightning's
   default IO (``TorchCheckpointIO``: ``torch.save`` on the training thread), through Lightning's
   ``AsyncCheckpointIO`` (a copy of the state on the training thread, ``torch.save`` on a thread of
   the training process) and through ``ShardedCheckpointIO(async_save=True)``. Side by side: the
   training time each save costs, when the checkpoint is complete and when durable, and the host
   memory it takes during a save and between saves.
2. The same run in a subprocess, SIGKILLed together with its writer process right after a save was
   handed over; resumed with ``ckpt_path="last"``, it ends bit-identical to the uninterrupted run.
3. ``python -m lightning_ckpt verify`` on the checkpoint, intact and with one flipped byte.

Run with ``make demo`` (creates the virtual environment) or ``python examples/demo.py``.
Everything is generated locally; nothing is downloaded. Timings depend on the machine and on what
else runs on it: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt
from lightning_ckpt import ShardedCheckpointIO, ShardedModelCheckpoint, verify_checkpoint
from lightning_ckpt.bench.measure import MB, RssSampler, median, proc_status
from lightning_ckpt.cli import main as cli

# Off a terminal (piped, logged) rich would wrap at 80 columns: the table needs about 125.
console = Console(highlight=False, soft_wrap=True, width=None if Console().is_terminal else 125)
INPUTS, OUTPUTS = 64, 16


@dataclass(frozen=True)
class Config:
    """One training run. A checkpoint is saved at the end of every epoch: a plain ``DataLoader``
    cannot resume mid-epoch (Lightning warns about that), so saving on epoch boundaries lets a
    resumed run see exactly the batches the uninterrupted run saw."""

    width: int = 2048
    depth: int = 4  # two hidden 2048 x 2048 layers: 8.6M parameters, a 103 MB checkpoint with AdamW
    batch_size: int = 64
    steps_per_epoch: int = 5  # = steps between two saves
    epochs: int = 6
    kill_after_save: int = 3  # the subprocess is killed right after this save was handed to its writer
    lr: float = 1e-3


TINY = Config(width=64, depth=3, epochs=4, kill_after_save=2)  # for the test suite: seconds, not a minute
QUIET_STEPS = 3  # a step this many steps or more after a save (or before the first) is an "ordinary" one


class Regressor(LightningModule):
    """An MLP learning the function of a fixed random "teacher" network: a task it can learn, so
    the training loss falls. The defaults are for ``examples/cli_train.py`` (LightningCLI); the
    demo passes its ``Config``."""

    def __init__(
        self, width: int = 256, depth: int = 4, batch_size: int = 64, steps_per_epoch: int = 16, lr: float = 1e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[torch.nn.Module] = [torch.nn.Linear(INPUTS, width), torch.nn.GELU()]
        for _ in range(depth - 2):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, OUTPUTS))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        # Its own generator: the data is the same in every run whatever the global RNG did.
        gen = torch.Generator().manual_seed(1234)
        x = torch.randn(self.hparams.steps_per_epoch * self.hparams.batch_size, INPUTS, generator=gen)
        hidden = torch.randn(INPUTS, 64, generator=gen) / INPUTS**0.5
        y = torch.tanh(x @ hidden) @ (torch.randn(64, OUTPUTS, generator=gen) / 64**0.5)
        return DataLoader(TensorDataset(x, y / y.std()), batch_size=self.hparams.batch_size)  # unit-variance targets


def _children() -> list[int]:
    """This process's child processes (the async writer; nothing else here starts one)."""
    pids: list[int] = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids += [int(pid) for pid in f.read().split()]
        except FileNotFoundError:  # a thread that ended since the listing
            continue
    return pids


class Meter(Callback):
    """What the comparison reads, the same way for every IO: the training loss and start time of
    every step; per save (at the end of every ``every``-th step) its start and this process's peak
    resident memory (``VmHWM``, exact) during it above its level at the start; at the end, the memory
    held for saving. A save lasts until the next step starts or, for an IO that calls
    :meth:`complete`, until it did (``AsyncCheckpointIO`` writes after the call returned)."""

    def __init__(self, every: int, until_complete: bool = False) -> None:
        self.every = every
        self.until_complete = until_complete
        self.losses: list[float] = []
        self.step_starts: list[float] = []
        self.save_starts: list[float] = []
        self.save_peaks_mb: list[float] = []
        self.pool_mb = self.writer_mb = 0.0
        self._sampler: RssSampler | None = None
        self._lock = threading.Lock()  # complete() runs on the thread that wrote the file

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self.step_starts.append(time.perf_counter())
        if not self.until_complete:
            self._close()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        # Lightning runs checkpoint callbacks after the others: a save due at this step comes next.
        if trainer.global_step % self.every == 0:
            self._close()  # the previous save's, if still open (VmHWM is one per process)
            with self._lock:
                self._sampler = RssSampler().__enter__()
            self.save_starts.append(time.perf_counter())

    def complete(self) -> None:
        """The save in progress is complete (its file written)."""
        self._close()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()
        # Memory kept for saving between saves: the shared-memory staging pool this process maps,
        # and the writer process's private (anonymous) memory; 0 for Lightning's IOs.
        self.pool_mb = proc_status().get("RssShmem", 0) / MB
        self.writer_mb = sum(proc_status(pid).get("RssAnon", 0) for pid in _children()) / MB

    def _close(self) -> None:
        with self._lock:
            sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.__exit__(None, None, None)
            peak = sampler.metrics()["peak_hwm_mb"]  # None where the kernel cannot reset VmHWM
            peak = peak if peak is not None else sampler.metrics()["peak_rss_mb"]
            self.save_peaks_mb.append(max(0.0, peak))  # RSS may dip below the level read at the save


class StampedTorchIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, noting when each file is complete, on whichever thread
    writes it (``AsyncCheckpointIO`` runs it on its own), and telling ``meter``."""

    def __init__(self) -> None:
        super().__init__()
        self.complete: list[float] = []
        self.meter: Meter | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.complete.append(time.perf_counter())
        if self.meter is not None:
            self.meter.complete()


@dataclass
class Run:
    trainer: Trainer
    model: Regressor
    checkpoint: ShardedModelCheckpoint
    meter: Meter
    seconds: float


def fit(config: Config, dirpath: str, io: Any, ckpt_path: str | None = None, extra: tuple[Callback, ...] = ()) -> Run:
    """Train ``config`` from scratch (or resume from ``ckpt_path``), saving into ``dirpath``."""
    seed_everything(0, verbose=False)
    model = Regressor(config.width, config.depth, config.batch_size, config.steps_per_epoch, config.lr)
    # The same callback measures both runs (its save records). With Lightning's IO it releases no
    # memory after a save, as Lightning's ModelCheckpoint does not.
    checkpoint = ShardedModelCheckpoint(
        dirpath=dirpath,
        every_n_train_steps=config.steps_per_epoch,
        save_top_k=0,  # only last.ckpt, replaced at every save
        save_last=True,
        slowdown_window=config.steps_per_epoch - 1,  # the steps up to the next save
        release_memory="auto" if isinstance(io, ShardedCheckpointIO) else "never",
        metrics_file=None,
    )
    stamped = io.checkpoint_io if isinstance(io, AsyncCheckpointIO) else io
    meter = Meter(config.steps_per_epoch, until_complete=isinstance(stamped, StampedTorchIO))
    if isinstance(stamped, StampedTorchIO):
        stamped.meter = meter
    trainer = Trainer(
        max_epochs=config.epochs,
        accelerator="cpu",
        devices=1,
        default_root_dir=dirpath,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[checkpoint, meter, *extra],
    )
    start = time.perf_counter()
    trainer.fit(model, ckpt_path=ckpt_path)
    return Run(trainer, model, checkpoint, meter, time.perf_counter() - start)


def final_state(run: Run) -> dict[str, torch.Tensor]:
    """Every tensor training produced: the model's state dict and the optimizer's state."""
    state = {f"model.{k}": v.detach().clone() for k, v in run.model.state_dict().items()}
    for index, values in run.trainer.optimizers[0].state_dict()["state"].items():
        state.update({f"optimizer.{index}.{name}": t.clone() for name, t in values.items()})
    return state


def ordinary_steps(starts: list[float], every: int) -> list[float]:
    """The durations of the ordinary steps (see :func:`step_figures`)."""
    durations = [b - a for a, b in zip(starts, starts[1:])]  # durations[i - 1]: step i (from 1)
    return [d for i, d in enumerate(durations, 1) if i > 1 and (i < every or i % every >= QUIET_STEPS)]


def median_noise(values: list[float]) -> float:
    """Twice the standard error of ``values``' median (from their median absolute deviation): two
    medians further apart than their noises combined differ beyond noise."""
    if len(values) < 2:
        return 0.0
    center = statistics.median(values)
    sigma = 1.4826 * statistics.median(abs(v - center) for v in values)
    return 2 * 1.25 * sigma / len(values) ** 0.5  # a median of n values: ~1.25 sigma / sqrt(n)


def step_figures(starts: list[float], every: int) -> tuple[float | None, float | None, float]:
    """(the median ordinary step, the time lost per save, its noise level) from the steps' start
    times, with a save at the end of every ``every``-th step.

    A step lasts from its start to the next step's start, so a save's step includes the save. An
    ordinary step is one ``QUIET_STEPS`` or more after a save (or before the first, the first step
    excepted): no save is being made or written then. The time lost to a save is what its step and
    the ``every - 1`` steps after it took beyond ``every`` ordinary steps, each of those steps taken
    as its median over the saves followed by that many steps (one step slowed by something else
    does not move it). The noise level is twice that figure's standard error, estimated from the
    spread (median absolute deviation) of the ordinary steps.
    """
    durations = [b - a for a, b in zip(starts, starts[1:])]  # durations[i - 1]: step i (from 1)
    ordinary = ordinary_steps(starts, every)
    saves = range(every, len(durations) - every + 2, every)  # saves with `every` steps from theirs on
    base = median(ordinary)
    if base is None or not saves:
        return base, None, 0.0
    lost = sum(statistics.median(durations[s - 1 + j] for s in saves) - base for j in range(every))
    sigma = 1.4826 * statistics.median(abs(d - base) for d in ordinary)  # a step's standard deviation
    noise = 2 * every**0.5 * 1.25 * sigma / len(saves) ** 0.5  # a median of n values: ~1.25 sigma / sqrt(n)
    return base, lost, noise


@dataclass(frozen=True)
class Figures:
    """One run's row values: medians per save (``None``: not known, or never, for fsync)."""

    size_mb: float | None
    stall_s: float | None  # the save call, plus ShardedModelCheckpoint's memory release after it
    lost_s: float | None  # >= 0: a measured difference below 0 is noise
    noise_s: float
    step_s: float | None
    complete_s: float | None
    fsynced_s: float | None
    peak_mb: float | None
    pool_mb: float  # the staging pool (shared memory) this process maps between saves
    writer_mb: float  # the private memory of the writer process
    fit_s: float
    step_noise_s: float = 0.0  # ``median_noise`` of the ordinary steps
    ranges: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)  # figure -> (min, max) over saves

    @property
    def held_mb(self) -> float:
        return self.pool_mb + self.writer_mb


def figures(run: Run, config: Config, stamped: StampedTorchIO | None) -> Figures:
    """``run``'s figures; ``stamped``: the Lightning IO that noted when its files were complete
    (``None``: ours, whose save records say when each save was committed and durable)."""
    records, meter = run.checkpoint.save_records, run.meter
    step, lost, noise = step_figures(meter.step_starts, config.steps_per_epoch)
    if stamped is None:
        size = median([r["nbytes"] / MB for r in records if r["nbytes"] is not None])
        # committed by a rename once every file and the folder are fsynced: complete and durable at once
        completes = [r["durable_s"] for r in records if r["durable_s"] is not None]
        fsyncs: list[float] = completes
    else:
        size = os.path.getsize(run.checkpoint.last_model_path) / MB
        completes = [done - start for start, done in zip(meter.save_starts, stamped.complete)]
        fsyncs = []  # TorchCheckpointIO never calls fsync
    per_save = {
        "stall_s": [r["call_s"] + r["release_s"] for r in records],
        "complete_s": completes,
        "fsynced_s": fsyncs,
        "peak_mb": meter.save_peaks_mb,
        "step_s": ordinary_steps(meter.step_starts, config.steps_per_epoch),
    }
    return Figures(
        size_mb=size,
        stall_s=median(per_save["stall_s"]),
        lost_s=None if lost is None else max(0.0, lost),
        noise_s=noise,
        step_s=step,
        complete_s=median(completes),
        fsynced_s=median(fsyncs) if fsyncs else None,
        peak_mb=median(meter.save_peaks_mb),
        pool_mb=meter.pool_mb,
        writer_mb=meter.writer_mb,
        fit_s=run.seconds,
        step_noise_s=median_noise(per_save["step_s"]),
        ranges={name: (min(values), max(values)) for name, values in per_save.items() if values},
    )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MB"


def _ranged(f: Figures, name: str, show: Callable[[float | None], str]) -> str:
    """``name``'s median with its range over the saves (or ordinary steps): ``0.012 s (0.010–0.015)``."""
    value, spread = getattr(f, name), f.ranges.get(name)
    if value is None or spread is None:
        return show(value)
    low, high = (show(v).split()[0] for v in spread)
    return f"{show(value)} ({low}–{high})"


def _step(f: Figures, base: Figures) -> str:
    """The ordinary step, and against ``base``'s (TorchCheckpointIO) when it differs beyond noise:
    then it is a cost of the IO (the writer competing for the cores), not noise."""
    text = _ranged(f, "step_s", _s)
    if f is base or f.step_s is None or base.step_s is None:
        return text
    if abs(f.step_s - base.step_s) <= f.step_noise_s + base.step_noise_s:
        return f"{text}, same"
    change = f.step_s / base.step_s - 1
    return f"{text}, {'+' if change > 0 else '−'}{abs(change):.0%}"


def _lost(f: Figures) -> str:
    if f.lost_s is None:
        return "-"
    return "within noise" if f.lost_s <= f.noise_s else _s(f.lost_s)


CONTENDERS = (
    ("TorchCheckpointIO", "Lightning's default: torch.save in the save call"),
    ("AsyncCheckpointIO", "Lightning's async: a copy in the call, torch.save on a thread"),
    ("ours, async", "ShardedCheckpointIO(async_save=True)"),
)


def compare(config: Config, out: str) -> Run:
    """Section 1: the same run through Lightning's two IOs and through ours; returns ours."""
    runs: list[Run] = []
    rows: list[Figures] = []
    # Each IO made just before its run: an async ShardedCheckpointIO installs a process-wide
    # optimizer-step hook, which the Lightning runs should not carry.
    for index, (name, what) in enumerate(CONTENDERS):
        console.print(f"  training with {name} ({what}) ...")
        stamped = StampedTorchIO() if index < 2 else None
        io = stamped if index == 0 else AsyncCheckpointIO(stamped) if index == 1 else ShardedCheckpointIO(async_save=True)
        runs.append(fit(config, os.path.join(out, f"run{index + 1}"), io))
        rows.append(figures(runs[-1], config, stamped))
    saves = len(runs[0].checkpoint.save_records)
    table = Table(title=f"{saves} saves of last.ckpt per run; each value: the median (lowest–highest) over the saves", title_justify="left")
    table.add_column("figure", no_wrap=True)
    for name, _ in CONTENDERS:
        table.add_column(name, justify="right")
    quiet, window = QUIET_STEPS, config.steps_per_epoch
    for label, value in (
        ("checkpoint size", lambda f: _mb(f.size_mb)),
        ("[1] stall: training blocked", lambda f: _ranged(f, "stall_s", _s)),
        ("[2] training time lost", _lost),
        ("[3] ordinary step", lambda f: _step(f, rows[0])),
        ("[4] file complete after", lambda f: _ranged(f, "complete_s", _s)),
        ("[5] fsynced (durable) after", lambda f: "never" if f.fsynced_s is None else _ranged(f, "fsynced_s", _s)),
        ("[6] peak extra memory", lambda f: _ranged(f, "peak_mb", _mb)),
        ("[7] memory held between saves", lambda f: _mb(f.held_mb)),
        ("[8] fit() wall time", lambda f: f"{f.fit_s:.1f} s"),
    ):
        table.add_row(label, *(value(f) for f in rows))
    console.print(table)
    ours = rows[-1]
    console.print(
        "  [1] the Trainer waits for the save to return. TorchCheckpointIO pickles the whole state with torch.save\n"
        "      (into memory, then to the file); AsyncCheckpointIO clones every tensor, then hands the copy to a thread;\n"
        "      ours copies the tensors into a reused staging pool and hands them to a writer process, and adds\n"
        "      ShardedModelCheckpoint's memory release (release_memory=\"auto\": a trim in the background when needed).\n"
        f"  [2] what the save's step and the {window - 1} steps after it took beyond {window} ordinary steps [3]: the stall\n"
        "      plus any slowdown while the save is written beside training (AsyncCheckpointIO: on a thread that\n"
        f"      shares the training process's GIL; ours: a writer process; {os.cpu_count()} cores here). \"within noise\": less\n"
        "      than twice its standard error, estimated from the spread of ordinary steps (never shown negative).\n"
        f"  [3] the median step {quiet} or more steps after a save (or before the first), when none is being written.\n"
        "      Against TorchCheckpointIO's: \"same\" within the two medians' noise (twice their standard errors), else\n"
        "      the difference: a cost of that IO (its writer competing with training for the cores), not noise.\n"
        "  [4] from the save call until the checkpoint is whole on disk: TorchCheckpointIO when the call returns,\n"
        "      AsyncCheckpointIO when its thread's torch.save returns, ours when the save is committed.\n"
        "  [5] ours: every file and the folder fsynced, then committed by one rename. Lightning's IOs never fsync:\n"
        "      their file is durable whenever the OS flushes it, and a power loss before that can lose it.\n"
        "  [6] the training process's peak resident memory (VmHWM) during the save above its level at its start\n"
        "      (for AsyncCheckpointIO until its file is complete): TorchCheckpointIO's torch.save buffer;\n"
        "      AsyncCheckpointIO's clone of the state, then that buffer; ours stages into memory it keeps [7].\n"
        f"  [7] ours: a {ours.pool_mb:.0f} MB staging pool (shared memory, allocated once, reused by every save) and"
        f" {ours.writer_mb:.0f} MB\n"
        "      of writer process (its own Python with torch): the standing cost of saves that copy into no new\n"
        "      memory and write outside the training process. Lightning's IOs keep nothing between saves.\n"
        "  [8] the whole fit, saves included; ours starts its writer process (it imports torch) beside the first steps.",
        soft_wrap=True,
    )
    losses = runs[-1].meter.losses
    steps = [1, *range(config.steps_per_epoch, len(losses) + 1, config.steps_per_epoch)]
    same = all(run.meter.losses == losses for run in runs)
    console.print(
        f"  train_loss (MSE, targets of variance 1) at steps {', '.join(map(str, steps))}:"
        f" {' '.join(f'{losses[s - 1]:.3f}' for s in steps)}; {'identical' if same else '[red]DIFFERENT[/red]'} step by"
        " step in all three runs (saving never touches training)"
    )
    return runs[-1]


def _wait_gone(pid: int, timeout: float) -> None:
    """Until ``pid`` has exited (a zombie counts as gone: the writer is not our child to reap)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)


def kill_mid_save(config: Config, out: str, argv_config: list[str]) -> tuple[str, int]:
    """Section 2, first half: run the training in a subprocess and SIGKILL it (and its writer) right
    after a save was handed to the writer. Returns the checkpoint folder and the step killed at."""
    folder = os.path.join(out, "killed")
    ready = os.path.join(out, "killed.ready")
    log = os.path.join(out, "killed-run.log")
    step = config.kill_after_save * config.steps_per_epoch
    with open(log, "w") as stderr:
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv_config, "--killed-run", folder, ready],
            stdout=stderr,
            stderr=stderr,
            start_new_session=True,  # its own process group: killed as a whole
        )
    try:
        deadline = time.monotonic() + 300  # start-up alone takes seconds, more on a loaded machine
        while not os.path.exists(ready):
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the training subprocess ended or hung before its save at step {step}; see {log}")
            time.sleep(0.005)
        writer = int(open(ready).read())
        # Everything dies at once, as in a machine or container kill: the training process group and
        # the writer process (in a session of its own).
        os.killpg(child.pid, signal.SIGKILL)
        os.kill(writer, signal.SIGKILL)
        child.wait()
        _wait_gone(writer, 60)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    console.print(
        f"  SIGKILL to the training process (pid {child.pid}) and its writer process (pid {writer}), right after"
        f" the step-{step} save of last.ckpt was handed to the writer"
    )
    return folder, step


def _killed_run(config: Config, folder: str, ready: str) -> None:
    """The subprocess of section 2: trains as section 1's async run until the parent kills it."""
    step = config.kill_after_save * config.steps_per_epoch

    class HandOver(ShardedCheckpointIO):
        """Tells the parent the moment the save of ``step`` is the writer process's."""

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)  # async: returns once staged
            if checkpoint["global_step"] == step and not os.path.exists(ready):
                with open(ready + ".tmp", "w") as f:
                    f.write(str(_children()[0]))  # the writer process
                os.replace(ready + ".tmp", ready)

    class AwaitKill(Callback):
        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            time.sleep(300)  # a tiny configuration may finish before the kill arrives: wait for it

    fit(config, folder, HandOver(async_save=True), extra=(AwaitKill(),))


def resume_and_check(config: Config, folder: str, killed_at: int, reference: Run) -> str:
    """Section 2, second half: what the kill left, the resume, and the bit-for-bit comparison."""
    names = sorted(os.listdir(folder))
    hidden = [n for n in names if n.startswith(".") and not n.endswith(".lock")]
    last = os.path.join(folder, "last.ckpt")
    saved_step = verify_checkpoint(last).global_step  # every file's size and checksum
    console.print(f"  left in {folder}: last.ckpt at step {saved_step} (committed; every checksum verifies)")
    if saved_step < killed_at:
        console.print(
            f"  and {len(hidden)} hidden temporary folder(s) {hidden}: the step-{killed_at} save the kill cut off."
            " A resume never picks it; the next save removes it."
        )
    else:
        console.print(f"  (the step-{killed_at} save had committed before the kill landed; nothing was cut off)")
    resumed = fit(config, folder, ShardedCheckpointIO(async_save=True), ckpt_path="last")
    console.print(
        f'  Trainer.fit(ckpt_path="last") resumed at step {saved_step} and trained to step {resumed.trainer.global_step}'
    )
    expected, got = final_state(reference), final_state(resumed)
    differ = [k for k in expected if k not in got or not torch.equal(expected[k], got[k])] + [k for k in got if k not in expected]
    values = sum(t.numel() for t in expected.values())
    losses_same = resumed.meter.losses == reference.meter.losses[saved_step:]
    if differ or not losses_same or resumed.trainer.global_step != reference.trainer.global_step:
        raise SystemExit(f"the resumed run differs from the uninterrupted one: {differ[:5]}, losses equal: {losses_same}")
    console.print(
        f"  compared with section 1's uninterrupted async run at step {reference.trainer.global_step}:"
        f" all {len(expected)} tensors ({sum(k.startswith('model.') for k in expected)} of the model,"
        f" {sum(k.startswith('optimizer.') for k in expected)} of AdamW: step, exp_avg, exp_avg_sq), {values / 1e6:.1f}M"
        f" values, bit-identical (torch.equal); train_loss of steps {saved_step + 1}-{reference.trainer.global_step}"
        " identical too"
    )
    return last


def verify(path: str) -> None:
    """Section 3: the CLI's verify, on the checkpoint and on a copy of it with one flipped byte."""
    console.print(f"  $ python -m lightning_ckpt verify {path}")
    if cli(["verify", path]) != 0:
        raise SystemExit(f"verify failed on {path}")
    damaged = path.replace("last.ckpt", "damaged.ckpt")
    shutil.copytree(path, damaged)
    shard = max(glob.glob(os.path.join(damaged, "*.safetensors")), key=os.path.getsize)
    with open(shard, "r+b") as f:  # flip one byte in the middle of the largest shard
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    console.print(f"  $ python -m lightning_ckpt verify {damaged}   # a copy, one byte flipped in {os.path.basename(shard)}")
    code = cli(["verify", damaged])
    console.print(f"  exit code {code} (1: damaged)")
    if code != 1:
        raise SystemExit(f"verify did not report the flipped byte in {shard}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="demo-output", help="folder for everything the demo writes (emptied first)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and run (for the test suite)")
    parser.add_argument("--killed-run", nargs=2, metavar=("FOLDER", "READY_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("lightning.pytorch", "lightning.fabric"):  # "GPU available: False", tips: not the demo's subject
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")  # Lightning 2.6 on torch >= 2.13
    config = TINY if args.tiny else Config()
    out = os.path.abspath(args.out)
    if args.killed_run:
        _killed_run(config, *args.killed_run)
        return
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    start = time.perf_counter()
    params = sum(p.numel() for p in Regressor(config.width, config.depth, config.batch_size, config.steps_per_epoch, config.lr).parameters())
    console.rule(f"lightning_ckpt {lightning_ckpt.__version__}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    console.print(
        f"  an MLP of {params / 1e6:.1f}M parameters with AdamW (state: {params * 12 / MB:.0f} MB of weights and moments),"
        f" {config.epochs * config.steps_per_epoch} steps, last.ckpt saved every {config.steps_per_epoch} steps"
    )
    console.rule("1. the same run, saving through Lightning's two IOs and through ours")
    reference = compare(config, out)
    console.rule("2. SIGKILL while a save is in flight, then resume")
    folder, killed_at = kill_mid_save(config, out, ["--out", out] + (["--tiny"] if args.tiny else []))
    last = resume_and_check(config, folder, killed_at, reference)
    console.rule("3. verify")
    verify(last)
    console.rule(f"done in {time.perf_counter() - start:.0f} s")
    console.print(f"  everything the demo wrote is in {out}", soft_wrap=True)


if __name__ == "__main__":
    main()
