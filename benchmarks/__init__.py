"""``python -m benchmarks --mode MODE [...]`` (from the repository root): the research benchmark
programs, kept out of the installed package. Each prints a rich table (and, with ``--json``, every
run's values as JSON). ``python -m lightning_ckpt bench --mode MODE`` names them and where they
live: the installed package never imports this folder.

The package ships lean, user-facing ``save`` and ``async`` modes (``lightning_ckpt.bench``); the
``save`` and ``async`` modes here are their research versions (every contender, the disk's floor,
...), built on them. Every mode builds on the package's shared parts (``lightning_ckpt.bench``:
``measure``, ``report``, ``files``, ``workloads``, ``contenders``) and on ``common/`` here (what
only the research modes share: DCP contenders, plain writes, the transformer, the S3 server, ...).
Data flows one way: a mode module imports the shared ones (and a research version its package
mode), never another mode, and nothing imports a mode but :func:`main`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# mode -> (module, one-line description); the order is the order of ``--help``. The keys are
# ``lightning_ckpt.bench.MODES`` (research versions) and ``REPOSITORY_MODES`` (a test keeps them so).
MODES: dict[str, tuple[str, str]] = {
    "save": ("save", "save/load throughput and memory against TorchCheckpointIO and a plain write, the disk's floor"),
    "async": ("async_loop", "a simulated training loop: stall per save, time until durable, memory; Lightning, DCP, ours, the floor"),
    "train": ("train", "a real training loop (decoder-only transformer + AdamW): training time lost per save"),
    "distributed": ("distributed", "N CPU ranks (gloo): FSDP2 and DDP saves and loads against stock DCP"),
    "activations": ("activations", "activation checkpointing: peak activation memory and step time"),
    "fragmentation": ("fragmentation", "CUDA: what emptying the allocator's cache after saves does to the next steps"),
    "release": ("release", "host memory release after saves: its cost on the training thread and what it gives back"),
    "remote": ("remote", "s3:// saves and loads against a local moto S3 server: stall, durable time, upload GB/s, memory"),
    "offload": ("offload", "ChunkedAdamW's optimizer step against torch.optim.AdamW foreach / fused and the memory-bandwidth floor; --save, --strategy, --largest: its async saves, ChunkedOffloadStrategy's step, the largest model under a budget"),
    "compression": ("compression", "zstd on trained weights and AdamW state: ratio and MB/s per component, s3:// saves with and without"),
    "incremental": ("incremental", "LoRA-style and full fine-tunes: bytes written, durable time and async stall per save, incremental saves on and off"),
    "load": ("load", "a resume's load, cold page cache: ours, TorchCheckpointIO, DCP in place, safetensors, against the disk's read floor"),
    "startup": ("startup", "the CLI's start-up (--help, inspect, verify) on a small checkpoint in fresh interpreters, against `import torch`"),
}
_KEEPS_MODE = ("distributed",)  # its parser takes --mode itself; it gets argv unchanged


def build_parser() -> argparse.ArgumentParser:
    """``--mode`` (required), with every mode listed in ``--help``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The research benchmarks of lightning_ckpt (run from the repository root).",
        epilog="Each mode's options: `--mode MODE --help`. The package's own modes: python -m lightning_ckpt bench --help.",
    )
    parser.add_argument(
        "--mode",
        choices=tuple(MODES),
        required=True,
        help="; ".join(f"{name}: {text}" for name, (_, text) in MODES.items()),
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark of ``--mode``; its exit code.

    ``distributed`` gets ``argv`` as given (its parser takes ``--mode``); the other modes get it
    without ``--mode``. Without ``--mode``, ``--help`` lists the modes.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    mode_parser = argparse.ArgumentParser(add_help=False)
    mode_parser.add_argument("--mode", choices=tuple(MODES))
    known, rest = mode_parser.parse_known_args(args)
    if known.mode is None:
        build_parser().parse_args(args)  # prints the modes for --help; an error without --mode
        return 2
    module = importlib.import_module(f"{__name__}.{MODES[known.mode][0]}")
    return int(module.main(args if known.mode in _KEEPS_MODE else rest))
