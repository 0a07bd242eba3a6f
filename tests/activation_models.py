"""The decoder that the activation-checkpointing tests train (unit, integration, distributed, GPU).

``Block`` is a pre-norm residual block that counts its forward runs (a checkpointed block runs
twice per step: forward + recompute). ``Decoder`` (embedding -> blocks -> head) is a
``LightningModule`` that builds its blocks in ``configure_model``, as a sharded model would; call
``configure_model()`` yourself (or pass ``build=True``) to use it as a plain module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from models import trainer_kwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ckpt.lightning.activation import checkpointed_paths

DIM, VOCAB = 16, 32


class Block(nn.Module):
    """Causal self-attention over ``heads`` heads (none with ``heads=0``: an MLP-only block), then a
    4x GELU MLP; ``dropout`` on both residual branches, ``attention_dropout`` on the attention
    weights while training. ``count=False`` stops counting ``runs`` (under ``torch.compile`` a side
    effect inside a checkpoint is a graph break)."""

    def __init__(
        self, dim: int = DIM, heads: int = 0, dropout: float = 0.2, attention_dropout: float = 0.0, count: bool = True
    ) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.count = count
        if heads:
            self.ln1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.count:
            self.runs += 1
        if self.heads:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            p = self.attention_dropout if self.training else 0.0
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
            x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Decoder(LightningModule):
    """Embedding -> ``layers`` blocks (``Block(**block)``) -> head; AdamW; cross-entropy on
    ``samples`` random token rows of 8 in batches of 4. Records its training losses and, on the
    first batch, the checkpointed module paths."""

    def __init__(self, layers: int = 3, samples: int = 16, build: bool = False, **block) -> None:
        super().__init__()
        self.layers, self.samples, self.block_kwargs = layers, samples, block
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks: nn.ModuleList | None = None
        if build:  # registered before the head, as a model built in one go would be
            self.configure_model()
        self.head = nn.Linear(DIM, VOCAB)
        self.losses: list[float] = []
        self.seen_checkpointed: list[str] = []

    def configure_model(self) -> None:
        if self.blocks is None:
            self.blocks = nn.ModuleList(Block(**self.block_kwargs) for _ in range(self.layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        if batch_idx == 0:
            self.seen_checkpointed = checkpointed_paths(self)
        loss = F.cross_entropy(self(idx).flatten(0, 1).float(), idx.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        idx = torch.randint(0, VOCAB, (self.samples, 8), generator=torch.Generator().manual_seed(3))
        return DataLoader(TensorDataset(idx), batch_size=4)


def fit_decoder(model: Decoder, callbacks=(), max_steps: int = 4, ckpt_path=None, **overrides) -> tuple[Trainer, Decoder]:
    """Fit ``model`` on CPU for ``max_steps`` (seed first: the caller decides where); returns (trainer, model)."""
    trainer = Trainer(
        max_steps=max_steps, enable_checkpointing=False, callbacks=list(callbacks), **trainer_kwargs(**overrides)
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model
