"""``python -m lightning_ckpt bench --mode save|async [...]``: what a user runs on their own machine to
judge the plugin against Lightning's own IO (a durable save; the stall an async save costs a
training loop): a table of medians over runs in fresh processes, and with ``--json`` every value.

The research harnesses (these modes with DCP and the disk's floor, multi-rank, object storage, ...)
live in the repository's ``benchmarks/`` folder, which builds on the shared parts here (``measure``,
``report``, ``files``, ``workloads``) and on the two modes; the package never imports it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# mode -> (module, one-line description); the order is the order of ``--help``
MODES: dict[str, tuple[str, str]] = {
    "save": ("save", "a durable save, time and memory, against TorchCheckpointIO (default)"),
    "async": ("async_loop", "the stall per save in a training loop and the time until durable, against AsyncCheckpointIO"),
}
# The modes only benchmarks/ has (``benchmarks.MODES``: these and its research versions of MODES).
REPOSITORY_MODES = (
    "train", "distributed", "activations", "fragmentation", "release", "remote", "offload", "compression", "incremental", "load",
    "startup",
)  # fmt: skip
DEFAULT_MODE = "save"
_KEEPS_MODE = ("save",)  # its parser takes --mode itself; it gets argv unchanged


def add_mode_argument(parser: argparse.ArgumentParser) -> None:
    """``--mode``, with every mode listed in ``--help``."""
    parser.add_argument(
        "--mode",
        choices=(*MODES, *REPOSITORY_MODES),
        default=DEFAULT_MODE,
        help="; ".join(f"{name}: {text}" for name, (_, text) in MODES.items())
        + f"; from a checkout of the repository (its benchmarks/ folder): {', '.join(REPOSITORY_MODES)}"
        + " (each mode's options: `--mode MODE --help`)",
    )


def split_mode(argv: list[str]) -> tuple[str, list[str]]:
    """``--mode`` (default ``save``) and the other arguments."""
    mode_parser = argparse.ArgumentParser(add_help=False)
    mode_parser.add_argument("--mode", choices=(*MODES, *REPOSITORY_MODES), default=DEFAULT_MODE)
    known, rest = mode_parser.parse_known_args(argv)
    return known.mode, rest


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark of ``--mode`` (default ``save``; its parser takes ``--mode``, ``async``'s
    does not); a mode of :data:`REPOSITORY_MODES` is named with where it lives (exit code 2)."""
    args = list(sys.argv[1:] if argv is None else argv)
    mode, rest = split_mode(args)
    if mode in REPOSITORY_MODES:
        print(
            f"lightning_ckpt bench: `--mode {mode}` is a research benchmark that is not part of the installed"
            f" package; it lives in the benchmarks/ folder of the lightning-ckpt source repository. Run it in a"
            f" checkout of the repository (after `pip install -e '.[test]'` there):\n"
            f"  python -m benchmarks --mode {mode} [...]   (its options: --help)\n"
            f"(modes shipped with the package: {', '.join(MODES)})",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(f"{__name__}.{MODES[mode][0]}")
    return int(module.main(args if mode in _KEEPS_MODE else rest))
