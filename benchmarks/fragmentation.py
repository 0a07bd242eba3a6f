"""``bench --mode fragmentation``: what releasing the CUDA cache after a save does to training.

Two synthetic loops on one GPU, each configuration in a fresh process (the allocator's settings
are read when CUDA starts), saves simulated by what they do to device memory:

* ``plain``: every step allocates the same activations (a fixed list of sizes) around a few
  matmuls, then frees them; a "save" every ``--every`` steps. Reserved-but-free memory is the
  next step's: emptying the cache after a save only makes that step reserve it again.
* ``varying``: under a memory cap (``torch.cuda.set_per_process_memory_fraction``), each step's
  activations have other sizes (a seeded draw) and each save allocates temporary buffers of
  sizes training never uses (as a gather of sharded state does). Cached blocks then fit the next
  requests badly: the allocator frees its whole cache and retries mid-step (``num_alloc_retries``)
  or fails (``num_ooms``).

Each loop runs with the release policy ``never``, ``on_pressure`` (``ShardedModelCheckpoint``'s
default), ``always`` (emptying after every save), and ``never`` with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Reported: median step, the step right after
each save (median over saves, as a ratio to the median step), allocator retries and OOMs per 100
steps, and peak reserved memory. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 2**20
CONFIGS = (("never", False), ("on_pressure", False), ("always", False), ("never", True))


def _loop(scenario: str, policy: str, steps: int, every: int, seed: int) -> dict[str, Any]:
    import torch

    from lightning_ckpt.lightning.release import memory_stats, release_memory

    device = torch.device("cuda")
    weights = torch.randn(4096, 4096, device=device)
    rng = random.Random(seed)
    if scenario == "varying":
        # Room for the weights, the largest step and a little more: not for everything cached.
        cap = torch.cuda.memory_allocated() + 2304 * MiB
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory)

    def activation_sizes() -> list[int]:
        if scenario == "plain":
            return [64 * MiB] * 16
        return [rng.choice((16, 32, 64, 128, 256)) * MiB for _ in range(rng.randint(4, 8))]

    def save() -> None:
        if scenario == "varying":  # temporary buffers of sizes training never asks for
            buffers = [torch.empty(rng.choice((200, 280, 360)) * MiB, dtype=torch.uint8, device=device) for _ in range(3)]
            del buffers

    times, after_save, ooms = [], [], 0
    since = memory_stats()
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            held = [torch.empty(n, dtype=torch.uint8, device=device) for n in activation_sizes()]
            for _ in range(4):
                weights = torch.tanh(weights @ weights) * 0.5
            del held
        except torch.OutOfMemoryError:
            ooms += 1
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step and step % every == 0:
            try:
                save()
            except torch.OutOfMemoryError:
                ooms += 1
            release_memory(policy, since)  # type: ignore[arg-type]
            since = memory_stats()
            after_save.append(step + 1)
    stats = torch.cuda.memory_stats()
    warm = times[every:]  # the first steps reserve memory whatever the policy
    median = statistics.median(warm)
    next_steps = [times[i] / median for i in after_save if i < len(times)]
    return {
        "median_step_s": median,
        "after_save_x": statistics.median(next_steps) if next_steps else None,
        "worst_after_save_x": max(next_steps) if next_steps else None,
        "alloc_retries_per_100_steps": 100 * stats.get("num_alloc_retries", 0) / steps,
        "ooms_per_100_steps": 100 * ooms / steps,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
    }


def _run(scenario: str, policy: str, expandable: bool, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    # The user's allocator settings stay, but for expandable_segments. Torch reads PYTORCH_ALLOC_CONF
    # before the older PYTORCH_CUDA_ALLOC_CONF: both get the same value, so neither overrides ours.
    user = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    conf = [c for c in user.split(",") if c and "expandable_segments" not in c]
    env["PYTORCH_ALLOC_CONF"] = env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(conf + [f"expandable_segments:{expandable}"])
    task = json.dumps([scenario, policy, args.steps, args.every, args.seed])
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.fragmentation", "--child", task],
        env=env, capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def render_table(results: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    from lightning_ckpt.bench.report import fmt

    table = Table(title="CUDA cache release after saves (median over saves; x = / median step)")
    for column in ("loop", "release", "allocator", "median step s", "step after save x", "worst x",
                   "retries /100 steps", "OOMs /100 steps", "peak reserved GB"):
        table.add_column(column, justify="left" if column in ("loop", "release", "allocator") else "right")
    for r in results:
        m = r["metrics"]
        allocator = "expandable" if r["expandable_segments"] else "default"
        if "error" in m:
            table.add_row(r["scenario"], r["policy"], allocator, "error: " + m["error"][:60])
            continue
        table.add_row(
            r["scenario"], r["policy"], allocator, fmt(m["median_step_s"], 4), fmt(m["after_save_x"]),
            fmt(m["worst_after_save_x"]), fmt(m["alloc_retries_per_100_steps"], 1), fmt(m["ooms_per_100_steps"], 1),
            fmt(m["peak_reserved_gb"]),
        )
    return table


def build_parser() -> argparse.ArgumentParser:
    from lightning_ckpt.bench.report import add_json_argument

    parser = argparse.ArgumentParser(prog="python -m benchmarks --mode fragmentation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per configuration")
    parser.add_argument("--every", type=int, default=10, help="a save every this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loops", nargs="+", choices=("plain", "varying"), default=["plain", "varying"])
    add_json_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["--child"]:
        scenario, policy, steps, every, seed = json.loads(args_list[1])
        print(json.dumps(_loop(scenario, policy, steps, every, seed)))
        return 0
    args = build_parser().parse_args(args_list)
    import torch

    from lightning_ckpt.bench.report import emit_report, machine_info, report_header

    if not torch.cuda.is_available():
        print("bench --mode fragmentation measures the CUDA caching allocator: it needs a CUDA device.", file=sys.stderr)
        return 2
    started = time.time()
    results = []
    for scenario in args.loops:
        for policy, expandable in CONFIGS:
            print(f"{scenario} / {policy} / expandable_segments={expandable}", file=sys.stderr, flush=True)
            metrics = _run(scenario, policy, expandable, args)
            results.append({"scenario": scenario, "policy": policy, "expandable_segments": expandable, "metrics": metrics})
    report = {**report_header(argv, started), "machine": machine_info(os.getcwd(), cuda=True), "results": results}
    emit_report(render_table(results), report, args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
