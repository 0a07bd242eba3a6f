"""Reporting, one way for every mode: the machine, the report header, progress lines, table
number formatting and the ``--json`` convention (:func:`add_json_argument`)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata as importlib_metadata
from typing import Any

import torch

from lightning_ckpt.bench.measure import GB, parse_status


def version(package: str) -> str | None:
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return None


def filesystem_of(path: str) -> dict[str, str] | None:
    """The /proc/mounts entry (longest mount point prefix) holding ``path``."""
    path = os.path.realpath(path)
    best: dict[str, str] | None = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) >= len(best["mount_point"])):
                    best = {"device": parts[0], "mount_point": mount, "type": parts[2], "options": parts[3]}
    except OSError:
        return None
    return best


def machine_info(directory: str, cuda: bool = False) -> dict[str, Any]:
    """CPU, RAM, versions and the filesystem of ``directory``; the GPU too with ``cuda``."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": None,
        "total_ram_gb": None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "lightning": version("lightning"),
        "lightning_ckpt": version("lightning-ckpt"),
        "filesystem": filesystem_of(directory),
        "tmp_filesystem": filesystem_of(tempfile.gettempdir()),
    }
    try:
        with open("/proc/meminfo", "rb") as f:
            info["total_ram_gb"] = parse_status(f.read())["MemTotal"] / GB
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, KeyError, StopIteration):
        pass
    if cuda:
        info["cuda"] = {
            "device": torch.cuda.get_device_name(),
            "torch_cuda": torch.version.cuda,
            "capability": ".".join(map(str, torch.cuda.get_device_capability())),
            "total_memory_gb": torch.cuda.get_device_properties(0).total_memory / GB,
        }
    return info


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def stderr_logger() -> Callable[[str], None]:
    """``log(message)``: a timestamped progress line on stderr."""
    from rich.console import Console

    err_console = Console(stderr=True)

    def log(message: str) -> None:
        err_console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}", highlight=False)

    return log


def report_header(argv: list[str] | None, started: float) -> dict[str, Any]:
    """The command line and timing fields every report starts with."""
    return {
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_seconds": time.time() - started,
    }


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """``--json [PATH]``: the results JSON only when asked for; ``--json`` or ``--json -`` is stdout."""
    parser.add_argument(
        "--json", dest="json_path", nargs="?", const="-", default=None, metavar="PATH",
        help="also write the results JSON (every run's values, the machine, the command) to PATH;"
        " `--json` alone or `--json -` prints it on stdout instead (the table then goes to stderr)",
    )  # fmt: skip


def emit_report(table: Any, report: dict[str, Any], json_path: str | None) -> None:
    """Print the rich table; the JSON only when ``json_path`` asks for it: ``None``, the table alone
    on stdout; ``"-"``, the JSON document alone on stdout (to pipe), the table on stderr; or a file."""
    from rich.console import Console

    to_stdout = json_path == "-"
    console = Console(stderr=to_stdout)
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(stderr=to_stdout, width=170)
    console.print(table)
    if json_path is None:
        return
    text = json.dumps(report, indent=2)
    if to_stdout:
        print(text)
        return
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        f.write(text + "\n")
    Console(stderr=True).print(f"[dim]results JSON written to {json_path}[/dim]", highlight=False)
