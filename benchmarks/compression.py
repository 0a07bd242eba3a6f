"""``bench --mode compression``: what zstd does to real checkpoint state, and whether it pays.

``python -m benchmarks --mode compression [--params 75M] [--steps 20] [--levels 1,3]
[--repeats 3] [--json PATH]``.

The state is real, not random tensors: a decoder-only transformer (``workloads.Decoder``) trains
for ``--steps`` steps on the CPU with AdamW (fp32 weights and moments) on synthetic tokens with a
learnable rule (each sequence walks a fixed random permutation of the vocabulary: the next token
is a function of the current one; starts are random). Its *components*, each measured as one
shard file holds it (the tensors' bytes back to back, in state-dict order):

* ``model_fp32``: the weights (fp32 master weights);
* ``model_bf16``: a bf16 copy of the weights (what a bf16 model or export holds);
* ``exp_avg`` / ``exp_avg_sq``: AdamW's first and second moments (in a checkpoint, both sit in
  the ``optimizer`` files: they are split here to see which one compresses);
* ``step``: AdamW's 0-d step counters (a few hundred bytes; in a checkpoint, inside the
  ``optimizer`` files).

Per component and zstd level (``--levels``), through the shipping code (``remote.transfer.encoder`` /
``remote.transfer.decoded``: one zstd frame with its content checksum, one thread): the bytes
are fed in ``remote.transfer.PIECE`` pieces, as ``_upload_s3`` reads them from the local file, and the
compressed object is read back in ``upload_part_size`` reads (64 MiB) and decompressed in pieces, as ``_download`` does.
Only the compressor and decompressor calls are timed (the reads, copies and hashing around them
are not); both throughputs are in *uncompressed* MB per second. Every round trip is checked:
the decompressed bytes' digest against the original's. **x at LINK**: the time to ship the
component through one upload stream with zstd over without it, on a link of ``--link`` bytes per
second, taking compression and sending as overlapped (``max(raw / compress, stored / link) /
(raw / link)``): below 1 compression pays on such a link, above 1 the compressor is the
bottleneck. The same for downloads with the decompressor.

**End to end** (unless ``--no-end-to-end``): the whole checkpoint (the ``Trainer.dump_checkpoint``
dict plus the bf16 copy as its own top-level key ``model_bf16``) saved through
``ShardedCheckpointIO()`` and ``ShardedCheckpointIO(compression="zstd",
compression_level=--e2e-level)`` to ``s3://`` on a local moto S3 server (``bench.remote``'s
``s3_server``), and loaded back by a plain ``ShardedCheckpointIO()``: stored bytes (every object
under the checkpoint's URL, ``CURRENT`` included; checked against the sizes ``CURRENT`` records),
save seconds (a synchronous save: spooled to local disk, then uploaded) and load seconds
(downloaded, decompressed, every file hashed, loaded). Each load is compared byte for byte with
the saved state, and the compressed checkpoint's load with the uncompressed one's. moto is a
single Python process on the same cores, so these seconds say more about moto than about S3.

Everything runs in one fresh process (``measure.run_in_fresh_process``; the server beside it); medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.common.arguments import parse_count
from benchmarks.common.workloads import (
    Decoder,
    DecoderConfig,
    decoder_config,
    lightning_checkpoint,
)
from lightning_ckpt.bench.files import DEFAULT_DIR, run_directory
from lightning_ckpt.bench.measure import (
    GB,
    MB,
    Metrics,
    Task,
    m,
    run_in_fresh_process,
    summarize,
)
from lightning_ckpt.bench.report import (
    add_json_argument,
    emit_report,
    fmt,
    machine_info,
    report_header,
    stderr_logger,
)

COMPONENTS = ("model_fp32", "model_bf16", "exp_avg", "exp_avg_sq", "step")
TITLES = {
    "model_fp32": "model weights fp32",
    "model_bf16": "model weights bf16",
    "exp_avg": "optimizer exp_avg",
    "exp_avg_sq": "optimizer exp_avg_sq",
    "step": "optimizer step counters",
}
VARIANTS = ("plain", "zstd")  # end to end: ShardedCheckpointIO without and with compression
DEFAULTS = {"params": "75M", "vocab": 4096, "batch": 4, "seq": 64, "steps": 20, "levels": "1,3", "link": "1GB"}
LEARNING_RATE = 1e-3
BUCKET = "lightning-ckpt-bench-compression"


# ----------------------------------------------------------------------------------------------
# Child side: the state


def _tokens(order: torch.Tensor, batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` sequences of ``seq + 1`` tokens, each a walk along ``order`` (a permutation of the
    vocabulary) from a random start: the next token is a function of the current one."""
    starts = torch.randint(0, len(order), (batch, 1), generator=generator)
    return order[(starts + torch.arange(seq + 1)) % len(order)]


def _train(task: Task) -> tuple[Decoder, torch.optim.AdamW, list[float]]:
    """The model and optimizer after ``task["steps"]`` AdamW steps; the loss of each step."""
    torch.manual_seed(0)
    config = DecoderConfig(**task["config"])
    model = Decoder(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    order = torch.randperm(config.vocab, generator=generator)
    losses = []
    for _ in range(task["steps"]):
        tokens = _tokens(order, task["batch"], task["seq"], generator)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, optimizer, losses


def components(model: torch.nn.Module, optimizer: torch.optim.Optimizer, bf16: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """The tensors of each of :data:`COMPONENTS`, in state-dict order."""
    state = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"] if p in optimizer.state]
    return {
        "model_fp32": list(model.state_dict().values()),
        "model_bf16": list(bf16.values()),
        "exp_avg": [s["exp_avg"] for s in state],
        "exp_avg_sq": [s["exp_avg_sq"] for s in state],
        "step": [s["step"] for s in state],
    }


def _raw(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def pieces(tensors: list[torch.Tensor], size: int) -> Iterator[bytes]:
    """The tensors' bytes back to back (as a shard file holds them), ``size`` bytes at a time, each
    piece a new ``bytes`` object, as ``os.pread`` hands them to the uploader."""
    pending = bytearray()
    for tensor in tensors:
        view = _raw(tensor)
        offset = 0
        while offset < len(view):
            take = min(size - len(pending), len(view) - offset)
            pending += view[offset : offset + take]
            offset += take
            if len(pending) == size:
                yield bytes(pending)
                pending.clear()
    if pending:
        yield bytes(pending)


def round_trip(tensors: list[torch.Tensor], level: int) -> Metrics:
    """Compress ``tensors`` as the uploader does, decompress as the downloader does; sizes, the
    seconds of the codec calls alone, and whether the bytes came back."""
    from lightning_ckpt.format import manifest as fmt
    from lightning_ckpt.remote import transfer

    feed, finish = transfer.encoder("zstd", level)
    original, stored = fmt.hasher(), bytearray()
    raw = 0
    compress_s = 0.0
    for piece in pieces(tensors, transfer.PIECE):
        original.update(piece)
        raw += len(piece)
        start = time.perf_counter()
        encoded = feed(piece)
        compress_s += time.perf_counter() - start
        stored += encoded
    start = time.perf_counter()
    tail = finish()
    compress_s += time.perf_counter() - start
    stored += tail

    restored = fmt.hasher()
    size = 0
    decompress_s = 0.0
    decoded = transfer.decoded(io.BytesIO(bytes(stored)), "zstd", transfer.DEFAULT_PART_SIZE)  # as a download reads the object
    while True:
        start = time.perf_counter()
        data = next(decoded, b"")
        decompress_s += time.perf_counter() - start
        if not data:
            break
        restored.update(data)
        size += len(data)
    return {
        "raw_bytes": raw,
        "compressed_bytes": len(stored),
        "ratio": raw / len(stored),
        "compress_s": compress_s,
        "decompress_s": decompress_s,
        "compress_MBps": raw / compress_s / MB,
        "decompress_MBps": raw / decompress_s / MB,
        "round_trip_exact": size == raw and restored.hexdigest() == original.hexdigest(),
    }


def _describe(tensors: list[torch.Tensor]) -> Metrics:
    numel = sum(t.numel() for t in tensors)
    zeros = sum(int((t == 0).sum()) for t in tensors)
    return {
        "tensors": len(tensors),
        "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
        "elements": numel,
        "zero_fraction": zeros / numel if numel else None,
    }


# ----------------------------------------------------------------------------------------------
# Child side: end to end through ShardedCheckpointIO and a local S3 server


def _end_to_end(task: Task, checkpoint: dict[str, Any], repeat: int, reference: dict[str, Any]) -> dict[str, Metrics]:
    """Each of :data:`VARIANTS` saved to and loaded from ``s3://`` once; ``reference`` keeps the
    plain variant's loaded checkpoint (first repeat) to compare the compressed one's with."""
    import fsspec

    from lightning_ckpt import ShardedCheckpointIO, remote
    from benchmarks.common.workloads import mismatches

    fs = fsspec.filesystem("s3")
    warm = {"state_dict": {"w": torch.ones(16)}, "global_step": 0}
    results: dict[str, Metrics] = {}
    for variant in VARIANTS:
        prefix = f"{BUCKET}/r{repeat}/{variant}"
        url = f"s3://{prefix}/x.ckpt"
        options = {} if variant == "plain" else {"compression": "zstd", "compression_level": task["e2e_level"]}
        io = ShardedCheckpointIO(**options)
        try:
            io.save_checkpoint(warm, f"s3://{prefix}/warm.ckpt")  # imports, connections: paid once per run
            os.sync()  # no writeback of an earlier save competes with this one
            start = time.perf_counter()
            io.save_checkpoint(checkpoint, url)
            save_s = time.perf_counter() - start
        finally:
            io.teardown()
        committed = remote.read_committed(url, io.remote)
        fs.invalidate_cache(prefix)
        listed = fs.du(f"{prefix}/x.ckpt", total=True)
        current = len(fs.cat_file(f"{prefix}/x.ckpt/{remote.CURRENT_FILE}"))
        os.sync()
        start = time.perf_counter()
        loaded = ShardedCheckpointIO().load_checkpoint(url)
        load_s = time.perf_counter() - start
        problems = mismatches(checkpoint, loaded)
        result: Metrics = {
            "stored_bytes": listed,
            "recorded_bytes": committed.stored_bytes() + current,
            "raw_bytes": sum(r.size for r in committed.manifest.files.values()) + len(committed.manifest_bytes) + current,
            "save_s": save_s,
            "load_s": load_s,
            "bit_exact": not problems,
            "mismatches": problems,
        }
        result["ratio"] = result["raw_bytes"] / listed
        if variant == "plain" and not reference:
            reference["loaded"] = loaded
        elif variant != "plain" and "loaded" in reference:
            result["equals_plain"] = not mismatches(reference["loaded"], loaded)
        if repeat == 0:
            result["files"] = {
                name: {"bytes": r.size, "stored_bytes": committed.objects.get(name, {}).get("size", r.size)}
                for name, r in sorted(committed.manifest.files.items())
            }
        results[variant] = result
        del loaded
        fs.rm(prefix, recursive=True)  # moto holds objects in memory
    return results


def _run(task: Task) -> Metrics:
    """Runner of :func:`run_in_fresh_process`: train, then every measurement of every repeat."""
    import tempfile

    if task["threads"]:
        torch.set_num_threads(task["threads"])
    tempfile.tempdir = task["run_dir"]  # the spool and download folders of the end-to-end saves
    log = stderr_logger()
    start = time.perf_counter()
    model, optimizer, losses = _train(task)
    train_s = time.perf_counter() - start
    log(f"trained {task['steps']} steps in {train_s:.1f} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.eval()
    bf16 = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
    parts = components(model, optimizer, bf16)
    runs: dict[str, dict[str, list[Metrics]]] = {c: {str(level): [] for level in task["levels"]} for c in COMPONENTS}
    end_to_end: dict[str, list[Metrics]] = {v: [] for v in VARIANTS}
    checkpoint = {**lightning_checkpoint(model, optimizer, task["steps"]), "model_bf16": bf16}
    reference: dict[str, Any] = {}
    for repeat in range(task["repeats"]):
        for name in COMPONENTS:
            for level in task["levels"]:
                run = round_trip(parts[name], level)
                runs[name][str(level)].append(run)
                log(
                    f"repeat {repeat + 1}/{task['repeats']} {name} level {level}: ratio {run['ratio']:.3f},"
                    f" {run['compress_MBps']:.0f} / {run['decompress_MBps']:.0f} MB/s"
                )
        if task["end_to_end"]:
            for variant, result in _end_to_end(task, checkpoint, repeat, reference).items():
                end_to_end[variant].append(result)
                log(
                    f"repeat {repeat + 1}/{task['repeats']} end to end {variant}: {result['stored_bytes'] / MB:.1f} MB stored,"
                    f" save {result['save_s']:.2f} s, load {result['load_s']:.2f} s"
                )
    return {
        "train_s": train_s,
        "losses": losses,
        "components": {name: {**_describe(parts[name]), "runs": runs[name]} for name in COMPONENTS},
        "end_to_end": end_to_end if task["end_to_end"] else None,
    }


# ----------------------------------------------------------------------------------------------
# Parent side


def link_factor(raw_bytes: float, stored_bytes: float, codec_MBps: float | None, link_Bps: float) -> float | None:
    """Time to ship ``raw_bytes`` through one stream with the codec (overlapped with the transfer
    of ``stored_bytes``) over the time without it, on a link of ``link_Bps``; below 1 it pays."""
    if not codec_MBps or not raw_bytes:
        return None
    with_codec = max(raw_bytes / (codec_MBps * MB), stored_bytes / link_Bps)
    return with_codec / (raw_bytes / link_Bps)


def summarize_components(out: Metrics, link_Bps: float) -> Metrics:
    """Per component: its description and, per level, the medians over the repeats."""
    result: Metrics = {}
    for name, entry in out["components"].items():
        levels = {}
        for level, runs in entry["runs"].items():
            summary = summarize(runs)
            assert summary is not None  # every repeat measures every level
            summary["round_trip_exact"] = all(run["round_trip_exact"] for run in runs)
            raw, stored = m(summary, "raw_bytes") or 0.0, m(summary, "compressed_bytes") or 0.0
            summary["upload_x_at_link"] = link_factor(raw, stored, m(summary, "compress_MBps"), link_Bps)
            summary["download_x_at_link"] = link_factor(raw, stored, m(summary, "decompress_MBps"), link_Bps)
            levels[level] = summary
        result[name] = {k: v for k, v in entry.items() if k != "runs"} | {"levels": levels}
    return result


def summarize_end_to_end(out: Metrics) -> tuple[Metrics | None, list[str]]:
    """Medians per variant, and what went wrong (a load that differs, sizes that disagree)."""
    if out["end_to_end"] is None:
        return None, []
    result: Metrics = {}
    errors: list[str] = []
    for variant, runs in out["end_to_end"].items():
        summary = summarize([{k: v for k, v in run.items() if k not in ("mismatches", "files")} for run in runs])
        assert summary is not None
        summary["bit_exact"] = all(run["bit_exact"] for run in runs)
        summary["mismatches"] = [p for run in runs for p in run["mismatches"]]
        summary["files"] = runs[0]["files"]
        if variant != "plain":
            summary["equals_plain"] = all(run.get("equals_plain", False) for run in runs if "equals_plain" in run)
            if not summary["equals_plain"]:
                errors.append(f"end to end {variant}: the loaded checkpoint differs from the uncompressed one's")
        if not summary["bit_exact"]:
            errors.append(f"end to end {variant}: the loaded checkpoint differs from the saved state: {summary['mismatches'][:5]}")
        for run in runs:
            if run["stored_bytes"] != run["recorded_bytes"]:
                errors.append(
                    f"end to end {variant}: {run['stored_bytes']} bytes stored under the URL, CURRENT and the manifest"
                    f" account for {run['recorded_bytes']}"
                )
        result[variant] = summary
    return result, errors


def render_table(report: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table

    settings, results = report["settings"], report["results"]
    model = settings["model"]
    link = settings["link_bytes_per_s"]
    losses = results["losses"]
    table = Table(
        title=(
            f"zstd on real checkpoint state: {model['parameters'] / 1e6:.3g}M-parameter decoder ({model['layers']} x"
            f" {model['width']}, vocab {model['vocab']}) after {settings['steps']} AdamW steps (loss {losses[0]:.2f} ->"
            f" {losses[-1]:.2f}); one thread, medians of {settings['repeats']}"
        ),
        caption=(
            "ratio = raw / compressed; MB/s of uncompressed bytes through the codec calls alone (remote.transfer.encoder /"
            f" decoded); x {link / GB:g} GB/s = one stream's time with zstd / without, compression and transfer"
            " overlapped (< 1: it pays); zeros = exactly-zero elements"
        ),
    )
    columns = ("component", "dtype", "zeros %", "level", "raw MB", "stored MB", "ratio", "compress MB/s",
               "decompress MB/s", f"up x {link / GB:g} GB/s", f"down x {link / GB:g} GB/s", "exact")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column == "component" else "right", no_wrap=column == "component")
    for name in COMPONENTS:
        entry = results["components"][name]
        for i, (level, summary) in enumerate(entry["levels"].items()):
            zeros = entry["zero_fraction"]
            table.add_row(
                TITLES[name] if i == 0 else "",
                entry["dtype"] if i == 0 else "",
                ("-" if zeros is None else f"{100 * zeros:.2f}") if i == 0 else "",
                level,
                fmt((m(summary, "raw_bytes") or 0) / MB, 1 if name != "step" else 6),
                fmt((m(summary, "compressed_bytes") or 0) / MB, 1 if name != "step" else 6),
                fmt(m(summary, "ratio"), 3),
                fmt(m(summary, "compress_MBps"), 0 if name != "step" else 2),
                fmt(m(summary, "decompress_MBps"), 0 if name != "step" else 2),
                fmt(summary["upload_x_at_link"]),
                fmt(summary["download_x_at_link"]),
                "yes" if summary["round_trip_exact"] else "NO",
            )
    e2e = results["end_to_end"]
    if e2e is None:
        return table
    whole = Table(
        title=f"the whole checkpoint through ShardedCheckpointIO to s3:// (local moto server), medians of {settings['repeats']}",
        caption="stored = every object under the URL (CURRENT included); save = synchronous (spool to local disk, upload);"
        " load = download, decompress, hash, load; exact = equal to the saved state byte for byte",
    )
    for column in ("checkpoint", "raw MB", "stored MB", "ratio", "save s", "load s", "exact", "= plain"):
        whole.add_column(column, justify="left" if column == "checkpoint" else "right", no_wrap=column == "checkpoint")
    for variant, summary in e2e.items():
        title = "uncompressed" if variant == "plain" else f'compression="zstd", level {settings["e2e_level"]}'
        whole.add_row(
            title,
            fmt((m(summary, "raw_bytes") or 0) / MB, 1),
            fmt((m(summary, "stored_bytes") or 0) / MB, 1),
            fmt(m(summary, "ratio"), 3),
            fmt(m(summary, "save_s"), 2),
            fmt(m(summary, "load_s"), 2),
            "yes" if summary["bit_exact"] else "NO",
            "-" if variant == "plain" else "yes" if summary["equals_plain"] else "NO",
        )
    return Group(table, whole)


def parse_levels(text: str) -> tuple[int, ...]:
    """``"1,3"`` -> ``(1, 3)``; ``ValueError`` naming ``--levels`` unless each is an int from 1 to 22."""
    try:
        levels = tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        raise ValueError(f"--levels {text!r}: give zstd levels as a comma list, e.g. 1,3") from None
    if not levels or any(not 1 <= level <= 22 for level in levels):
        raise ValueError(f"--levels {text!r}: each level must be from 1 to 22")
    return levels


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks --mode compression",
        description="zstd on the state of a briefly trained decoder (weights fp32 and bf16, AdamW moments, step"
        " counters) through the remote-checkpoint codec: ratio, compress and decompress MB/s per component and"
        " level; and the whole checkpoint saved with and without compression to a local moto S3 server.",
    )
    parser.add_argument("--params", default=DEFAULTS["params"], help=f"model size in parameters (default {DEFAULTS['params']})")
    parser.add_argument("--vocab", type=int, default=DEFAULTS["vocab"], help=f"vocabulary (default {DEFAULTS['vocab']})")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help=f"sequences per step (default {DEFAULTS['batch']})")
    parser.add_argument("--seq", type=int, default=DEFAULTS["seq"], help=f"tokens per sequence (default {DEFAULTS['seq']})")
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"], help=f"AdamW steps before measuring (default {DEFAULTS['steps']})")
    parser.add_argument("--levels", default=DEFAULTS["levels"], help=f"zstd levels, comma list (default {DEFAULTS['levels']})")
    parser.add_argument("--e2e-level", type=int, default=3, help="compression_level of the end-to-end save (default 3, the plugin's)")
    parser.add_argument("--no-end-to-end", dest="end_to_end", action="store_false", help="skip the s3:// saves (no moto, s3fs needed)")
    parser.add_argument("--link", default=DEFAULTS["link"], help=f"link speed per second for the x columns (default {DEFAULTS['link']})")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per component and level, medians reported (default 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads for training (default: torch's choice)")
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"spool and download folders go here (default ./{DEFAULT_DIR})")
    add_json_argument(parser)
    return parser


def missing_packages(end_to_end: bool) -> list[str]:
    """What this mode needs and is not installed."""
    needed = ("zstandard", "s3fs", "moto") if end_to_end else ("zstandard",)
    return [name for name in needed if importlib.util.find_spec(name) is None]


def bench(task: Task, end_to_end: bool, log: Callable[[str], None]) -> Metrics:
    """The measurement process of ``task`` (with the S3 server around it when ``end_to_end``)."""
    from benchmarks.common.measure import environment
    from benchmarks.common.s3 import s3_environment, s3_server

    if not end_to_end:
        return run_in_fresh_process(task, _run)
    log("starting the moto S3 server")
    with s3_server(os.path.join(task["run_dir"], "moto.log")) as endpoint, environment(s3_environment(endpoint)):
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
        log(f"S3 server at {endpoint}, bucket {BUCKET!r}")
        return run_in_fresh_process(task, _run)


def main(argv: list[str] | None = None) -> int:
    """Run ``--mode compression``; print the tables (and the JSON with ``--json``). Returns 0, 1 if
    the measurement failed or a round trip was not exact, 2 if it could not run."""
    from lightning_ckpt.format.plan import parse_size

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        params = parse_count(args.params, "--params")
        levels = parse_levels(args.levels)
        link = parse_size(args.link, "--link")
    except ValueError as err:
        parser.error(str(err))
    for option in ("vocab", "batch", "seq", "steps", "repeats"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    if not 1 <= args.e2e_level <= 22:
        parser.error("--e2e-level must be from 1 to 22")
    if link < 1:
        parser.error("--link must be at least 1 byte per second")
    log = stderr_logger()
    if missing := missing_packages(args.end_to_end):
        log(f"bench --mode compression needs {' and '.join(missing)}: pip install 'lightning-ckpt[zstd,test]'"
            + ("" if "zstandard" in missing else " (or pass --no-end-to-end)"))  # fmt: skip
        return 2
    config = decoder_config(params, args.vocab)
    model = {"vocab": config.vocab, "width": config.width, "layers": config.layers, "heads": config.heads, "tied": config.tied}
    log(
        f"decoder {config.parameters() / 1e6:.1f}M parameters ({config.layers} x {config.width}, vocab {config.vocab}),"
        f" {args.steps} AdamW steps of {args.batch} x {args.seq} tokens, then zstd levels {', '.join(map(str, levels))}"
    )
    directory = os.path.abspath(args.dir)
    started = time.time()
    with run_directory(directory) as run_dir:
        machine = machine_info(run_dir)
        task: Task = {
            "kind": "compression", "config": model, "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "levels": levels, "repeats": args.repeats, "threads": args.threads, "end_to_end": args.end_to_end,
            "e2e_level": args.e2e_level, "run_dir": run_dir,
        }  # fmt: skip
        try:
            out = bench(task, args.end_to_end, log)
        except RuntimeError as err:
            log(f"FAILED: {err}")
            return 1
    end_to_end, errors = summarize_end_to_end(out)
    per_component = summarize_components(out, link)
    for name, entry in per_component.items():
        errors += [f"{name} level {level}: the round trip changed the bytes" for level, s in entry["levels"].items() if not s["round_trip_exact"]]
    results = {
        "train_s": out["train_s"],
        "losses": out["losses"],
        "components": per_component,
        "end_to_end": end_to_end,
        "errors": errors,
    }
    from rich.markup import escape

    from lightning_ckpt.bench.report import version

    report = {
        **report_header(argv, started),
        "settings": {
            "mode": "compression",
            "model": {**model, "parameters": config.parameters()},
            "optimizer": f"AdamW(lr={LEARNING_RATE}, weight_decay=0.1), fp32 weights and moments",
            "data": "walks along a fixed random permutation of the vocabulary from random starts",
            "batch": args.batch,
            "seq": args.seq,
            "steps": args.steps,
            "levels": list(levels),
            "repeats": args.repeats,
            "threads": args.threads,
            "end_to_end": args.end_to_end,
            "e2e_level": args.e2e_level,
            "link_bytes_per_s": link,
            "zstandard": version("zstandard"),
            "codec": "lightning_ckpt.remote.transfer.encoder / decoded (one zstd frame with content checksum, one thread);"
            " fed remote.transfer.PIECE bytes per call to compress, upload_part_size (64 MiB) per call to decompress",
            "units": "MB = 1e6 bytes; MB/s = uncompressed bytes / seconds in the codec calls",
            "dir": directory,
        },
        "machine": machine,
        "results": results,
    }
    if args.end_to_end:
        report["settings"]["server"] = {"implementation": "moto.server", "moto": version("moto"), "s3fs": version("s3fs"), "host": "127.0.0.1"}
    emit_report(render_table(report), report, args.json_path)
    for error in errors:
        log(f"[red]{escape(error)}[/red]")
    return 1 if errors else 0
