"""lightning_ckpt demo: train a small model on CPU with sharded checkpoints, then resume.

Run with ``make demo`` (creates the virtual environment) or ``python examples/demo.py``.
Everything is generated locally; nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from rich.console import Console
from torch.utils.data import DataLoader, TensorDataset

import lightning_ckpt
from lightning_ckpt import ShardedCheckpointIO, ShardedModelCheckpoint, load_checkpoint, load_from_checkpoint
from lightning_ckpt.cli import main as cli

console = Console()
OUT = os.path.abspath("demo-output")


class Regressor(LightningModule):
    """A 6.3M-parameter MLP (the defaults): big enough that a checkpoint is 76 MB (25 MB of fp32
    weights + 51 MB of AdamW moments), split into 20 MB shards; the figures the demo prints."""

    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[torch.nn.Module] = [torch.nn.Linear(32, width), torch.nn.GELU()]
        for _ in range(depth - 2):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)}

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2048, 32, generator=gen)
        return DataLoader(TensorDataset(x, x.sin().sum(1, keepdim=True)), batch_size=128)


def trainer(max_epochs: int) -> Trainer:
    return Trainer(
        max_epochs=max_epochs,
        default_root_dir=OUT,  # whatever a run writes besides checkpoints lands here, not in the working directory
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[ShardedCheckpointIO(max_shard_size="20MB")],
        callbacks=[
            # A line per save (stall, bytes, durable time, memory) and a summary table at the end.
            ShardedModelCheckpoint(
                dirpath=OUT, every_n_train_steps=8, save_top_k=2, monitor="train_loss", save_last=True, verbose=True
            )
        ],
    )


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    seed_everything(0)
    console.rule(f"lightning_ckpt {lightning_ckpt.__version__}: training 2 epochs, a checkpoint every 8 steps")
    trainer(2).fit(Regressor())
    kept = sorted(n for n in os.listdir(OUT) if n.endswith(".ckpt"))
    console.print(f"checkpoints kept in {OUT}: {kept} (top-2 by train_loss + last)")

    console.rule("what a checkpoint directory holds")
    last = os.path.join(OUT, "last.ckpt")
    cli(["inspect", last])
    cli(["verify", last])

    console.rule("resume from ckpt_path='last' for 1 more epoch")
    start = time.perf_counter()
    checkpoint = load_checkpoint(last)
    console.print(
        f"  load_checkpoint: step {checkpoint['global_step']}, epoch {checkpoint['epoch']} in"
        f" {time.perf_counter() - start:.3f} s (tensors are memory-mapped; bytes are read when used)"
    )
    resumed = trainer(3)
    resumed.fit(Regressor(), ckpt_path="last")
    console.print(f"  resumed run finished at global step {resumed.global_step}")

    console.rule("a LightningModule straight from a checkpoint directory")
    model = load_from_checkpoint(Regressor, last)
    console.print(f"  load_from_checkpoint(Regressor, 'last.ckpt') -> width={model.hparams.width}, "
                  f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
