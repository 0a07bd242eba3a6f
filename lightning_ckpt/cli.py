"""``python -m lightning_ckpt inspect | verify | convert | export-hf | bench``.

Checkpoints read: lightning_ckpt directories, single files written by ``torch.save`` (Lightning's
default ``.ckpt``) and stock DCP folders written by Lightning's sharded strategies
(``ModelParallelStrategy``, ``FSDPStrategy(state_dict_type="sharded")``).

Every PATH may also be the fsspec URL of a remote lightning_ckpt checkpoint (``s3://bucket/run/x.ckpt``;
see ``remote``), with ``--storage-options JSON`` passed to its filesystem (credentials,
``{"client_kwargs": {"endpoint_url": ...}}``). ``inspect URL`` reads ``CURRENT`` and the manifest
only, no shard; ``verify URL`` streams and hashes every object, storing nothing; ``convert`` takes
a URL on either side (a remote destination is always a checkpoint directory, published as a new
generation). A URL whose fsspec implementation is not installed (``gs://`` without gcsfs) exits 2.

``inspect --json`` prints one JSON document and nothing else on stdout::

    {"path", "format": "lightning_ckpt" | "torch" | "dcp", "format_version", "global_step", "epoch",
     "files": [{"name", "bytes", "rank", "digest"}], "total_bytes",
     "tensors": [{"component", "path", "dtype", "shape", "file", ("chunks")}], ...}

A remote checkpoint's document is a directory's, ``path`` being the URL as given, plus
``"generation"``: the immutable generation folder (under the URL) that ``CURRENT`` names.

``rank`` is the global rank that wrote the file (0 for single-process saves); ``digest`` is
``null`` where the format records none. A tensor stored in pieces (multi-rank saves, DCP) has
its whole ``shape``, ``file`` naming its first piece, and ``chunks``: each piece's ``file``,
``offsets`` and ``shape`` (and, in our format, its ``blob``).

``export-hf CKPT OUT_DIR`` writes the model of a checkpoint as a Hugging Face folder (safetensors
files, their index, ``config.json``) that ``from_pretrained(OUT_DIR)`` loads (see ``export``).

Exit codes: 0 success; 1 the checkpoint is damaged or the operation failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pickle
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lightning_ckpt import remote
from lightning_ckpt.bench import main as bench_main
from lightning_ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    MissingDependencyError,
)
from lightning_ckpt.export import DTYPES, ExportError, export_hf
from lightning_ckpt.format import reader
from lightning_ckpt.format.kind import META_FILE, file_rank, is_dcp_checkpoint
from lightning_ckpt.format.manifest import Manifest
from lightning_ckpt.format.plan import dtype_name, encode_checkpoint
from lightning_ckpt.format.reader import not_found_message, read_manifest
from lightning_ckpt.functional import (
    DEFAULT_MAX_SHARD_SIZE,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

_FORMAT_TORCH = "torch"  # a single file written by torch.save
_FORMAT_DCP = "dcp"  # a stock torch.distributed.checkpoint folder
_CONVERT_TARGETS = ("directory", "file")
_STORAGE_OPTIONS_EXAMPLE = """For example: --storage-options '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}'."""


# Off a terminal nothing bounds a line: wide enough that no table column is cut and no line wraps.
_UNBOUNDED_WIDTH = 100_000


def _console(stderr: bool = False) -> Console:
    """Rich's console for stdout (or stderr). Piped or redirected, rich would fit the output to 80
    columns (or ``COLUMNS``, or the size of a terminal on another stream), cutting file names in the
    tables with "…" and splitting an error's path over two lines: there lines are as long as their
    content, for ``grep`` and ``awk``."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=_UNBOUNDED_WIDTH)


@contextlib.contextmanager
def _progress_bar(description: str) -> Iterator[Callable[[int, int], None] | None]:
    """On a terminal (stderr), a rich progress bar for a long command: bytes done, rate, time left;
    yields its ``progress(done, total)`` callback. Piped or redirected, nothing: ``None``."""
    err = Console(stderr=True)
    if not err.is_terminal:
        yield None
        return
    from rich.progress import (  # here: its import is paid on a terminal only
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def _storage_options(text: str) -> dict[str, Any]:
    """``--storage-options``: a JSON object (argparse reports the option's name with the message)."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}. {_STORAGE_OPTIONS_EXAMPLE}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}. {_STORAGE_OPTIONS_EXAMPLE}")
    return value


def _local(path: str) -> str:
    """A local path as the filesystem calls take it (``file://`` is local: fsspec's own spelling)."""
    return path.removeprefix("file://")


# ----------------------------------------------------------------------------------------------
# Description: one JSON-ready dict per checkpoint, whatever its format


def _describe(path: str, options: remote.RemoteOptions) -> dict[str, Any]:
    if remote.is_remote(path):
        return _describe_remote(path, options)
    path = _local(path)
    if os.path.isdir(path):
        return _describe_dcp(path) if is_dcp_checkpoint(path) else _describe_directory(path)
    return _describe_file(path)


def _describe_remote(url: str, options: remote.RemoteOptions) -> dict[str, Any]:
    committed = remote.read_committed(url, options)  # CURRENT and the manifest: no shard is read
    doc = {**_describe_manifest(url, committed.manifest), "generation": committed.generation}
    for row in doc["files"]:  # how each file is stored: compressed ones at their object's size
        stored = committed.objects.get(row["name"])
        row["encoding"] = None if stored is None else stored["encoding"]
        row["stored_bytes"] = row["bytes"] if stored is None else stored["size"]
    doc["stored_bytes"] = committed.stored_bytes()
    return doc


def _describe_directory(path: str) -> dict[str, Any]:
    return _describe_manifest(path, read_manifest(path))


def _describe_manifest(path: str, manifest: Manifest) -> dict[str, Any]:
    tensors = []
    for t in manifest.tensors:
        row = {"component": t.component, "path": list(t.path), "dtype": t.dtype, "shape": list(t.shape), "file": t.file}
        chunks = getattr(t, "chunks", None)  # multi-rank saves: the pieces of a sharded tensor
        if chunks is not None:
            row["chunks"] = chunks
        tensors.append(row)
    return {
        "path": path,
        "format": manifest.format,
        "format_version": manifest.format_version,
        "global_step": manifest.global_step,
        "epoch": manifest.epoch,
        "files": [
            {"name": name, "bytes": r.size, "rank": 0 if r.rank is None else r.rank, "digest": r.digest}
            for name, r in sorted(manifest.files.items())
        ],
        "tensors": tensors,
        "total_bytes": manifest.total_bytes,
        "checksum": manifest.checksum,
        "components": manifest.components,
        "created_by": manifest.created_by,
    }


def _describe_file(path: str) -> dict[str, Any]:
    checkpoint = load_checkpoint(path, weights_only=True)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path!r} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    name, size = os.path.basename(path), os.path.getsize(path)
    return {
        "path": path,
        "format": _FORMAT_TORCH,
        "format_version": None,
        "global_step": _int_or_none(checkpoint.get("global_step")),
        "epoch": _int_or_none(checkpoint.get("epoch")),
        "files": [{"name": name, "bytes": size, "rank": 0, "digest": None}],
        "tensors": _tensor_rows(checkpoint, lambda key_path: {"file": name}),
        "total_bytes": size,
        "keys": [str(k) for k in checkpoint],
    }


def _describe_dcp(path: str) -> dict[str, Any]:
    from lightning_ckpt.format.legacy import read_layout  # DCP's modules for DCP folders alone (format/kind.py)

    layout = read_layout(path)  # metadata and meta.pt only: no tensor data is read

    def where(key_path: tuple[Any, ...]) -> dict[str, Any]:
        chunks = layout.chunks.get(key_path)
        if chunks is None:
            return {"file": META_FILE}
        return {
            "file": chunks[0].file if chunks else None,
            "chunks": [{"file": c.file, "offsets": list(c.offsets), "shape": list(c.shape)} for c in chunks],
        }

    files = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_file(follow_symlinks=False):
            size = entry.stat(follow_symlinks=False).st_size
            files.append({"name": entry.name, "bytes": size, "rank": file_rank(entry.name), "digest": None})
    checkpoint = layout.checkpoint
    return {
        "path": path,
        "format": _FORMAT_DCP,
        "format_version": layout.version,
        "global_step": _int_or_none(checkpoint.get("global_step")),
        "epoch": _int_or_none(checkpoint.get("epoch")),
        "files": files,
        "tensors": _tensor_rows(checkpoint, where),
        "total_bytes": sum(f["bytes"] for f in files),
        "keys": [str(k) for k in checkpoint],
        "lightning": layout.has_meta,  # meta.pt present: saved by a Lightning strategy
    }


def _tensor_rows(
    checkpoint: dict[Any, Any], where: Callable[[tuple[Any, ...]], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every tensor of a checkpoint dict, by component as lightning_ckpt's format splits it;
    ``where(key_path)`` says which file (and chunks) hold it."""
    _, found = encode_checkpoint(checkpoint, stores=lambda t: True)
    return [
        {
            "component": component,
            "path": list(key_path),
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            **where(key_path),
        }
        for t, component, key_path in found
    ]


def _json_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)  # a key that JSON has no type for (tuples are lists already)


# ----------------------------------------------------------------------------------------------
# Commands


def _inspect(path: str, options: remote.RemoteOptions, console: Console, as_json: bool) -> int:
    doc = _describe(path, options)
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=1, default=_json_value) + "\n")
        return 0
    step, epoch, total, count = doc["global_step"], doc["epoch"], _human(doc["total_bytes"]), len(doc["files"])
    if doc["format"] == _FORMAT_DCP:
        version = f" v{doc['format_version']}" if doc["format_version"] else ""
        console.print(
            f"[bold]{escape(path)}[/bold]\nstock DCP checkpoint (torch.distributed.checkpoint{version}) · epoch {epoch}"
            f" · step {step} · {total} in {count} files\nno checksums: `python -m lightning_ckpt convert {path} DST` makes a"
            " checksummed lightning_ckpt checkpoint of it"
        )
    elif doc["format"] == _FORMAT_TORCH:
        console.print(f"[bold]{escape(path)}[/bold]\nsingle-file checkpoint · epoch {epoch} · step {step} · {total}")
    else:
        created = ", ".join(f"{k} {v}" for k, v in sorted(doc["created_by"].items()))
        where = f"remote checkpoint, generation {doc['generation']} · " if "generation" in doc else ""
        if doc.get("stored_bytes", doc["total_bytes"]) != doc["total_bytes"]:
            ratio = doc["total_bytes"] / max(doc["stored_bytes"], 1)
            total += f" (stored {_human(doc['stored_bytes'])} compressed, {ratio:.2f}x)"
        console.print(
            f"[bold]{escape(path)}[/bold]\n{where}format v{doc['format_version']} · epoch {epoch} · step {step} · {total} in"
            f" {count} files + manifest\nwritten by {created}"
        )
    if "keys" in doc:
        console.print(f"keys: {', '.join(doc['keys'])}", highlight=False)
    console.print(_components_table(doc))
    if doc["format"] != _FORMAT_TORCH:
        console.print(_files_table(doc))
    return 0


def _components_table(doc: dict[str, Any]) -> Table:
    sizes = {f["name"]: f["bytes"] for f in doc["files"]}
    by_component: dict[str, list[dict[str, Any]]] = {c: [] for c in doc.get("components", {})}
    for t in doc["tensors"]:
        by_component.setdefault(t["component"], []).append(t)
    table = Table(title="components")
    for column in ("component", "files", "tensors", "bytes", "dtypes"):
        table.add_column(column, justify="right" if column in ("files", "tensors", "bytes") else "left")
    for component, tensors in by_component.items():
        if "components" in doc:  # lightning_ckpt: a component is its shard files
            files = doc["components"][component]
            nbytes = sum(sizes[f] for f in files)
        else:
            files = {c["file"] for t in tensors for c in t.get("chunks", [t])}
            nbytes = sum(_tensor_bytes(t) for t in tensors)
        dtypes = Counter(t["dtype"] for t in tensors)
        mix = ", ".join(f"{d}×{n}" for d, n in dtypes.most_common())
        table.add_row(component, str(len(files)), str(len(tensors)), _human(nbytes), mix)
    return table


def _tensor_bytes(row: dict[str, Any]) -> int:
    n = 1
    for size in row["shape"]:
        n *= size
    return n * torch.empty((), dtype=getattr(torch, row["dtype"])).element_size()


def _files_table(doc: dict[str, Any]) -> Table:
    digests = any(f["digest"] is not None for f in doc["files"])
    ranks = doc["format"] == _FORMAT_DCP or any(f["rank"] for f in doc["files"])
    table = Table(title="files")
    table.add_column("file")
    table.add_column("bytes", justify="right")
    if ranks:
        table.add_column("rank", justify="right")
    encoded = any(f.get("encoding") for f in doc["files"])
    if encoded:
        for column in ("stored", "ratio"):
            table.add_column(column, justify="right")
    if digests:
        table.add_column(doc.get("checksum", "digest"))
    for f in doc["files"]:
        row = [f["name"], _human(f["bytes"])]
        if encoded:
            ratio = f"{f['bytes'] / max(f['stored_bytes'], 1):.2f}x {f['encoding']}" if f.get("encoding") else ""
            row += [_human(f["stored_bytes"]), ratio]
        row += [str(f["rank"])] if ranks else []
        row += [f["digest"] or ""] if digests else []
        table.add_row(*row)
    return table


def _verify(path: str, options: remote.RemoteOptions, console: Console) -> int:
    if remote.is_remote(path):
        manifest = verify_checkpoint(path, storage_options=dict(options.storage_options))
        console.print(
            f"[green]OK[/green] {escape(path)}: {len(manifest.files)} objects + manifest, {_human(manifest.total_bytes)},"
            " all checksums match",
            soft_wrap=True,  # one line, whatever the URL's length: it is grepped for
        )
        return 0
    path = _local(path)
    if not os.path.exists(path):  # a load's message would suggest resuming, which verify does not do
        raise CheckpointNotFoundError(not_found_message(path, resume_hint=False), path)
    if not os.path.isdir(path) or is_dcp_checkpoint(path):
        load_checkpoint(path, weights_only=True)
        kind = "stock DCP checkpoint" if os.path.isdir(path) else "single-file checkpoint"
        console.print(f"[yellow]{escape(path)}: {kind}: it loads, but it carries no checksums to verify.")
        return 0
    with _progress_bar(f"verify {os.path.basename(os.path.normpath(path))}") as progress:
        manifest = reader.verify(path, progress)
    console.print(
        f"[green]OK[/green] {escape(path)}: {len(manifest.files)} files + manifest, {_human(manifest.total_bytes)}, all checksums match",
        soft_wrap=True,
    )
    return 0


def _convert(
    src: str, dst: str, unsafe: bool, max_shard_size: str, to: str | None, options: remote.RemoteOptions, console: Console
) -> int:
    remote_src, remote_dst = remote.is_remote(src), remote.is_remote(dst)
    src = src if remote_src else _local(src)
    dst = dst if remote_dst else _local(dst)
    if remote_dst and to == "file":
        console.print(
            f"[red]error:[/red] --to file: a remote destination ({escape(repr(dst))}) is always a lightning_ckpt checkpoint"
            " directory (published as a new generation). Drop --to, or convert to a local file.",
            highlight=False,
        )
        return 2
    if _exists(dst, options):  # before loading: a missing fsspec implementation fails here, fast
        console.print(f"[red]error:[/red] destination {escape(repr(dst))} exists; choose a new path.", highlight=False)
        return 2
    if to is None:  # the other form: our directories become files, files and DCP folders directories
        ours = remote_src or (os.path.isdir(src) and not is_dcp_checkpoint(src))
        to = "file" if ours and not remote_dst else "directory"
    checkpoint = load_checkpoint(src, weights_only=not unsafe, storage_options=dict(options.storage_options))
    if to == "file":
        tmp = f"{dst}.lckpt-convert-{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        console.print(f"wrote single-file checkpoint {dst} ({_human(os.path.getsize(dst))})", highlight=False, soft_wrap=True)
    elif remote_dst:
        result = save_checkpoint(checkpoint, dst, max_shard_size, storage_options=dict(options.storage_options))
        console.print(
            f"published remote checkpoint {dst} ({_human(result.nbytes)} in {result.files} files)",
            highlight=False,
            soft_wrap=True,
        )
    else:
        result = save_checkpoint(checkpoint, dst, max_shard_size)
        console.print(f"wrote checkpoint directory {dst} ({_human(result.nbytes)} in {result.files} files)", soft_wrap=True)
    return 0


def _export_hf(args: argparse.Namespace, options: remote.RemoteOptions, console: Console) -> int:
    src = args.src if remote.is_remote(args.src) else _local(args.src)
    result = export_hf(
        src, _local(args.out_dir), prefix=args.prefix, dtype=args.dtype, config=args.config,
        max_shard_size=args.max_shard_size, weights_only=not args.unsafe_load,
        storage_options=dict(options.storage_options),
    )  # fmt: skip
    tied = f", tied stored once: {', '.join(result['dropped_tied'])}" if result["dropped_tied"] else ""
    console.print(
        f"wrote {escape(args.out_dir)}: {result['tensors']} tensors, {_human(result['bytes'])} in"
        f" {', '.join(result['files'])} + config.json (prefix {result['prefix']!r} stripped{tied})",
        highlight=False, soft_wrap=True,
    )  # fmt: skip
    return 0


def _exists(path: str, options: remote.RemoteOptions) -> bool:
    """Anything at ``path``: for a URL, any object under it (a checkpoint of ours or not)."""
    if not remote.is_remote(path):
        return os.path.exists(path)
    fs, root = options.filesystem(path)
    return bool(fs.exists(root))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_ckpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    with_urls = argparse.ArgumentParser(add_help=False)
    with_urls.add_argument(
        "--storage-options",
        type=_storage_options,
        default={},
        metavar="JSON",
        help="a JSON object passed to the fsspec filesystem of every URL argument (credentials, endpoint_url ...)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="show what a checkpoint holds", parents=[with_urls])
    inspect.add_argument("path", help="a checkpoint path or fsspec URL")
    inspect.add_argument("--json", action="store_true", help="print one machine-readable JSON document")
    verify = commands.add_parser("verify", help="check every file's checksum", parents=[with_urls])
    verify.add_argument("path", help="a checkpoint path or fsspec URL")
    convert = commands.add_parser(
        "convert",
        help="between a lightning_ckpt directory and a single-file .ckpt; a stock DCP folder to either; to or from a URL",
        parents=[with_urls],
    )
    convert.add_argument("src", help="a checkpoint path or fsspec URL")
    convert.add_argument("dst", help="a new path, or an fsspec URL with nothing under it")
    convert.add_argument(
        "--to",
        choices=_CONVERT_TARGETS,
        default=None,
        help="what DST becomes (default: a directory from a file or DCP folder, a file from a directory;"
        " always a directory at a URL)",
    )
    convert.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE)
    convert.add_argument(
        "--unsafe", action="store_true", help="allow arbitrary unpickling (weights_only=False); trusted files only"
    )
    export = commands.add_parser(
        "export-hf", help="write the model as a Hugging Face folder (safetensors, config.json)", parents=[with_urls]
    )
    export.add_argument("src", help="a checkpoint path or fsspec URL")
    export.add_argument("out_dir", help="the folder to write (created)")
    export.add_argument(
        "--prefix", default="auto", help="the LightningModule attribute holding the model (default: auto; '' for none)"
    )
    export.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="cast floating weights (default: as saved)")
    export.add_argument("--config", default=None, help="a config.json or its folder (default: from hyper_parameters)")
    export.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file (default 5GB)")
    export.add_argument(
        "--unsafe-load", action="store_true", help="allow unpickling (a PretrainedConfig in hyper_parameters); trusted files only"
    )
    commands.add_parser("bench", help="benchmark against Lightning's CheckpointIO", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    options = remote.RemoteOptions(storage_options=args.storage_options)
    console = _console()
    err = _console(stderr=True)
    try:
        if args.command == "inspect":
            return _inspect(args.path, options, console, args.json)
        if args.command == "verify":
            return _verify(args.path, options, console)
        if args.command == "export-hf":
            return _export_hf(args, options, console)
        return _convert(args.src, args.dst, args.unsafe, args.max_shard_size, args.to, options, console)
    except (MissingDependencyError, ExportError) as error:  # a package to install, a config or prefix to name: usage
        err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        return 2
    except CheckpointError as error:
        err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        file = getattr(error, "file", None)
        if file and error.path is not None and remote.is_remote(error.path):
            # The object lies in a generation folder under the URL, which the error does not carry.
            err.print(f"damaged object: {file} (of {error.path})", highlight=False)
        elif file:
            err.print(f"damaged file: {os.path.join(error.path or '', file)}", highlight=False)
        return 1
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as error:
        err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        return 1
    except Exception as error:
        # Object-store clients raise their own types (botocore's NoCredentialsError and
        # EndpointConnectionError, TypeError for an option the client does not take): with a URL
        # argument these are the user's setup, not a bug of ours, so no traceback. Without one, raise.
        given = (getattr(args, "path", None), getattr(args, "src", None), getattr(args, "dst", None))
        urls = [p for p in given if p is not None and remote.is_remote(p)]
        if not urls:
            raise
        err.print(f"[red]error:[/red] {type(error).__name__}: {escape(str(error))}", highlight=False)
        err.print(
            f"HINT: raised by the fsspec filesystem of {escape(' and '.join(urls))}: check the URL, the credentials, and"
            " --storage-options (passed to that filesystem as keyword arguments).",
            highlight=False,
        )
        return 1
