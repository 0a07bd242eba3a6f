"""``bench --mode startup``: how long the CLI takes to answer on a small checkpoint, against ``import torch``.

Every command runs in a fresh interpreter (``sys.executable``), as a user's shell would start it: the
floor is ``python -c "import torch"`` (the CLI cannot start faster than torch imports), then
``--help``, ``inspect`` and ``verify`` of a small lightning_ckpt checkpoint, ``verify`` of a single
``torch.save`` file and ``inspect`` of a stock DCP folder (the one kind that needs DCP's modules).
Rounds run the commands interleaved, each round in a rotated order, so a slow moment of a noisy
machine lands on every command alike; each row is the median over ``--rounds`` and its ratio to the
floor's median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from lightning_ckpt.bench.files import DEFAULT_DIR, run_directory
from lightning_ckpt.bench.report import (
    add_json_argument,
    emit_report,
    fmt,
    machine_info,
    report_header,
    stderr_logger,
)

FLOOR = "import torch"
_MAKE_CHECKPOINTS = """
import sys, torch
import torch.distributed.checkpoint as dcp
import lightning_ckpt
folder = sys.argv[1]
state = {"w": torch.randn(256, 256), "b": torch.zeros(256)}
checkpoint = {"state_dict": state, "epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.0"}
lightning_ckpt.save_checkpoint(checkpoint, f"{folder}/ours.ckpt")
torch.save(checkpoint, f"{folder}/single.ckpt")
dcp.save({"state_dict": state}, checkpoint_id=f"{folder}/dcp.ckpt")
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks --mode startup",
        description="The CLI's start-up on a small checkpoint, in fresh interpreters, against `import torch`.",
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; each row is the median (default 7)")
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"where the small checkpoints go (default {DEFAULT_DIR})")
    add_json_argument(parser)
    return parser


def _commands(folder: str) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "lightning_ckpt"]
    return {
        FLOOR: [sys.executable, "-c", "import torch"],
        "--help": [*cli, "--help"],
        "inspect (ours)": [*cli, "inspect", f"{folder}/ours.ckpt"],
        "verify (ours)": [*cli, "verify", f"{folder}/ours.ckpt"],
        "verify (torch.save file)": [*cli, "verify", f"{folder}/single.ckpt"],
        "inspect (DCP folder)": [*cli, "inspect", f"{folder}/dcp.ckpt"],
    }


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Run the start-up benchmark; print a table (and the JSON with ``--json``). Returns 0."""
    from rich.table import Table

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    log = stderr_logger()
    started = time.time()
    with run_directory(os.path.abspath(args.dir)) as folder:
        subprocess.run([sys.executable, "-c", _MAKE_CHECKPOINTS, folder], check=True)
        commands = _commands(folder)
        names = list(commands)
        runs: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(2):  # warm the page cache of the interpreter's and the package's files
            _timed(commands[FLOOR])
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(_timed(commands[name]))
            log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {runs[n][-1]:.2f} s" for n in names))
    floor = statistics.median(runs[FLOOR])
    rows = {
        name: {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "max_s": max(values),
            "ratio_to_import_torch": statistics.median(values) / floor,
            "runs_s": values,
        }
        for name, values in runs.items()
    }
    table = Table(title=f"CLI start-up, fresh interpreters, medians of {args.rounds} interleaved rounds")
    for column in ("command", "median s", "min s", "max s", "x import torch"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for name, row in rows.items():
        table.add_row(name, fmt(row["median_s"]), fmt(row["min_s"]), fmt(row["max_s"]), fmt(row["ratio_to_import_torch"]))
    report = {
        **report_header(argv, started),
        "machine": machine_info(os.path.abspath(args.dir)),
        "rounds": args.rounds,
        "commands": {name: command[1:] for name, command in _commands("DIR").items()},
        "results": rows,
    }
    emit_report(table, report, args.json_path)
    return 0
