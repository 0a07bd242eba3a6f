"""Workloads of the research modes beyond the package's synthetic checkpoint dict
(``lightning_ckpt.bench.workloads``): the preallocated state a load of that dict is copied into
(``--mode save``, ``load``), the decoder-only transformer of the real training loops (``--mode
train``, ``compression``), the checkpoint dict ``Trainer`` builds from a live model, and the
byte-for-byte comparison of a loaded checkpoint with the saved one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_ckpt.bench.report import version
from lightning_ckpt.bench.workloads import model_layout


@dataclass
class Restored:
    """Preallocated model and optimizer tensors of ``build_checkpoint(size_bytes)``: what a resumed
    training process loads into (its ``load_state_dict`` copies)."""

    params: dict[str, torch.Tensor]
    optimizer: dict[int, dict[str, torch.Tensor]]

    @classmethod
    def zeros(cls, size_bytes: int, device: str = "cpu") -> Restored:
        """On ``device`` (the step counts stay on the CPU, as AdamW keeps them)."""
        layout = model_layout(size_bytes // 3)
        params = {name: torch.zeros(shape, device=device) for name, shape in layout}
        optimizer = {
            i: {
                "step": torch.zeros(()),
                "exp_avg": torch.zeros(shape, device=device),
                "exp_avg_sq": torch.zeros(shape, device=device),
            }
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
