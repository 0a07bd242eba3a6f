"""``bench --mode offload``: the optimizer step of ``ChunkedAdamW`` against ``torch.optim.AdamW``.

CPU rows (``--device cpu``, the default): optimizer step throughput in parameters/s on the same
state (fp32 parameters of ``--params`` elements in tensors of ``--tensor-size``, gradients set
once) for ``ChunkedAdamW`` (``overlap=False``: the step as the worker runs it, with the
write-back), ``torch.optim.AdamW`` foreach and fused, and the host memory-bandwidth floor: the
28 bytes per parameter an AdamW step must move (read parameter, gradient and both moments, write
parameter and both moments) at the bandwidth of a ``copy_`` between two preallocated buffers.

Strategy rows (``--strategy``, CPU): whole training steps (forward, backward, ``ChunkedAdamW``
step) of the linear stack of ``--layers`` x ``--width`` on ``--batch`` rows, with the parameters
streamed by ``ChunkedOffloadStrategy``'s machinery (hooks, slot copies, waits; one chunk per
layer, a device budget of ``--budget-fraction`` of the parameter bytes) against the same model
fully resident: the strategy's overhead per step.

Save rows (``--save``; ``--device cuda`` too): an async ``ShardedCheckpointIO`` save of the
linear stack of ``--layers`` x ``--width`` (a plain torch loop, no Trainer) after a training step,
with ``torch.optim.AdamW`` (fused) and with ``ChunkedAdamW``: the stall (the ``save_checkpoint``
call, pool and writer warm), the durable time, the bytes the call copied into the staging pool on
the training thread, the device-to-host bytes of optimizer state, and the bytes ``ChunkedAdamW``'s
arena copied into the pool itself (in the background, or copy-on-write by the next steps, which
run while the save is written).

GPU strategy rows (``--strategy --device cuda``): whole training steps of a decoder (``--layers``
pre-norm blocks of ``--width``, ``--heads``, ``--vocab``; bf16 parameters; each block recomputed in
backward) on ``--sequences`` x ``--seq-len`` tokens, for the model resident on the GPU (with
``ChunkedAdamW``; an out-of-memory error where it does not fit), FSDP2 ``CPUOffloadPolicy`` on one
rank (``torch.optim.AdamW`` on the host) and ``ChunkedOffloadStrategy``'s streamer under
``--budget`` (one unit per block, ``ChunkedAdamW``): step time, tokens/s, the allocator's peak,
the strategy's plan and copied bytes, and the step time against the resident model.

Largest-model rows (``--largest``; ``--device cuda`` too): the deepest decoder (the GPU strategy
rows' decoder: ``--width``, ``--heads``, ``--vocab``; depth grown) that trains on ``--sequences``
x ``--seq-len`` tokens under ``--budget``: depths 1, 2, 4, ... until one fails (or
``--max-layers``), then bisected. Each depth is a real ``Trainer`` fit of 1 + ``--steps`` steps
(``ChunkedAdamW``): with ``ChunkedOffloadStrategy`` (one unit per block, the model built on the
meta device), and resident (on CUDA no strategy, the model on the GPU; on the CPU the strategy
with every chunk resident, for its byte accounting: parameters and saved activations). A depth
trains if it raises no budget or out-of-memory error and its peak device bytes (CUDA: the
allocator's ``max_memory_allocated`` since the size was built, after ``empty_cache`` and
``reset_peak_memory_stats``; CPU: the strategy's ``memory_stats()``) stay within the budget. A
depth whose host memory (estimated at ``HOST_BYTES_PER_PARAM`` per parameter) exceeds
``--max-host-gb`` is not tried. Per contender: the largest depth, its parameters, step time (one
run per depth: ``--repeats`` does not apply) and peak, and the next depth with why it failed;
every depth tried in the JSON.

GPU rows (``--device cuda``): whole training steps (forward and backward under bf16 autocast,
optimizer step) of a stack of ``--layers`` linear layers of ``--width`` on ``--batch`` rows, for
AdamW on the GPU (fused), ``ChunkedAdamW``, FSDP2 ``fully_shard(offload_policy=CPUOffloadPolicy())``
on one rank, and torchao's ``CPUOffloadOptimizer`` when torchao is importable: step time, peak
device memory, host RSS and page-locked bytes. Medians of ``--repeats`` runs of ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common.arguments import parse_count
from lightning_ckpt.bench.measure import median, proc_status
from lightning_ckpt.bench.report import (
    add_json_argument,
    emit_report,
    fmt,
    machine_info,
    report_header,
    version,
)

STEP_BYTES_PER_PARAM = 28  # AdamW: read p, g, m, v; write p, m, v (fp32)
# --largest: host bytes per parameter a size is estimated to need (bf16 chunk and gradient,
# ChunkedAdamW's fp32 master, moments and gradient buffer, slack), and the default cap's share of
# the available host memory
HOST_BYTES_PER_PARAM = 24
HOST_MARGIN = 0.8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks --mode offload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="64M", help="parameters in the state (e.g. 64M, 1B)")
    parser.add_argument("--tensor-size", default="4M", help="elements per parameter tensor")
    parser.add_argument("--chunk-size", default="64MiB", help="ChunkedAdamW's chunk_size")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender (medians are reported)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--width", type=int, default=4096, help="--device cuda: layer width")
    parser.add_argument("--layers", type=int, default=16, help="--device cuda: linear layers")
    parser.add_argument("--batch", type=int, default=8192, help="--device cuda: rows per step")
    parser.add_argument("--strategy", action="store_true", help="ChunkedOffloadStrategy's rows: overhead per step (CPU), the decoder under a budget (--device cuda)")
    parser.add_argument("--budget", default="8GB", help="--strategy --device cuda: device_memory_budget")
    parser.add_argument("--sequences", type=int, default=8, help="--strategy --device cuda: sequences per step")
    parser.add_argument("--seq-len", type=int, default=2048, help="--strategy --device cuda: tokens per sequence")
    parser.add_argument("--vocab", type=int, default=32000, help="--strategy --device cuda: vocabulary")
    parser.add_argument("--heads", type=int, default=32, help="--strategy --device cuda: attention heads")
    parser.add_argument("--budget-fraction", type=float, default=0.34, help="--strategy: device budget / parameter bytes")
    parser.add_argument("--prefetch", type=int, default=2, help="--strategy: units fetched ahead")
    parser.add_argument("--largest", action="store_true", help="the largest decoder (--width, --heads, --seq-len, --sequences; depth grown) that trains under --budget, streamed and resident")
    parser.add_argument("--max-layers", type=int, default=1024, help="--largest: the deepest decoder tried")
    parser.add_argument("--max-host-gb", type=float, default=None, help=f"--largest: host memory a size may need (estimated at {HOST_BYTES_PER_PARAM} B/param); default {HOST_MARGIN:.0%}% of the available")
    parser.add_argument("--save", action="store_true", help="rows of an async checkpoint save with ChunkedAdamW vs AdamW")
    parser.add_argument("--fsdp2", action="store_true", help="ChunkedAdamW on FSDP2 shards vs fused AdamW (and CPUOffloadPolicy, torchao on CUDA): --ranks CPU ranks or one GPU (--width, --layers, --batch)")
    parser.add_argument("--ddp", action="store_true", help="ChunkedAdamW under DDP (chunks sharded across ranks; updated values over gloo, and over NCCL on GPUs) vs fused AdamW: --ranks CPU ranks or GPUs (--width, --layers, --batch)")
    parser.add_argument("--ranks", type=int, default=2, help="--fsdp2: CPU ranks (gloo); 1 with --device cuda. --ddp: CPU ranks, or GPUs (at least 2) with --device cuda")
    add_json_argument(parser)
    return parser


def _params(total: int, tensor: int, device: str) -> list[Any]:
    import torch

    sizes = [tensor] * (total // tensor) + ([total % tensor] if total % tensor else [])
    gen = torch.Generator().manual_seed(0)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=gen).to(device))
        p.grad = torch.randn(n, generator=gen).to(device) * 1e-3
        params.append(p)
    return params


def _time_steps(step: Callable[[], None], steps: int, sync: Callable[[], None]) -> float:
    step()  # the first step allocates the state: not timed
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def _contenders(chunk_size: str) -> dict[str, Callable[[list[Any]], Any]]:
    import torch

    from lightning_ckpt import ChunkedAdamW

    return {
        "ChunkedAdamW": lambda ps: ChunkedAdamW(ps, chunk_size=chunk_size, overlap=False),
        "AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True),
        "AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
    }


def stream_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes/s an in-place streaming update moves on this host: ``a.add_(b)`` over two
    preallocated fp32 buffers of ``nbytes`` reads ``a`` and ``b`` and writes ``a`` back, the access
    pattern of an AdamW step (every array it writes it has just read). A plain ``copy_`` into a
    second buffer would understate it: its destination is read for ownership before it is
    written, a third stream the byte count does not see (measured here: 34 GB/s counted for
    ``copy_`` against 53 GB/s for ``add_``)."""
    import torch

    a = torch.ones(nbytes // 4)
    b = torch.full_like(a, 1e-9)
    a.add_(b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - start)
    return 3 * nbytes / (median(times) or float("inf"))


def _fsdp2_offload(model: Any, modules: list[Any]) -> Any:
    """``fully_shard(offload_policy=CPUOffloadPolicy())`` on each of ``modules`` (the root last), in
    a one-rank NCCL process group made here once."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    if not dist.is_initialized():
        path = os.path.join(os.getcwd(), ".bench-offload-store")
        if os.path.exists(path):  # a FileStore left over from an earlier run would be joined
            os.remove(path)
        store = dist.FileStore(path, 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    for module in modules:
        fully_shard(module, offload_policy=CPUOffloadPolicy())
    return model


def _gpu_contenders(chunk_size: str) -> dict[str, Callable[[Any], tuple[Any, Any]]]:
    """name -> (model on the GPU) -> (model to train, optimizer)."""
    import torch

    from lightning_ckpt import ChunkedAdamW

    def fsdp2(model: Any) -> tuple[Any, Any]:
        model = _fsdp2_offload(model, [*(m for m in model if isinstance(m, torch.nn.Linear)), model])
        return model, torch.optim.AdamW(model.parameters())

    contenders = {
        "AdamW on the GPU (fused)": lambda model: (model, torch.optim.AdamW(model.parameters(), fused=True)),
        "ChunkedAdamW": lambda model: (model, ChunkedAdamW(model.parameters(), chunk_size=chunk_size)),
        "FSDP2 CPUOffloadPolicy": fsdp2,
    }
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        return contenders

    contenders[f"torchao CPUOffloadOptimizer {version('torchao')}"] = lambda model: (
        model, CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True)
    )
    return contenders


def run_gpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Training steps of a linear stack under bf16 autocast, per contender (see the module doc)."""
    import torch

    rows = []
    for name, make in _gpu_contenders(args.chunk_size).items():
        seconds, peaks, rss, pinned = [], [], [], []
        for _ in range(args.repeats):
            torch.manual_seed(0)
            layers: list[torch.nn.Module] = []
            for _ in range(args.layers):
                layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
            model, optimizer = make(torch.nn.Sequential(*layers).cuda())
            x = torch.randn(args.batch, args.width, device="cuda")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

            def step() -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()

            step()  # state allocated
            seconds.append(_time_steps(step, args.steps, torch.cuda.synchronize))
            peaks.append(torch.cuda.max_memory_allocated())
            rss.append(proc_status().get("VmRSS", 0))
            pinned.append(getattr(optimizer, "pinned_bytes", None))
            del model, optimizer, x
            torch.cuda.empty_cache()
        params = args.layers * (args.width * args.width + args.width)
        step_s = median(seconds)
        rows.append({
            "contender": name,
            "params": params,
            "step_seconds": seconds,
            "median_step_seconds": step_s,
            "params_per_second": params / step_s if step_s else None,
            "peak_device_bytes": median(peaks),
            "device_bytes_per_param": (median(peaks) or 0) / params,
            "host_rss_bytes": median(rss),
            "pinned_bytes": pinned[-1],
        })
    return rows


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The CPU rows: the optimizer step alone, per contender, and the bandwidth floor."""
    total = parse_count(args.params, "--params")
    tensor = parse_count(args.tensor_size, "--tensor-size")
    rows = []
    for name, make in _contenders(args.chunk_size).items():
        seconds = []
        for _ in range(args.repeats):
            params = _params(total, tensor, "cpu")
            optimizer = make(params)
            seconds.append(_time_steps(optimizer.step, args.steps, lambda: None))
            del optimizer, params
        step_s = median(seconds)
        rows.append({
            "contender": name,
            "step_seconds": seconds,
            "median_step_seconds": step_s,
            "params_per_second": total / step_s if step_s else None,
        })
    bandwidth = stream_bandwidth(min(total * 4, 1 << 30), max(3, args.repeats))
    floor_s = total * STEP_BYTES_PER_PARAM / bandwidth
    rows.append({
        "contender": "bandwidth floor",
        "stream_bytes_per_second": bandwidth,
        "median_step_seconds": floor_s,
        "params_per_second": total / floor_s,
    })
    floor = rows[-1]["params_per_second"]
    foreach = next(r["params_per_second"] for r in rows if r["contender"] == "AdamW foreach")
    for row in rows:
        row["vs_floor"] = row["params_per_second"] / floor if row["params_per_second"] else None
        row["vs_foreach"] = row["params_per_second"] / foreach if row["params_per_second"] and foreach else None
    return rows


def run_strategy(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The strategy rows: training steps with parameters streamed under a budget vs resident."""
    from contextlib import nullcontext

    import torch

    from lightning_ckpt import ChunkedAdamW
    from lightning_ckpt.offload.placement import OffloadBudgetError
    from lightning_ckpt.offload.streamer import Streamer
    from lightning_ckpt.offload.streams import HostStreams

    layer_bytes = (args.width * args.width + args.width) * 4 + 128  # one chunk per layer (aligned)
    rows = []
    for name in ("resident (no strategy)", "ChunkedOffloadStrategy"):
        seconds, stats = [], None
        for _ in range(args.repeats):
            torch.manual_seed(0)
            layers: list[torch.nn.Module] = []
            for _ in range(args.layers):
                layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
            model = torch.nn.Sequential(*layers)
            x = torch.randn(args.batch, args.width)
            streamer = None
            if name == "ChunkedOffloadStrategy":
                units = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
                budget = int(sum(p.numel() * 4 for p in model.parameters()) * args.budget_fraction)
                try:
                    streamer = Streamer(
                        units, list(model.parameters()), layer_bytes, budget, args.prefetch, torch.device("cpu"), HostStreams()
                    )
                except OffloadBudgetError as exc:
                    rows.append({"contender": name, "error": str(exc)})
                    break
            optimizer = ChunkedAdamW(model.parameters(), chunk_size=args.chunk_size)
            if streamer is not None:
                streamer.optimizers = [optimizer]

            def step() -> None:
                hooks = torch.autograd.graph.saved_tensors_hooks(streamer.pack_saved, streamer.unpack_saved) if streamer else nullcontext()
                with hooks:
                    loss = model(x).pow(2).mean()
                loss.backward()
                if streamer is not None:
                    streamer.end_backward()
                optimizer.step()
                optimizer.zero_grad()

            step()  # the warm-up step (traced plan) is not timed
            seconds.append(_time_steps(step, args.steps, optimizer.wait))
            stats = {"optimizer_host_bytes": optimizer.host_bytes}  # its arena: master weights (if any) and moments
            if streamer is not None:
                stats.update(streamer.stats())
                streamer.close()
        else:
            rows.append({"contender": name, "step_seconds": seconds, "median_step_seconds": median(seconds), **(stats or {})})
    resident = rows[0].get("median_step_seconds")
    for row in rows:
        if row.get("median_step_seconds") and resident:
            row["vs_resident"] = row["median_step_seconds"] / resident
    return rows


@functools.cache
def _decoder_classes() -> tuple[type, type]:
    """``(Block, Decoder)``: a pre-norm block (attention, 4x MLP) and the decoder of such blocks,
    each recomputed in backward (activation checkpointing); defined once (``unit_types`` names
    ``Block``)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self, width: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
            self.out = torch.nn.Linear(width, width, bias=False)
            self.up = torch.nn.Linear(width, 4 * width, bias=False)
            self.down = torch.nn.Linear(4 * width, width, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, width = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, width // self.heads).transpose(1, 3).unbind(2)
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(attention.transpose(1, 2).reshape(b, t, width))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class Decoder(torch.nn.Module):
        def __init__(self, vocab: int, width: int, heads: int, layers: int) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
            self.norm = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return self.head(self.norm(x))

    return Block, Decoder


def _decoder(args: argparse.Namespace, layers: int | None = None) -> Any:
    """A decoder of ``layers`` (default ``--layers``) pre-norm blocks of ``--width``, ``--heads``,
    ``--vocab``, bf16 parameters, built under the current default device (the CPU, or meta)."""
    import torch

    _, decoder = _decoder_classes()
    torch.manual_seed(0)
    return decoder(args.vocab, args.width, args.heads, args.layers if layers is None else layers).to(torch.bfloat16)


def _decoder_params(args: argparse.Namespace, layers: int) -> int:
    """Parameters of ``_decoder(args, layers)``: 12 w² + 4 w per block, 2 v w + 2 w besides."""
    width = args.width
    return layers * (12 * width * width + 4 * width) + 2 * args.vocab * width + 2 * width


def _units(model: Any) -> list[tuple[str, Any]]:
    """The decoder's units: the embedding, each block, the final norm, the head."""
    return [(name, m) for name, m in model.named_modules() if name in ("embed", "norm", "head") or name.count(".") == 1]


def run_strategy_gpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    """GPU strategy rows: training steps of the decoder (see the module doc), per contender."""
    import gc
    from contextlib import nullcontext

    import torch
    import torch.nn.functional as F

    from lightning_ckpt import ChunkedAdamW
    from lightning_ckpt.format.plan import parse_size
    from lightning_ckpt.offload.placement import OffloadBudgetError
    from lightning_ckpt.offload.streamer import Streamer
    from lightning_ckpt.offload.streams import CudaStreams

    device = torch.device("cuda", torch.cuda.current_device())
    budget = parse_size(args.budget, "--budget")
    tokens_per_step = args.sequences * args.seq_len
    rows = []
    for name in ("resident (no strategy)", "FSDP2 CPUOffloadPolicy", "ChunkedOffloadStrategy"):
        seconds, peaks, stats, error = [], [], None, None
        for _ in range(args.repeats):
            model = _decoder(args)
            params = sum(p.numel() for p in model.parameters())
            streamer = None
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()  # the peak counts from here, every contender alike
            try:
                if name == "ChunkedOffloadStrategy":  # the decoder has no buffers to move
                    streams = CudaStreams(device)
                    streams.reset_peak()  # as the strategy's setup does: the plan's own measurement
                    streamer = Streamer(_units(model), list(model.parameters()), parse_size(args.chunk_size, "--chunk-size"),
                                        budget, args.prefetch, device, streams)
                    optimizer: Any = ChunkedAdamW(model.parameters(), chunk_size=args.chunk_size)
                    streamer.optimizers = [optimizer]
                elif name == "FSDP2 CPUOffloadPolicy":
                    model = _fsdp2_offload(model.to(device), [*model.blocks, model])
                    optimizer = torch.optim.AdamW(model.parameters())
                else:
                    model = model.to(device)
                    optimizer = ChunkedAdamW(model.parameters(), chunk_size=args.chunk_size)
                gen = torch.Generator(device=device).manual_seed(0)
                tokens = torch.randint(0, args.vocab, (args.sequences, args.seq_len + 1), device=device, generator=gen)
                torch.cuda.synchronize()

                def step() -> None:
                    hooks = nullcontext()
                    if streamer is not None:
                        streamer.refresh_unhooked()
                        hooks = torch.autograd.graph.saved_tensors_hooks(streamer.pack_saved, streamer.unpack_saved)
                    with hooks:
                        logits = model(tokens[:, :-1])
                        loss = F.cross_entropy(logits.float().view(-1, args.vocab), tokens[:, 1:].reshape(-1))
                    if streamer is not None:
                        streamer.begin_backward()
                    loss.backward()
                    if streamer is not None:
                        streamer.end_backward()
                    optimizer.step()
                    optimizer.zero_grad()

                step()  # the warm-up (the strategy's traced plan, state allocated) is not timed
                seconds.append(_time_steps(step, args.steps, torch.cuda.synchronize))
                peaks.append(torch.cuda.max_memory_allocated() - base)
                if streamer is not None:
                    stats = streamer.stats()
            except (OffloadBudgetError, torch.OutOfMemoryError) as exc:
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            finally:
                if streamer is not None:
                    streamer.close()
                model = optimizer = streamer = None  # the optimizer's arena goes with it
                gc.collect()
                torch.cuda.empty_cache()
            if error:
                break
        row: dict[str, Any] = {"contender": name, "params": params, "tokens_per_step": tokens_per_step}
        if error:
            row["error"] = error
        else:
            step_s = median(seconds)
            row.update({
                "step_seconds": seconds,
                "median_step_seconds": step_s,
                "tokens_per_second": tokens_per_step / step_s if step_s else None,
                "peak_device_bytes": median(peaks),
                "parameter_bytes": 2 * params,
                **({k: v for k, v in stats.items() if k != "peak_device_bytes"} if stats else {}),
            })
        rows.append(row)
    resident = rows[0].get("median_step_seconds")
    for row in rows:
        if row.get("median_step_seconds") and resident:
            row["vs_resident"] = row["median_step_seconds"] / resident
    return rows


def default_max_host_gb() -> float:
    """``HOST_MARGIN`` of the host memory available now (``MemAvailable``), in GB."""
    from benchmarks.common.measure import meminfo

    available = meminfo().get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available * HOST_MARGIN / 1e9


def _does_not_fit(exc: BaseException) -> str | None:
    """Why a size failed if ``exc`` (or what caused it: ``ChunkedAdamW``'s worker errors wrap
    theirs) means it does not fit: the budget (the strategy's plan, naming the unit) or device
    memory; ``None`` for any other error."""
    import torch

    from lightning_ckpt.offload.placement import OffloadBudgetError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OffloadBudgetError):
            return f"OffloadBudgetError: {str(seen).split(' Raise `device_memory_budget`')[0]}"
        if isinstance(seen, torch.OutOfMemoryError) or (isinstance(seen, RuntimeError) and "out of memory" in str(seen)):
            return f"{type(seen).__name__}: {str(seen).splitlines()[0][:200]}"
        seen = seen.__cause__
    return None


def _probe(args: argparse.Namespace, layers: int, resident: bool, budget: int, max_host: float) -> dict[str, Any]:
    """Train the decoder of ``layers`` blocks for 1 + ``--steps`` steps under a real ``Trainer``:
    with ``ChunkedOffloadStrategy(budget)`` (built on the meta device, initialized into the host
    chunks), or ``resident`` (on CUDA: no strategy, the model on the GPU; on the CPU: the strategy
    with every chunk resident, for its byte accounting). ``ChunkedAdamW`` either way. Returns
    ``layers``, ``params``, and ``peak_device_bytes`` / ``step_seconds`` if it trained; ``reason``
    if it does not train within the budget (not attempted over the host-memory cap)."""
    import gc
    import logging

    import torch
    import torch.nn.functional as F
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ckpt import ChunkedAdamW, ChunkedOffloadStrategy

    params = _decoder_params(args, layers)
    row: dict[str, Any] = {"layers": layers, "params": params}
    host = params * HOST_BYTES_PER_PARAM
    if host > max_host * 1e9:
        row["reason"] = (
            f"host-memory cap: ~{host / 1e9:.3g} GB of host memory ({HOST_BYTES_PER_PARAM} B/param) over"
            f" --max-host-gb {max_host:.3g}"
        )
        return row
    cuda = args.device == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    vocab, steps = args.vocab, args.steps

    class Decoder(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = _decoder(args, layers)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            logits = self.decoder(tokens[:, :-1])
            return F.cross_entropy(logits.float().view(-1, vocab), tokens[:, 1:].reshape(-1))

        def configure_optimizers(self) -> Any:
            return ChunkedAdamW(self.parameters(), chunk_size=args.chunk_size)

    class Timer(Callback):
        """Wall time of steps 2 .. 1 + ``steps`` (the warm-up traces the plan), the last step's
        optimizer work and device queue included."""

        seconds: float | None = None

        def on_train_batch_start(self, trainer: Trainer, *_: Any) -> None:
            if trainer.global_step == 1:
                sync()
                self.started = time.perf_counter()

        def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
            if trainer.global_step == 1 + steps:
                trainer.optimizers[0].wait()
                sync()
                self.seconds = (time.perf_counter() - self.started) / steps

    block, _ = _decoder_classes()
    offload = None
    if not (resident and cuda):
        offload = ChunkedOffloadStrategy(
            device_memory_budget=2**62 if resident else budget, chunk_size=args.chunk_size, prefetch=args.prefetch,
            unit_types=[block, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.Linear],
        )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, ((1 + steps) * args.sequences, args.seq_len + 1), generator=gen)
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    timer = Timer()
    trainer = model = None
    if cuda:  # the peak counts from here: every earlier size's memory was released
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    try:
        trainer = Trainer(
            accelerator="gpu" if cuda else "cpu", devices=1, strategy=offload or "auto", max_steps=1 + steps,
            callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )
        with trainer.init_module(empty_init=True) if offload else contextlib.nullcontext():
            model = Decoder()  # the strategy: on the meta device; resident: on the CPU, moved at setup
        trainer.fit(model, DataLoader(TensorDataset(tokens), batch_size=args.sequences))
        stats = offload.memory_stats() if offload else {}
        peak = torch.cuda.max_memory_allocated() - before if cuda else stats["peak_device_bytes"]
        row.update({"peak_device_bytes": peak, "step_seconds": timer.seconds, "host_rss_bytes": proc_status().get("VmRSS")})
        row.update({k: stats[k] for k in ("accounted_peak_bytes", "streamed_chunks", "slots", "h2d_bytes") if k in stats})
        if peak > budget:
            row["reason"] = f"peak device memory {peak / 2**20:.3f} MiB over the budget ({budget / 2**20:.3f} MiB)"
    except Exception as exc:  # noqa: BLE001 - only the failures that mean "does not fit" are kept
        reason = _does_not_fit(exc)
        if reason is None:
            raise
        row["reason"] = reason
    finally:
        # Nothing of this size may survive into the next: the exception (its frames) is gone here,
        # the Trainer, model and optimizer (its host arena, pinned on CUDA) go now.
        trainer = model = offload = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return row


def _largest(args: argparse.Namespace, resident: bool, budget: int, max_host: float, log: Callable[[str], None]) -> dict[str, Any]:
    """The largest depth that trains under ``budget`` (doubling from 1 block, then bisecting), the
    size after it and why that one failed; one probe per depth tried."""
    probes: dict[int, dict[str, Any]] = {}

    def trains(layers: int) -> bool:
        if layers not in probes:
            probes[layers] = _probe(args, layers, resident, budget, max_host)
            probe = probes[layers]
            outcome = probe["reason"] if "reason" in probe else f"trains: {fmt(probe['step_seconds'], 3)} s/step"
            log(f"{'resident' if resident else 'strategy'} {layers} layers ({probe['params'] / 1e6:.2f}M params): {outcome}")
        return "reason" not in probes[layers]

    good, bad, layers = 0, None, 1
    while bad is None and good < args.max_layers:
        layers = min(layers, args.max_layers)
        if trains(layers):
            good, layers = layers, 2 * layers
        else:
            bad = layers
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        if trains(middle):
            good = middle
        else:
            bad = middle
    name = ("resident (no strategy)" if args.device == "cuda" else "resident (every chunk resident)") if resident else "ChunkedOffloadStrategy"
    row: dict[str, Any] = {"contender": name, "device_memory_budget": budget, "largest_layers": good or None}
    if good:
        best = probes[good]
        row.update({
            "params": best["params"], "parameter_bytes": 2 * best["params"], "step_seconds": best["step_seconds"],
            "tokens_per_second": args.sequences * args.seq_len / best["step_seconds"] if best["step_seconds"] else None,
            "peak_device_bytes": best["peak_device_bytes"],
        })
    if bad is None:
        row.update({"next_layers": args.max_layers + 1, "next_reason": f"not tried: --max-layers {args.max_layers}"})
    else:
        failed = probes[bad]
        row.update({"next_layers": bad, "next_params": failed["params"], "next_reason": failed["reason"]})
        row.update({f"next_{k}": failed[k] for k in ("step_seconds", "peak_device_bytes") if k in failed})
    row["probes"] = [probes[k] for k in sorted(probes)]
    return row


def run_largest(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The largest decoder (in blocks) that trains under ``--budget``, streamed by
    ``ChunkedOffloadStrategy`` and resident (see the module doc)."""
    from lightning_ckpt.bench.report import stderr_logger
    from lightning_ckpt.format.plan import parse_size

    budget = parse_size(args.budget, "--budget")
    max_host = args.max_host_gb if args.max_host_gb is not None else default_max_host_gb()
    log = stderr_logger()
    rows = [_largest(args, resident, budget, max_host, log) for resident in (False, True)]
    for row in rows:
        row["max_host_gb"] = max_host
    streamed, resident = rows
    if streamed.get("params") and resident.get("params"):
        streamed["params_vs_resident"] = streamed["params"] / resident["params"]
    return rows


def run_save(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The save rows: one async save after a step, ``AdamW`` (fused) against ``ChunkedAdamW``."""
    import tempfile

    import torch

    from lightning_ckpt import ChunkedAdamW, ShardedCheckpointIO

    device = torch.device(args.device)
    makers = {
        "AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True),
        "ChunkedAdamW": lambda ps: ChunkedAdamW(ps, chunk_size=args.chunk_size),
    }
    rows = []
    for name, make in makers.items():
        measured: dict[str, list[float]] = {"stall": [], "durable": [], "copied": [], "d2h": [], "arena": [], "on_write": []}
        for _ in range(args.repeats):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(device)
            optimizer = make(list(model.parameters()))
            x = torch.randn(args.batch, args.width, device=device)

            def step() -> None:
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()

            def checkpoint() -> dict[str, Any]:
                return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": 0}

            plugin = ShardedCheckpointIO(async_save=True)
            with tempfile.TemporaryDirectory(dir=os.getcwd()) as folder:
                step()
                plugin.save_checkpoint(checkpoint(), os.path.join(folder, "warm.ckpt"))  # pool and writer warm
                plugin.wait()
                step()
                state = checkpoint()
                arena = getattr(optimizer, "_arena", None)
                copied, arena_bytes, on_write = plugin.async_saver.pool.host_bytes_copied, getattr(arena, "snapshot_bytes", 0), getattr(arena, "copied_on_write", 0)
                start = time.perf_counter()
                plugin.save_checkpoint(state, os.path.join(folder, "measured.ckpt"))
                measured["stall"].append(time.perf_counter() - start)
                measured["copied"].append(plugin.async_saver.pool.host_bytes_copied - copied)
                measured["d2h"].append(sum(
                    t.numel() * t.element_size() for entry in state["optimizer_states"][0]["state"].values()
                    for t in entry.values() if isinstance(t, torch.Tensor) and t.device.type != "cpu"
                ))
                del state
                for _ in range(args.steps):  # training goes on while the save is written
                    step()
                plugin.wait()
                measured["durable"].append(plugin.last_save.seconds if plugin.last_save else float("nan"))
                measured["arena"].append(getattr(arena, "snapshot_bytes", 0) - arena_bytes)
                measured["on_write"].append(getattr(arena, "copied_on_write", 0) - on_write)
                plugin.teardown()
            del optimizer, model
        rows.append({
            "contender": name,
            "stall_seconds": measured["stall"],
            "median_stall_seconds": median(measured["stall"]),
            "median_durable_seconds": median(measured["durable"]),
            "staged_in_call_bytes": median(measured["copied"]),
            "optimizer_d2h_bytes": median(measured["d2h"]),
            "arena_copied_bytes": median(measured["arena"]),
            "copied_on_write_bytes": median(measured["on_write"]),
        })
    return rows


def render_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    if any("largest_layers" in row for row in rows):
        table = Table(title=f"largest decoder trained under a {fmt(rows[0]['device_memory_budget'] / 2**20, 3)} MiB device budget")
        columns = ("contender", "layers", "Mparams", "x resident", "step s", "peak device MiB", "next layers", "next Mparams", "why the next failed")
        for column in columns:
            table.add_column(column, justify="left" if column in ("contender", "why the next failed") else "right")
        for row in rows:
            params, next_params, peak = (row.get(k) for k in ("params", "next_params", "peak_device_bytes"))
            table.add_row(
                row["contender"], str(row["largest_layers"] or "-"), fmt(params / 1e6 if params else None),
                fmt(row.get("params_vs_resident")), fmt(row.get("step_seconds"), 4), fmt(peak / 2**20 if peak else None, 3),
                str(row["next_layers"]), fmt(next_params / 1e6 if next_params else None), row["next_reason"],
            )
        return table
    if any("median_stall_seconds" in row for row in rows):
        table = Table(title="async save after a step (medians)")
        columns = ("contender", "stall s", "durable s", "staged in call MB", "optimizer D2H MB", "arena copied MB", "copy-on-write MB")
        for column in columns:
            table.add_column(column, justify="left" if column == "contender" else "right")
        for row in rows:
            table.add_row(
                row["contender"], fmt(row["median_stall_seconds"], 4), fmt(row["median_durable_seconds"], 3),
                *(fmt(row[k] / 2**20, 2) for k in ("staged_in_call_bytes", "optimizer_d2h_bytes", "arena_copied_bytes", "copied_on_write_bytes")),
            )
        return table
    if any("vs_resident" in row or "error" in row for row in rows):
        table = Table(title="training step, parameters streamed vs resident (medians)")
        for column in ("contender", "step s", "x resident", "budget MB", "peak device MB", "H2D MB", "D2H MB", "optimizer host MB", "error"):
            table.add_column(column, justify="left" if column in ("contender", "error") else "right")
        for row in rows:
            table.add_row(
                row["contender"], fmt(row.get("median_step_seconds"), 4), fmt(row.get("vs_resident")),
                *(fmt(row[k] / 2**20 if row.get(k) is not None else None, 2) for k in ("device_memory_budget", "peak_device_bytes", "h2d_bytes", "d2h_bytes", "optimizer_host_bytes")),
                row.get("error", ""),
            )
        return table
    table = Table(title="optimizer step (medians)")
    for column in ("contender", "step s", "Mparams/s", "x floor", "x foreach", "peak device MB", "host RSS MB", "pinned MB"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for row in rows:
        pps = row.get("params_per_second")
        peak = row.get("peak_device_bytes")
        table.add_row(
            row["contender"],
            fmt(row.get("median_step_seconds"), 4),
            fmt(pps / 1e6 if pps else None, 1),
            fmt(row.get("vs_floor")),
            fmt(row.get("vs_foreach")),
            fmt(peak / 2**20 if peak else None, 1),
            fmt(row["host_rss_bytes"] / 2**20 if row.get("host_rss_bytes") else None, 1),
            fmt(row["pinned_bytes"] / 2**20 if row.get("pinned_bytes") is not None else None, 1),
        )
    return table


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench --mode offload --device cuda needs a CUDA device; run without --device for the CPU rows.", file=sys.stderr)
        return 2
    if args.largest and min(args.steps, args.max_layers) < 1:
        print(f"bench --mode offload --largest: `--steps {args.steps}` and `--max-layers {args.max_layers}` must be at least 1.", file=sys.stderr)
        return 2
    started = time.time()
    render = render_table
    if args.fsdp2 and args.ddp:
        print("bench --mode offload: `--fsdp2` and `--ddp` are two benchmarks; pass one of them.", file=sys.stderr)
        return 2
    if args.fsdp2 or args.ddp:
        from benchmarks import offload_fsdp2

        if args.fsdp2 and (args.ranks < 1 or (args.device == "cuda" and args.ranks != 1)):
            print("bench --mode offload --fsdp2: `--ranks` must be at least 1 (CPU ranks), and 1 with --device cuda (one GPU).", file=sys.stderr)
            return 2
        gpus = torch.cuda.device_count() if args.device == "cuda" else 0
        if args.ddp and (args.ranks < 2 or (args.device == "cuda" and args.ranks > gpus)):
            print(f"bench --mode offload --ddp: `--ranks {args.ranks}` must be at least 2 (nothing is exchanged on one rank), and at most the {gpus} GPUs here with --device cuda.", file=sys.stderr)
            return 2
        rows, render = offload_fsdp2.run(args), offload_fsdp2.render_table
    elif args.largest:
        rows = run_largest(args)
    elif args.save:
        rows = run_save(args)
    elif args.device == "cuda":
        rows = run_strategy_gpu(args) if args.strategy else run_gpu(args)
    else:
        rows = run_strategy(args) if args.strategy else run(args)
    settings = {k: v for k, v in vars(args).items() if k != "json_path"}
    report = {**report_header(argv, started), "settings": settings, "machine": machine_info(os.getcwd(), cuda=args.device == "cuda"), "results": rows}
    emit_report(render(rows), report, args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
