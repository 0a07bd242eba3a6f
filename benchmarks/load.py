"""``python -m benchmarks --mode load``: what a resume pays to read a checkpoint, against the disk.

Per state size (a "model + AdamW" checkpoint: fp32 weights 1/3, moments 2/3), the checkpoint is
written once in each format, then every measurement runs in a fresh process with the page cache
dropped for the files it reads (``POSIX_FADV_DONTNEED`` after an fsync):

* ``read floor``: our checkpoint's files read once, sequentially, in 16 MiB reads: buffered, and
  ``O_DIRECT`` where the filesystem takes it; the faster is the floor.
* ``ShardedCheckpointIO``: ``load_checkpoint`` with every byte verified (the default), then every
  tensor copied into preallocated parameters and optimizer state (what a resume's
  ``load_state_dict`` costs).
* ``TorchCheckpointIO``: Lightning's ``torch.load`` of its single file, then the same copy.
* ``DCP load in place``: ``torch.distributed.checkpoint.load`` into the preallocated tensors.
* ``safetensors load_file`` of our model shards (the weights alone: a third of the bytes).

Reported: seconds (medians of ``--repeats``), GB/s over the bytes each reads, and each load's
ratio to the read floor of the same bytes (issue 36's target: ours <= 1.2x with every byte
verified); peak extra RSS and anonymous RSS of the process.

``--device cuda``: the preallocated state is on the GPU (a resume into CUDA parameters and
moments); each timed load ends with ``torch.cuda.synchronize()``. ``--contenders`` picks some.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from lightning_ckpt.bench.files import DEFAULT_DIR, drop_page_cache, remove_path, run_directory
from lightning_ckpt.bench.measure import Task, measure, run_in_fresh_process
from lightning_ckpt.bench.report import add_json_argument, emit_report, fmt, machine_info, report_header, stderr_logger
from benchmarks.common.workloads import Restored

READ_CHUNK = 16 * 2**20
CONTENDERS = ("read floor", "ShardedCheckpointIO", "TorchCheckpointIO", "DCP load in place", "safetensors load_file (model)")


def _files(path: str, prefix: str = "") -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.startswith(prefix) and not n.startswith("."))


def _read(files: list[str], direct: bool) -> dict[str, Any]:
    import mmap

    buffer = mmap.mmap(-1, READ_CHUNK)  # page-aligned, as O_DIRECT needs
    total = 0
    for file in files:
        fd = os.open(file, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            while n := os.readv(fd, [buffer]):
                total += n
        finally:
            os.close(fd)
    buffer.close()
    return {"bytes_read": total}


def _run_task(task: Task) -> Any:
    """One measurement, in a fresh process (``measure.run_in_fresh_process``)."""
    kind, path = task["kind"], task["path"]
    if kind == "write":
        return _write(task)
    for file in _files(path):
        drop_page_cache(file)
    if kind in ("floor buffered", "floor direct"):
        read: list[dict[str, Any]] = []
        try:
            result = measure(lambda: read.append(_read(_files(path), kind == "floor direct")))
        except OSError as err:  # a filesystem refusing O_DIRECT: no such row
            return {"error": f"{type(err).__name__}: {err}"}
        return {**result, **read[0]}
    if kind == "safetensors load_file (model)":
        from safetensors.torch import load_file

        files = _files(path, "model")
        files = [f for f in files if f.endswith(".safetensors")]
        result = measure(lambda: [load_file(f) for f in files])
        return {**result, "bytes_read": sum(os.path.getsize(f) for f in files)}
    import torch

    device = task.get("device", "cpu")
    restored = Restored.zeros(task["size_bytes"], device)

    def synchronized(result: Any) -> Any:
        if device != "cpu":
            torch.cuda.synchronize()
        return result

    if kind == "DCP load in place":
        import torch.distributed.checkpoint as dcp

        target = {"state_dict": restored.params, "optimizer": restored.optimizer}
        result = measure(lambda: synchronized(dcp.load(target, checkpoint_id=path)))
        return {**result, "bytes_read": sum(os.path.getsize(f) for f in _files(path))}
    if kind == "TorchCheckpointIO":
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        io: Any = TorchCheckpointIO()
    else:
        from lightning_ckpt import ShardedCheckpointIO

        io = ShardedCheckpointIO()
    copied = []
    result = measure(lambda: synchronized(copied.append(restored.copy_from(io.load_checkpoint(path)))))
    if copied != [restored.tensors]:
        raise RuntimeError(f"copied {copied} tensors, expected {restored.tensors}")
    return {**result, "bytes_read": sum(os.path.getsize(f) for f in _files(path))}


def _write(task: Task) -> Any:
    """The checkpoint in every format the loads read (once per size)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    import lightning_ckpt as lc
    from lightning_ckpt.bench.workloads import build_checkpoint

    checkpoint = build_checkpoint(task["size_bytes"])
    lc.save_checkpoint(checkpoint, task["paths"]["ours"])
    TorchCheckpointIO().save_checkpoint(checkpoint, task["paths"]["torch"])
    optimizer = checkpoint["optimizer_states"][0]["state"]
    dcp.save({"state_dict": checkpoint["state_dict"], "optimizer": optimizer}, checkpoint_id=task["paths"]["dcp"])
    for path in task["paths"].values():
        for file in _files(path):
            fd = os.open(file, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    del checkpoint
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {}


def bench_size(
    label: str, size_bytes: int, repeats: int, folder: str, log: Any, device: str = "cpu", contenders: tuple[str, ...] = CONTENDERS
) -> dict[str, Any]:
    paths = {k: os.path.join(folder, f"{label}-{k}.ckpt") for k in ("ours", "torch", "dcp")}
    log(f"[{label}] writing the checkpoint in each format")
    run_in_fresh_process({"kind": "write", "path": folder, "size_bytes": size_bytes, "paths": paths}, _run_task)
    kinds = {
        "floor buffered": paths["ours"], "floor direct": paths["ours"], "ShardedCheckpointIO": paths["ours"],
        "TorchCheckpointIO": paths["torch"], "DCP load in place": paths["dcp"],
        "safetensors load_file (model)": paths["ours"],
    }  # fmt: skip
    floors = ("floor buffered", "floor direct") if "read floor" in contenders else ()
    kinds = {k: v for k, v in kinds.items() if k in contenders or k in floors}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    errors = []
    try:
        for r in range(repeats):
            for kind, path in kinds.items():  # alternating: each repeat runs every contender once
                log(f"[{label} {r + 1}/{repeats}] {kind}")
                try:
                    task = {"kind": kind, "path": path, "size_bytes": size_bytes, "device": device}
                    runs[kind].append(run_in_fresh_process(task, _run_task))
                except RuntimeError as err:
                    errors.append(f"{kind}: {str(err).splitlines()[0][:300]}")
    finally:
        for path in paths.values():
            remove_path(path)
    return _summarize(label, size_bytes, runs, errors)


def _summarize(label: str, size_bytes: int, runs: dict[str, list[dict[str, Any]]], errors: list[str]) -> dict[str, Any]:
    def median(kind: str, key: str) -> float | None:
        values = [r[key] for r in runs[kind] if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None

    rows = {}
    for kind in runs:
        seconds, nbytes = median(kind, "seconds"), median(kind, "bytes_read")
        rows[kind] = {
            "seconds": seconds, "values": [r.get("seconds") for r in runs[kind]], "bytes_read": nbytes,
            "gbps": nbytes / seconds / 1e9 if seconds and nbytes else None,
            "peak_extra_rss_mb": median(kind, "peak_rss_mb"), "peak_extra_anon_mb": median(kind, "peak_rss_anon_mb"),
            "errors": [r["error"] for r in runs[kind] if "error" in r],
        }  # fmt: skip
    floor_gbps = max((rows[k]["gbps"] for k in ("floor buffered", "floor direct") if k in rows and rows[k]["gbps"]), default=None)
    for row in rows.values():
        # the seconds against what the floor takes for the same bytes
        floor_seconds = row["bytes_read"] / (floor_gbps * 1e9) if floor_gbps and row["bytes_read"] else None
        row["vs_read_floor"] = row["seconds"] / floor_seconds if floor_seconds and row["seconds"] else None
    return {"label": label, "size_bytes": size_bytes, "floor_gbps": floor_gbps, "contenders": rows, "errors": errors}


def render_table(results: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="load, cold page cache (medians; x floor: seconds / the floor's time for the same bytes)")
    for column in ("size", "contender", "seconds", "GB read", "GB/s", "x floor", "peak extra RSS MB", "extra anon MB"):
        table.add_column(column, justify="left" if column in ("size", "contender") else "right")
    for result in results:
        for kind, row in result["contenders"].items():
            table.add_row(
                result["label"], kind, fmt(row["seconds"], 3), fmt((row["bytes_read"] or 0) / 1e9, 3), fmt(row["gbps"], 2),
                fmt(row["vs_read_floor"], 2), fmt(row["peak_extra_rss_mb"], 0), fmt(row["peak_extra_anon_mb"], 0),
            )  # fmt: skip
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks --mode load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1GB", help="state sizes, comma separated (default 1GB)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per contender (default 3)")
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"where the checkpoints are written (default ./{DEFAULT_DIR})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the resumed state lives (default cpu)")
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help=f"comma separated, of: {', '.join(CONTENDERS)} (default all)"
    )
    add_json_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from lightning_ckpt.bench.save import _parse_sizes

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.repeats < 1:
        print(f"--mode load: `--repeats {args.repeats}` must be at least 1.", file=sys.stderr)
        return 2
    contenders = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown or not contenders:
        print(f"--mode load: `--contenders {args.contenders}`: {unknown or 'none'}; choose among {', '.join(CONTENDERS)}.", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--mode load: `--device cuda` needs a CUDA device; torch.cuda.is_available() is False.", file=sys.stderr)
            return 2
    started = time.time()
    log = stderr_logger()
    with run_directory(args.dir) as folder:
        results = [
            bench_size(label, size, args.repeats, folder, log, args.device, contenders)
            for label, size in _parse_sizes(args.sizes)
        ]
        machine = machine_info(folder)
    settings = {k: v for k, v in vars(args).items() if k != "json_path"}
    report = {**report_header(argv, started), "settings": settings, "machine": machine, "results": results}
    emit_report(render_table(results), report, args.json_path)
    return 0
