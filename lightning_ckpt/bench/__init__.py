"""``python -m lightning_ckpt bench --mode MODE [...]``: the benchmarks a user runs on their own
machine to judge the plugin (save/load throughput, async saves in a training loop); each prints a
rich table (and, with ``--json``, every run's values as JSON).

The research harnesses (multi-rank, object storage, compression, a real training loop, ...) are
not shipped in the package: they live in the repository's ``benchmarks/`` folder and run from a
checkout with ``python -m benchmarks --mode MODE``. ``--mode`` with one of
:data:`REPOSITORY_MODES` says so (the installed package never imports the repository's code).

One module per mode; the shared parts are kept apart, and data flows one way (a mode module
imports the shared ones, never another mode, and nothing imports a mode but :func:`main`). The
shared parts are also what ``benchmarks/`` builds on:

* ``measure``: fresh measurement processes, timing, RSS / memory readings, medians, p95, ratios;
* ``report``: machine description, report header, the ``--json`` convention, table formatting;
* ``files``: the run folder, fsync, removal, page-cache dropping;
* ``_plain_writer``: plain sequential writes (standard library only, as it is also the
  ``disk_floor`` helper process);
* ``workloads``: the synthetic checkpoint dict, the simulated step, the decoder-only transformer,
  and the byte-for-byte comparison of a loaded checkpoint with the saved one;
* ``contenders``: Lightning ``TorchCheckpointIO`` / ``AsyncCheckpointIO``, DCP ``async_save`` and
  ``ShardedCheckpointIO`` as a training loop drives them (``--mode async``, and ``train`` in
  ``benchmarks/``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# mode -> (module, one-line description); the order is the order of ``--help``
MODES: dict[str, tuple[str, str]] = {
    "save": ("save", "save/load throughput and memory against TorchCheckpointIO and a plain write (default)"),
    "async": ("async_loop", "stalls of a simulated training loop per save, time until durable, memory"),
}
# The modes of the repository's benchmarks/ folder (``benchmarks.MODES`` describes them).
REPOSITORY_MODES: tuple[str, ...] = (
    "train",
    "distributed",
    "activations",
    "fragmentation",
    "release",
    "remote",
    "offload",
    "compression",
    "incremental",
    "load",
)
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
    """Run the benchmark of ``--mode`` (default ``save``); its exit code.

    ``save`` gets ``argv`` as given (its parser takes ``--mode``); ``async`` gets it without
    ``--mode``; a mode of :data:`REPOSITORY_MODES` is named with where it lives (exit code 2).
    """
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
