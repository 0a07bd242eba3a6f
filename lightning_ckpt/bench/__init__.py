"""``python -m lightning_ckpt bench --mode MODE [...]``: benchmark programs that print a rich table
(and, with ``--json``, every run's values as JSON).

One module per mode; the shared parts are kept apart, and data flows one way (a mode module
imports the shared ones, never another mode, and nothing imports a mode but :func:`main`):

* ``measure``: fresh measurement processes, timing, RSS / memory readings, medians, p95, ratios;
* ``report``: machine description, report header, the ``--json`` convention, table formatting;
* ``files``: the run folder, fsync, removal, page-cache dropping;
* ``_plain_writer``: plain sequential writes (standard library only, as it is also the
  ``disk_floor`` helper process);
* ``workloads``: the synthetic checkpoint dict, the simulated step, the decoder-only transformer,
  and the byte-for-byte comparison of a loaded checkpoint with the saved one;
* ``s3``: the local S3-compatible server (moto, on 127.0.0.1) and the environment pointing at it;
* ``contenders``: Lightning ``TorchCheckpointIO`` / ``AsyncCheckpointIO``, DCP ``async_save`` and
  ``ShardedCheckpointIO`` as a training loop drives them (``--mode async`` and ``--mode train``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# mode -> (module, one-line description); the order is the order of ``--help``
MODES: dict[str, tuple[str, str]] = {
    "save": ("save", "save/load throughput and memory against TorchCheckpointIO and a plain write (default)"),
    "async": ("async_loop", "stalls of a simulated training loop per save, time until durable, memory"),
    "train": ("train", "a real training loop (decoder-only transformer + AdamW): training time lost per save"),
    "distributed": ("distributed", "N CPU ranks (gloo): FSDP2 and DDP saves and loads against stock DCP"),
    "activations": ("activations", "activation checkpointing: peak activation memory and step time"),
    "fragmentation": ("fragmentation", "CUDA: what emptying the allocator's cache after saves does to the next steps"),
    "release": ("release", "host memory release after saves: its cost on the training thread and what it gives back"),
    "remote": ("remote", "s3:// saves and loads against a local moto S3 server: stall, durable time, upload GB/s, memory"),
    "offload": ("offload", "ChunkedAdamW's optimizer step against torch.optim.AdamW foreach / fused and the memory-bandwidth floor"),
    "compression": ("compression", "zstd on trained weights and AdamW state: ratio and MB/s per component, s3:// saves with and without"),
}
DEFAULT_MODE = "save"
_KEEPS_MODE = ("save", "distributed")  # their parsers take --mode themselves; they get argv unchanged


def add_mode_argument(parser: argparse.ArgumentParser) -> None:
    """``--mode``, with every mode listed in ``--help``."""
    parser.add_argument(
        "--mode",
        choices=tuple(MODES),
        default=DEFAULT_MODE,
        help="; ".join(f"{name}: {text}" for name, (_, text) in MODES.items())
        + " (each mode's options: `--mode MODE --help`)",
    )


def split_mode(argv: list[str]) -> tuple[str, list[str]]:
    """``--mode`` (default ``save``) and the other arguments."""
    mode_parser = argparse.ArgumentParser(add_help=False)
    mode_parser.add_argument("--mode", choices=tuple(MODES), default=DEFAULT_MODE)
    known, rest = mode_parser.parse_known_args(argv)
    return known.mode, rest


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark of ``--mode`` (default ``save``); its exit code.

    ``save`` and ``distributed`` get ``argv`` as given (their parsers take ``--mode``); the other
    modes get it without ``--mode``.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    mode, rest = split_mode(args)
    module = importlib.import_module(f"{__name__}.{MODES[mode][0]}")
    return int(module.main(args if mode in _KEEPS_MODE else rest))
