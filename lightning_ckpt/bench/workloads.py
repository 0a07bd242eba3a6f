"""Workloads: the synthetic Lightning checkpoint dict of ``--mode save|async``, the fixed compute
and state update of the simulated loop (``--mode async``), and the decoder-only transformer of the
real training loop (``--mode train``)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ckpt.bench.report import version
from lightning_ckpt.format.plan import iter_tensors

_LAYERS = 6
MATMUL_SIZE = 1024
UPDATE_WEIGHT = 1e-3


# ----------------------------------------------------------------------------------------------
# The checkpoint dict


def model_layout(param_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a small transformer-like model (51 fp32 tensors) of about ``param_bytes``."""
    elements = max(param_bytes // 4, 1)
    # Each block holds 12 h^2 + 9 h elements; the blocks take ~3/4, the embedding the rest.
    hidden = max(8, int(math.sqrt(0.75 * elements / (12 * _LAYERS))) // 8 * 8)
    blocks: list[tuple[str, tuple[int, ...]]] = []
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        blocks += [
            (p + "attn.qkv.weight", (3 * hidden, hidden)),
            (p + "attn.qkv.bias", (3 * hidden,)),
            (p + "attn.proj.weight", (hidden, hidden)),
            (p + "mlp.fc1.weight", (4 * hidden, hidden)),
            (p + "mlp.fc1.bias", (4 * hidden,)),
            (p + "mlp.fc2.weight", (hidden, 4 * hidden)),
            (p + "norm.weight", (hidden,)),
            (p + "norm.bias", (hidden,)),
        ]
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
    param_group = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.01,
        "amsgrad": False,
        "maximize": False,
        "foreach": None,
        "capturable": False,
        "differentiable": False,
        "fused": None,
        "params": list(range(len(layout))),
    }
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


@dataclass
class Restored:
    """Preallocated model and optimizer tensors of ``build_checkpoint(size_bytes)``: what a resumed
    training process loads into (its ``load_state_dict`` copies)."""

    params: dict[str, torch.Tensor]
    optimizer: dict[int, dict[str, torch.Tensor]]

    @classmethod
    def zeros(cls, size_bytes: int) -> Restored:
        layout = model_layout(size_bytes // 3)
        params = {name: torch.zeros(shape) for name, shape in layout}
        optimizer = {
            i: {"step": torch.zeros(()), "exp_avg": torch.zeros(shape), "exp_avg_sq": torch.zeros(shape)}
            for i, (_, shape) in enumerate(layout)
        }
        return cls(params, optimizer)

    @property
    def tensors(self) -> int:
        return len(self.params) + sum(len(state) for state in self.optimizer.values())

    def copy_from(self, checkpoint: dict[str, Any]) -> int:
        """Copy a loaded checkpoint's weights and moments in; how many tensors were copied."""
        copied = 0
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(checkpoint["state_dict"][name])
                copied += 1
            for index, saved in checkpoint["optimizer_states"][0]["state"].items():
                for key, value in saved.items():
                    self.optimizer[index][key].copy_(value)
                    copied += 1
        return copied


def state_bytes(size_bytes: int) -> tuple[int, int]:
    """(tensor bytes, tensor count) of ``build_checkpoint(size_bytes)``, without building it."""
    layout = model_layout(size_bytes // 3)
    elements = sum(math.prod(shape) for _, shape in layout)
    return 4 * (3 * elements + len(layout)), 4 * len(layout)


# ----------------------------------------------------------------------------------------------
# The simulated training step (--mode async)


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

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):
        workload()
    times = []
    for _ in range(7):
        sync()
        start = time.perf_counter()
        workload()
        sync()
        times.append(time.perf_counter() - start)
    one_ms = statistics.median(times) * 1000
    return max(1, round(target_ms / one_ms)), one_ms


# ----------------------------------------------------------------------------------------------
# The real training step (--mode train): a decoder-only transformer


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Shape of :class:`Decoder`. ``heads`` divides ``width``; ``tied``: the head reuses the embedding."""

    vocab: int
    width: int
    layers: int
    heads: int
    tied: bool = False

    def parameters(self) -> int:
        """Parameter count: per block 12 w^2 (attention 4 w^2, 4x MLP 8 w^2) + 2 w (norms)."""
        head = 0 if self.tied else self.vocab * self.width
        return self.vocab * self.width + head + self.layers * (12 * self.width**2 + 2 * self.width) + self.width


def decoder_config(
    params: int, vocab: int, tied: bool = False, layers: int | None = None, width: int | None = None
) -> DecoderConfig:
    """A config of about ``params`` parameters, GPT-3's aspect (width ~ 85 x layers, 64-wide heads)
    where ``layers`` / ``width`` are not given; with both given, ``params`` is ignored."""

    def config(w: int, n: int) -> DecoderConfig:
        heads = max(1, w // 64)
        while w % heads:
            heads -= 1
        return DecoderConfig(vocab, w, n, heads, tied)

    if width is not None:
        embeddings = config(width, 0).parameters()
        return config(width, layers or max(1, round((params - embeddings) / (12 * width**2))))
    step = 64 if params >= 50_000_000 else 16
    candidates = [config(w, layers or max(1, round(w / 85))) for w in range(step, 16385, step)]
    return min(candidates, key=lambda c: abs(c.parameters() - params))


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = torch.nn.RMSNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(width)
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, w))
        return x + self.down(torch.nn.functional.gelu(self.up(self.mlp_norm(x))))


class Decoder(torch.nn.Module):
    """Embedding, ``layers`` pre-norm blocks (causal attention + 4x GELU MLP, RMSNorm), a final
    RMSNorm and an LM head (tied to the embedding or not)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(config.vocab, config.width)
        self.blocks = torch.nn.ModuleList(_Block(config.width, config.heads) for _ in range(config.layers))
        self.norm = torch.nn.RMSNorm(config.width)
        self.head = torch.nn.Linear(config.width, config.vocab, bias=False)
        if config.tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lightning_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, epoch: int = 0) -> dict[str, Any]:
    """The dict ``Trainer.save_checkpoint`` hands to ``CheckpointIO.save_checkpoint`` (built afresh
    per save, as ``dump_checkpoint`` does: the tensors are the live parameters and optimizer state)."""
    return {
        "epoch": epoch,
        "global_step": step,
        "pytorch-lightning_version": version("lightning") or "unknown",
        "state_dict": model.state_dict(),
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_progress": {"total": {"ready": epoch + 1, "completed": epoch}},
                "epoch_loop.batch_progress": {"total": {"ready": step, "completed": step}},
            }
        },
        "callbacks": {},
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [],
    }


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def mismatches(expected: Any, loaded: Any, where: str = "checkpoint", limit: int = 5) -> list[str]:
    """Where ``loaded`` differs from ``expected`` (at most ``limit``): tensors byte for byte with
    dtype and shape, containers key by key, every other value by type and ``==``."""
    found: list[str] = []

    def walk(a: Any, b: Any, at: str) -> None:
        if len(found) >= limit:
            return
        if isinstance(a, torch.Tensor):
            if not isinstance(b, torch.Tensor):
                found.append(f"{at}: a tensor came back as {type(b).__name__}")
            elif (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
                found.append(f"{at}: {a.dtype} {tuple(a.shape)} came back as {b.dtype} {tuple(b.shape)}")
            elif not torch.equal(_raw(a), _raw(b)):
                found.append(f"{at}: the bytes differ")
        elif isinstance(a, Mapping):
            if not isinstance(b, Mapping):
                found.append(f"{at}: a mapping came back as {type(b).__name__}")
                return
            if set(a) != set(b):
                missing, extra = sorted(map(repr, set(a) - set(b))), sorted(map(repr, set(b) - set(a)))
                found.append(f"{at}: keys missing {missing[:5]}, unexpected {extra[:5]}")
                return
            for key in a:
                walk(a[key], b[key], f"{at}[{key!r}]")
        elif isinstance(a, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                found.append(f"{at}: {type(a).__name__} of {len(a)} came back as {type(b).__name__}")
                return
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{at}[{i}]")
        elif type(a) is not type(b) or a != b:
            found.append(f"{at}: {a!r} came back as {b!r}")

    walk(expected, loaded, where)
    return found
