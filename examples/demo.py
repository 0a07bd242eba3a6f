"""lightning_ckpt demo: what the plugin is for, on a CPU, in about a minute.

1. The same small training run twice, with a checkpoint every few steps: once through Lightning's
   default IO (``TorchCheckpointIO``: ``torch.save`` on the training thread), once through
   ``ShardedCheckpointIO(async_save=True)``. Side by side: the training time each save costs, the
   host memory it takes, and when the checkpoint is durable.
2. The same run in a subprocess, SIGKILLed together with its writer process right after a save was
   handed over; resumed with ``ckpt_path="last"``, it ends bit-identical to the uninterrupted run.
3. ``python -m lightning_ckpt verify`` on the checkpoint, intact and with one flipped byte.

Run with ``make demo`` (creates the virtual environment) or ``python examples/demo.py``.
Everything is generated locally; nothing is downloaded. Timings depend on the machine and on what
else runs on it: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.plugins import TorchCheckpointIO
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt
from lightning_ckpt import ShardedCheckpointIO, ShardedModelCheckpoint, verify_checkpoint
from lightning_ckpt.bench.measure import MB, RssSampler, proc_status
from lightning_ckpt.cli import main as cli

# Off a terminal (piped, logged) rich would wrap at 80 columns: the table needs about 100.
console = Console(highlight=False, soft_wrap=True, width=None if Console().is_terminal else 100)
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
    epochs: int = 8
    kill_after_save: int = 3  # the subprocess is killed right after this save was handed to its writer
    lr: float = 1e-3


TINY = Config(width=64, depth=3, epochs=4, kill_after_save=2)  # for the test suite: seconds, not a minute


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
        with open(path) as f:
            pids += [int(pid) for pid in f.read().split()]
    return pids


class Meter(Callback):
    """The training loss of every step, and per save the peak host memory of this process during
    it above its level just before (``VmHWM``, exact); at the end, the memory held for saving."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.losses: list[float] = []
        self.save_peaks_mb: list[float] = []
        self.pool_mb = self.writer_mb = 0.0
        self._sampler: RssSampler | None = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        # Lightning runs checkpoint callbacks after the others: a save due at this step comes next.
        if trainer.global_step % self.every == 0:
            self._sampler = RssSampler().__enter__()

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self._close()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close()
        # Memory a save keeps between saves: the shared-memory staging pool this process maps, and
        # the writer process's private (anonymous) memory; 0 for Lightning's IO.
        self.pool_mb = proc_status().get("RssShmem", 0) / MB
        self.writer_mb = sum(proc_status(pid).get("RssAnon", 0) for pid in _children()) / MB

    def _close(self) -> None:
        if self._sampler is not None:
            self._sampler.__exit__(None, None, None)
            peak = self._sampler.metrics()["peak_hwm_mb"]  # None where the kernel cannot reset VmHWM
            peak = peak if peak is not None else self._sampler.metrics()["peak_rss_mb"]
            self.save_peaks_mb.append(max(0.0, peak))  # RSS may dip below the level read before the save
            self._sampler = None


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
    meter = Meter(config.steps_per_epoch)
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


def _median(records: list[dict[str, Any]], key: str, unit: float = 1.0) -> float | None:
    """The median of a save-record figure over the saves that know it, in ``unit``s."""
    values = [r[key] / unit for r in records if r[key] is not None]
    return statistics.median(values) if values else None


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MB"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}x" if a is not None and b else "-"


def compare(config: Config, out: str) -> Run:
    """Section 1: the same run through Lightning's IO and through ours; returns ours."""
    runs = {}
    # Each IO made just before its run: an async ShardedCheckpointIO installs a process-wide
    # optimizer-step hook, which the Lightning run should not carry.
    for name, label, make in (
        ("lightning", "TorchCheckpointIO", TorchCheckpointIO),
        ("lightning_ckpt", "ShardedCheckpointIO(async_save=True)", lambda: ShardedCheckpointIO(async_save=True)),
    ):
        console.print(f"  training with {label} ...")
        runs[name] = fit(config, os.path.join(out, name), make())
    ours, theirs = runs["lightning_ckpt"], runs["lightning"]
    a, b = theirs.checkpoint.save_records, ours.checkpoint.save_records
    table = Table(title=f"{len(a)} saves of last.ckpt per run; medians per save", title_justify="left")
    table.add_column("figure", no_wrap=True)
    table.add_column("Lightning TorchCheckpointIO", justify="right")
    table.add_column("ours, async", justify="right")
    table.add_column("Lightning / ours", justify="right")
    rows = [
        ("checkpoint size", _mb(_median(a, "nbytes", MB)), _mb(_median(b, "nbytes", MB)), ""),
        ("[1] save call: training blocked", _s(_median(a, "call_s")), _s(_median(b, "call_s")),
         _ratio(_median(a, "call_s"), _median(b, "call_s"))),
        ("[2] memory release after it", "off", _s(_median(b, "release_s")), ""),
        ("[3] training time lost", _s(_median(a, "lost_s")), _s(_median(b, "lost_s")),
         _ratio(_median(a, "lost_s"), _median(b, "lost_s"))),
        ("[4] step without a save", _s(_median(a, "pre_step_median_s")), _s(_median(b, "pre_step_median_s")), ""),
        ("[5] durable after", "never fsynced", _s(_median(b, "durable_s")), ""),
        ("[6] extra memory during a save", _mb(statistics.median(theirs.meter.save_peaks_mb)),
         _mb(statistics.median(ours.meter.save_peaks_mb)), ""),
        ("[7] memory held between saves", _mb(theirs.meter.pool_mb + theirs.meter.writer_mb),
         f"{ours.meter.pool_mb:.0f} + {ours.meter.writer_mb:.0f} MB", ""),
        ("[8] fit() wall time", f"{theirs.seconds:.1f} s", f"{ours.seconds:.1f} s", ""),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(
        "  [1] the Trainer waits for save_checkpoint to return. Lightning pickles the whole state with torch.save\n"
        "      (into memory, then to the file); ours copies the tensors into a reused staging pool and hands them to\n"
        "      a writer process.\n"
        "  [2] time on the training thread of ShardedModelCheckpoint's memory release (release_memory=\"auto\", its\n"
        "      default: it measures the heap a save left behind and trims it in the background only when that is\n"
        "      large or memory is short); the Lightning run has it off, as Lightning's ModelCheckpoint has none.\n"
        "      [1] + [2] = the save's stall.\n"
        f"  [3] the save's step and the {config.steps_per_epoch - 1} steps after it, beyond the median step before it:\n"
        f"      the stall plus any slowdown while the writer process shares the CPU with training ({os.cpu_count()} cores\n"
        "      here). Negative: other work on the machine made steps vary more than the save cost.\n"
        "  [4] the median step time before the saves (the training step alone).\n"
        "  [5] ours: until its files and folder are fsynced and committed by one rename; TorchCheckpointIO's file is\n"
        "      complete when the call returns, durable whenever the OS flushes it.\n"
        "  [6] peak resident memory of the training process during the save (VmHWM) above its level just before.\n"
        "  [7] ours: the shared-memory staging pool (allocated once, reused by every save) + the writer process's\n"
        "      private memory; Lightning keeps nothing between saves.\n"
        "  [8] the whole fit, saves included; ours includes starting the writer process (it imports torch) beside\n"
        "      the first steps, once per fit.\n"
        "  Lightning / ours: the Lightning run's figure divided by ours.",
        soft_wrap=True,
    )
    losses = ours.meter.losses
    steps = [1, *range(config.steps_per_epoch, len(losses) + 1, config.steps_per_epoch)]
    same = theirs.meter.losses == losses
    console.print(
        f"  train_loss (MSE, targets of variance 1) at steps {', '.join(map(str, steps))}:"
        f" {' '.join(f'{losses[s - 1]:.3f}' for s in steps)}; {'identical' if same else '[red]DIFFERENT[/red]'} step by"
        " step in both runs (saving never touches training)"
    )
    return ours


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
    console.rule("1. the same run, saving through Lightning's default IO and through ours")
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
