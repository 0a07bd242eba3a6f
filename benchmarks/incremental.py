"""``bench --mode incremental``: what incremental saves write and cost per save.

Two fine-tunes, each in fresh processes, saving every ``--every`` steps (``--saves`` saves; the
two newest checkpoints kept, older ones removed as top-k retention would):

* ``lora``: a frozen base of ``--base-size`` bytes (fp32 ``Linear`` weights of ``--width``
  columns, ``requires_grad=False``) with rank-``--rank`` LoRA adapters (A and B per layer, about
  ``2 * rank / width`` of the base: < 1% by default), trained by AdamW;
* ``full``: the same base, every weight trained by AdamW (the state is 3x the base).

Each step is a real ``torch.optim.AdamW`` step over the trained tensors (gradients filled once,
reused), so exactly what a fine-tune changes changes. Contenders:

* ``incremental``: ``ShardedCheckpointIO()`` (incremental saves on, the default), told the frozen
  weights (``track_frozen``, as ``ShardedModelCheckpoint`` does);
* ``rewrite``: ``ShardedCheckpointIO(incremental=False)``: every save writes every byte;
* ``torch_io``: Lightning's ``TorchCheckpointIO`` (one ``torch.save`` file), plus an fsync;
* ``incremental_async`` / ``rewrite_async``: the same with ``async_save=True``.

Per save: bytes written (the checkpoint's bytes less those reused; ``torch_io``: its file), the
save's durable time (sync: the call, committed and fsynced; ``torch_io``: call + fsync; async: from
the call until the writer process reports it durable) and the stall (the time the call blocked
the training loop). Saves 2..N are the steady state (the first writes everything); medians over
them, then over ``--repeats`` processes. Targets (issue 25): with a frozen base, written bytes
per save <= 2% and durable time <= 0.1x of ``rewrite``; with nothing frozen, ``incremental`` no
slower than ``rewrite`` (within noise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from benchmarks.common.arguments import size_argument
from benchmarks.common.measure import run_grid
from lightning_ckpt.bench.files import (
    DEFAULT_DIR,
    fsync_file,
    remove_path,
    run_directory,
)
from lightning_ckpt.bench.measure import MB, Metrics, Task, m, ratio
from lightning_ckpt.bench.report import (
    add_json_argument,
    emit_report,
    fmt,
    machine_info,
    report_header,
    stderr_logger,
)

SCENARIOS = ("lora", "full")
CONTENDERS = ("incremental", "rewrite", "torch_io", "incremental_async", "rewrite_async")
DEFAULT_BASE = "1GB"
KEPT = 2  # checkpoints kept on disk, as save_top_k=2 would


def _model(task: Task) -> tuple[Any, list[Any]]:
    """The model and the tensors its optimizer trains (see the module docstring)."""
    import torch

    width, rank = task["width"], task["rank"]
    layers = max(1, task["base_bytes"] // (4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.base = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
    if task["scenario"] == "lora":
        model.base.requires_grad_(False)
        model.lora_a = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(rank, width) * 0.01) for _ in range(layers))
        model.lora_b = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(width, rank)) for _ in range(layers))
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:  # one backward's worth of gradients, reused by every step
        p.grad = torch.randn_like(p) * 1e-3
    return model, trained


def _contender(name: str) -> tuple[Any, bool]:
    """(the IO, async?) of a contender."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from lightning_ckpt import ShardedCheckpointIO

    if name == "torch_io":
        return TorchCheckpointIO(), False
    asynchronous = name.endswith("_async")
    return ShardedCheckpointIO(incremental=name.startswith("incremental"), async_save=asynchronous), asynchronous


def _run_task(task: Task) -> Metrics:
    """One process: ``saves`` saves of ``scenario`` by ``contender``."""
    import torch

    from lightning_ckpt.bench.files import path_bytes

    model, trained = _model(task)
    optimizer = torch.optim.AdamW(trained, lr=1e-4, foreach=True)
    io, asynchronous = _contender(task["contender"])
    if hasattr(io, "track_frozen"):
        io.track_frozen(model)
    per_save: list[Metrics] = []
    paths: list[str] = []
    step = 0
    try:
        for index in range(task["saves"]):
            for _ in range(task["every"]):
                optimizer.step()
                step += 1
            path = os.path.join(task["run_dir"], f"{task['tag']}-step={step}.ckpt")
            checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": step}
            start = time.perf_counter()
            io.save_checkpoint(checkpoint, path)
            stall = time.perf_counter() - start
            if task["contender"] == "torch_io":
                fsync_file(path)
                durable, written, reused = time.perf_counter() - start, path_bytes(path), 0
            else:
                if asynchronous:
                    io.wait()  # untimed here: the writer process timed the save (call to durable)
                    (result,) = [r for r in io.poll() if os.path.abspath(r.path) == os.path.abspath(path)]
                else:
                    result = io.last_save
                durable, written, reused = result.seconds, result.nbytes - result.reused_bytes, result.reused_bytes
            per_save.append({
                "index": index + 1, "step": step, "stall_s": stall, "durable_s": durable,
                "written_mb": written / MB, "reused_mb": reused / MB,
            })  # fmt: skip
            paths.append(path)
            while len(paths) > KEPT:  # retention: through the plugin, as ModelCheckpoint removes
                io.remove_checkpoint(paths.pop(0))
    finally:
        if hasattr(io, "teardown"):
            io.teardown()
        for path in paths:
            remove_path(path)
    steady = per_save[1:] or per_save
    metrics: Metrics = {
        key: statistics.median(s[key] for s in steady) for key in ("stall_s", "durable_s", "written_mb", "reused_mb")
    }
    metrics["first_written_mb"] = per_save[0]["written_mb"]
    metrics["state_mb"] = sum(t.nbytes for t in model.state_dict().values()) / MB
    return {"metrics": metrics, "per_save": per_save}


def render_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="incremental saves (steady saves 2..N, medians; durable: from the call until committed and fsynced)")
    columns = ("fine-tune", "contender", "written MB/save", "written / rewrite", "reused MB/save", "durable s",
               "durable / rewrite", "stall s")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("fine-tune", "contender") else "right", no_wrap=True)
    for scenario, contenders in report["results"]["scenarios"].items():
        for contender, entry in contenders.items():
            s = entry["summary"]
            if s is None:
                table.add_row(scenario, contender, "failed")
                continue
            baseline = contenders.get("rewrite_async" if contender.endswith("_async") else "rewrite", {}).get("summary")
            table.add_row(
                scenario, contender, fmt(m(s, "written_mb"), 1), fmt(ratio(m(s, "written_mb"), m(baseline, "written_mb")), 4),
                fmt(m(s, "reused_mb"), 1), fmt(m(s, "durable_s"), 3),
                fmt(ratio(m(s, "durable_s"), m(baseline, "durable_s")), 3), fmt(m(s, "stall_s"), 3),
            )  # fmt: skip
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks --mode incremental", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-size", type=size_argument("--base-size"), default=DEFAULT_BASE, help=f"bytes of the base model (default {DEFAULT_BASE})")
    parser.add_argument("--width", type=int, default=4096, help="columns of each base Linear (default 4096)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8: adapters are 2*8/4096 = 0.4%% of the base)")
    parser.add_argument("--saves", type=int, default=5, help="saves per process (default 5; steady state = saves 2..N)")
    parser.add_argument("--every", type=int, default=2, help="optimizer steps between saves (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="processes per fine-tune and contender, medians reported (default 3)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"where checkpoints are written (default ./{DEFAULT_DIR})")
    add_json_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the incremental benchmark; print a table (and the JSON with ``--json``). Returns 0, 1 if a run failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for option in ("saves", "repeats", "every", "width", "rank"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    log = stderr_logger()
    directory = os.path.abspath(args.dir)
    started = time.time()
    with run_directory(directory) as run_dir:

        def task_of(scenario: str, contender: str, tag: str) -> Task:
            return {
                "kind": "incremental", "scenario": scenario, "contender": contender, "base_bytes": args.base_size,
                "width": args.width, "rank": args.rank, "saves": args.saves, "every": args.every,
                "run_dir": run_dir, "tag": tag,
            }  # fmt: skip

        scenarios, errors = run_grid(args.repeats, list(args.scenarios), list(args.contenders), task_of, _run_task, log)

    def median(scenario: str, contender: str, key: str) -> float | None:
        return m(scenarios[scenario].get(contender, {}).get("summary"), key)

    ratios = {
        scenario: {
            "written_incremental_over_rewrite": ratio(median(scenario, "incremental", "written_mb"), median(scenario, "rewrite", "written_mb")),
            "durable_incremental_over_rewrite": ratio(median(scenario, "incremental", "durable_s"), median(scenario, "rewrite", "durable_s")),
            "durable_incremental_over_torch_io": ratio(median(scenario, "incremental", "durable_s"), median(scenario, "torch_io", "durable_s")),
            "stall_incremental_async_over_rewrite_async": ratio(
                median(scenario, "incremental_async", "stall_s"), median(scenario, "rewrite_async", "stall_s")
            ),
            "durable_incremental_async_over_rewrite_async": ratio(
                median(scenario, "incremental_async", "durable_s"), median(scenario, "rewrite_async", "durable_s")
            ),
        }
        for scenario in scenarios
    }  # fmt: skip
    report = {
        **report_header(argv, started),
        "settings": {
            "mode": "incremental",
            "base_bytes": args.base_size,
            "width": args.width,
            "rank": args.rank,
            "saves": args.saves,
            "every": args.every,
            "repeats": args.repeats,
            "scenarios": list(args.scenarios),
            "contenders": list(args.contenders),
            "kept": KEPT,
            "dir": directory,
            "units": "MB = 1e6 bytes; written = the checkpoint's bytes less those reused from the previous one",
        },
        "machine": machine_info(directory),
        "results": {"scenarios": scenarios, "ratios": ratios, "errors": errors},
    }
    emit_report(render_table(report), report, args.json_path)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
