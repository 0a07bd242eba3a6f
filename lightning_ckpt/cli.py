"""``python -m lightning_ckpt inspect | verify | convert | bench``.

Exit codes: 0 success; 1 the checkpoint is damaged or the operation failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch
from rich.console import Console
from rich.table import Table

from lightning_ckpt.errors import CheckpointError
from lightning_ckpt.io import DEFAULT_MAX_SHARD_SIZE, load_checkpoint, save_checkpoint, verify_checkpoint
from lightning_ckpt.plan import iter_tensors
from lightning_ckpt.reader import read_manifest


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _inspect(path: str, console: Console) -> int:
    if not os.path.isdir(path):
        return _inspect_file(path, console)
    manifest = read_manifest(path)
    created = ", ".join(f"{k} {v}" for k, v in sorted(manifest.created_by.items()))
    console.print(
        f"[bold]{path}[/bold]\nformat v{manifest.format_version} · epoch {manifest.epoch} · step"
        f" {manifest.global_step} · {_human(manifest.total_bytes)} in {len(manifest.files)} files + manifest"
        f"\nwritten by {created}"
    )
    table = Table(title="components")
    for column in ("component", "shards", "tensors", "bytes", "dtypes"):
        table.add_column(column, justify="right" if column in ("shards", "tensors", "bytes") else "left")
    for component, files in manifest.components.items():
        tensors = [t for t in manifest.tensors if t.component == component]
        dtypes = Counter(t.dtype for t in tensors)
        table.add_row(
            component,
            str(len(files)),
            str(len(tensors)),
            _human(sum(manifest.files[f].size for f in files)),
            ", ".join(f"{d}×{n}" for d, n in dtypes.most_common()),
        )
    console.print(table)
    files = Table(title="files")
    for column in ("file", "bytes", manifest.checksum):
        files.add_column(column, justify="right" if column == "bytes" else "left")
    for name, record in sorted(manifest.files.items()):
        files.add_row(name, _human(record.size), record.digest)
    console.print(files)
    return 0


def _inspect_file(path: str, console: Console) -> int:
    checkpoint = load_checkpoint(path, weights_only=True)
    console.print(
        f"[bold]{path}[/bold]: single-file checkpoint · epoch {checkpoint.get('epoch')} · step"
        f" {checkpoint.get('global_step')} · {_human(os.path.getsize(path))}"
    )
    table = Table(title="top-level keys")
    for column in ("key", "tensors", "bytes"):
        table.add_column(column)
    for key, value in checkpoint.items():
        tensors = list(iter_tensors(value))
        table.add_row(str(key), str(len(tensors)), _human(sum(t.numel() * t.element_size() for t in tensors)))
    console.print(table)
    return 0



def _verify(path: str, console: Console) -> int:
    if not os.path.isdir(path):
        load_checkpoint(path, weights_only=True)
        console.print(f"[yellow]{path}: single-file checkpoint: it loads, but it carries no checksums to verify.")
        return 0
    manifest = verify_checkpoint(path)
    console.print(f"[green]OK[/green] {path}: {len(manifest.files)} files + manifest, {_human(manifest.total_bytes)}, all checksums match")
    return 0


def _convert(src: str, dst: str, unsafe: bool, max_shard_size: str, console: Console) -> int:
    if os.path.exists(dst):
        console.print(f"[red]error:[/red] destination {dst!r} exists; choose a new path.")
        return 2
    checkpoint = load_checkpoint(src, weights_only=not unsafe)
    if os.path.isdir(src):
        tmp = f"{dst}.lckpt-convert-{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        console.print(f"wrote single-file checkpoint {dst} ({_human(os.path.getsize(dst))})")
    else:
        result = save_checkpoint(checkpoint, dst, max_shard_size)
        console.print(f"wrote checkpoint directory {dst} ({_human(result.nbytes)} in {result.files} files)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ckpt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("inspect", help="show what a checkpoint holds").add_argument("path")
    commands.add_parser("verify", help="check every file's checksum").add_argument("path")
    convert = commands.add_parser("convert", help="directory <-> single-file .ckpt (the direction follows SRC)")
    convert.add_argument("src")
    convert.add_argument("dst")
    convert.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE)
    convert.add_argument(
        "--unsafe", action="store_true", help="allow arbitrary unpickling (weights_only=False); trusted files only"
    )
    commands.add_parser("bench", help="benchmark against Lightning's CheckpointIO", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from lightning_ckpt.bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    console = Console()
    err = Console(stderr=True)
    try:
        if args.command == "inspect":
            return _inspect(args.path, console)
        if args.command == "verify":
            return _verify(args.path, console)
        return _convert(args.src, args.dst, args.unsafe, args.max_shard_size, console)
    except CheckpointError as error:
        err.print(f"[red]error:[/red] {error}", markup=True, highlight=False)
        file = getattr(error, "file", None)
        if file:
            err.print(f"damaged file: {os.path.join(error.path or '', file)}", highlight=False)
        return 1
    except (OSError, ValueError, RuntimeError) as error:
        err.print(f"[red]error:[/red] {error}", highlight=False)
        return 1
