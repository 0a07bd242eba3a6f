"""Workloads: the synthetic Lightning checkpoint dict (``--mode save|async``, and modes of
``benchmarks/``), the fixed compute and the state update of the simulated training step."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from lightning_ckpt.bench.report import version
from lightning_ckpt.format.plan import iter_tensors

_LAYERS = 6
MATMUL_SIZE = 1024
MATMUL_SIZE_CUDA = 4096  # --device cuda: a step's compute on the device
UPDATE_WEIGHT = 1e-3


def model_layout(param_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a small transformer-like model (51 fp32 tensors) of about ``param_bytes``."""
    elements = max(param_bytes // 4, 1)
    # Each block holds 12 h^2 + 9 h elements; the blocks take ~3/4, the embedding the rest.
    hidden = max(8, int(math.sqrt(0.75 * elements / (12 * _LAYERS))) // 8 * 8)
    shapes = {
        "attn.qkv.weight": (3 * hidden, hidden), "attn.qkv.bias": (3 * hidden,), "attn.proj.weight": (hidden, hidden),
        "mlp.fc1.weight": (4 * hidden, hidden), "mlp.fc1.bias": (4 * hidden,), "mlp.fc2.weight": (hidden, 4 * hidden),
        "norm.weight": (hidden,), "norm.bias": (hidden,),
    }  # fmt: skip
    blocks = [(f"model.layers.{i}.{name}", shape) for i in range(_LAYERS) for name, shape in shapes.items()]
    blocks += [("model.norm.weight", (hidden,)), ("model.norm.bias", (hidden,))]
    used = sum(math.prod(shape) for _, shape in blocks)
    vocab = max(1, (elements - used) // hidden)
    return [("model.embed.weight", (vocab, hidden)), *blocks]


def build_checkpoint(size_bytes: int, device: str | torch.device = "cpu") -> dict[str, Any]:
    """A Lightning-style checkpoint of about ``size_bytes``: 1/3 weights, 2/3 AdamW state (fp32).

    Weights and moments are created on ``device``; the ``step`` counters stay on the CPU, as
    AdamW keeps them (not ``capturable``, not ``fused``).
    """
    torch.manual_seed(0)
    layout = model_layout(size_bytes // 3)
    state_dict = {name: torch.randn(shape, device=device) for name, shape in layout}
    optimizer_state = {
        i: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(shape, device=device),
            "exp_avg_sq": torch.randn(shape, device=device).abs_(),
        }
        for i, (_, shape) in enumerate(layout)
    }
    param_group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
                   "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                   "params": list(range(len(layout)))}  # fmt: skip
    return {
        "epoch": 3,
        "global_step": 1200,
        "pytorch-lightning_version": version("lightning") or "unknown",
        "state_dict": state_dict,
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_progress": {"total": {"ready": 4, "completed": 3}, "current": {"ready": 4, "completed": 3}},
                "epoch_loop.batch_progress": {"total": {"ready": 1200, "completed": 1200}},
            }
        },
        "callbacks": {},
        "optimizer_states": [{"state": optimizer_state, "param_groups": [param_group]}],
        "lr_schedulers": [],
    }


def state_bytes(size_bytes: int) -> tuple[int, int]:
    """(tensor bytes, tensor count) of ``build_checkpoint(size_bytes)``, without building it."""
    layout = model_layout(size_bytes // 3)
    elements = sum(math.prod(shape) for _, shape in layout)
    return 4 * (3 * elements + len(layout)), 4 * len(layout)


class MatmulWorkload:
    """The fixed compute of one step: ``matmuls`` products of two ``n`` x ``n`` fp32 matrices."""

    def __init__(self, n: int, matmuls: int, device: str = "cpu") -> None:
        generator = torch.Generator().manual_seed(1)
        self.a = (torch.randn(n, n, generator=generator) / math.sqrt(n)).to(device)
        self.x = torch.randn(n, n, generator=generator).to(device)
        self.out = torch.empty(n, n, device=device)
        self.matmuls = matmuls

    def __call__(self) -> None:
        for _ in range(self.matmuls):
            torch.mm(self.a, self.x, out=self.out)


class StateUpdate(torch.optim.Optimizer):
    """The per-step in-place update of every state tensor, ``t.lerp_(target, 1e-3)``, run as an
    optimizer step so that global optimizer-step pre-hooks fire where a training loop's would."""

    def __init__(self, tensors: list[torch.Tensor], target: torch.Tensor) -> None:
        super().__init__(tensors, {})
        self.target = target

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for t in group["params"]:
                t.lerp_(self.target, UPDATE_WEIGHT)


def state_tensors(checkpoint: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(weights + AdamW moments, the optimizer's 0-d step counters) of ``checkpoint``."""
    tensors = list(iter_tensors(checkpoint))
    return [t for t in tensors if t.dim() > 0], [t for t in tensors if t.dim() == 0]


def calibrate_matmuls(target_ms: float, n: int = MATMUL_SIZE, device: str = "cpu") -> tuple[int, float]:
    """How many ``n`` x ``n`` matmuls take about ``target_ms`` here; (count, ms of one)."""
    workload = MatmulWorkload(n, 1, device)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    times = []
    for _ in range(9):  # 2 to warm up, 7 timed
        sync()
        start = time.perf_counter()
        workload()
        sync()
        times.append(time.perf_counter() - start)
    one_ms = statistics.median(times[2:]) * 1000
    return max(1, round(target_ms / one_ms)), one_ms
