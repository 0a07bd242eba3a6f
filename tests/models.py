"""A tiny deterministic LightningModule for integration and distributed tests."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, TensorDataset

STEPS_PER_EPOCH = 4


class TinyRegressor(LightningModule):
    """MLP + AdamW + StepLR; records every training loss so resumed runs can be compared."""

    def __init__(self, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    def train_dataloader(self):
        return _loader()

    def val_dataloader(self):
        return _loader()


def _loader() -> DataLoader:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(32, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=32 // STEPS_PER_EPOCH, shuffle=False)


def trainer_kwargs(**overrides):
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(overrides)
    return kwargs


def cli_trainer_yaml(root, max_steps: int = 2) -> str:
    """The ``trainer:`` section of a LightningCLI config for a quiet CPU run (append options to it,
    indented by two spaces)."""
    return f"""
trainer:
  default_root_dir: {root}
  max_steps: {max_steps}
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
"""


def fit_regressor(max_epochs: int, dirpath=None, every_n_train_steps: int = 2, ckpt_path=None, plugin=None, **overrides):
    """Seeded fit of a fresh ``TinyRegressor``; with ``dirpath``, a top-2 + ``last`` ModelCheckpoint
    on ``train_loss`` every ``every_n_train_steps``. Returns (trainer, model)."""
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint

    seed_everything(0, workers=True)
    model = TinyRegressor()
    callbacks = (
        [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=every_n_train_steps, save_top_k=2, monitor="train_loss", save_last=True)]
        if dirpath is not None
        else []
    )
    trainer = Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        plugins=[plugin] if plugin is not None else [],
        **trainer_kwargs(**overrides),
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def fit_chunked(model: LightningModule, strategy=None, ckpt_path=None, trainer=None, **kwargs):
    """``Trainer(**kwargs, strategy=strategy).fit(model)`` (or ``trainer.fit(model)``). No wait for
    ``ChunkedAdamW``'s last step (it runs in the background): Lightning's teardown reads the
    optimizer's state, which waits for it, so the weights are final when ``fit`` returns."""
    from lightning.pytorch import Trainer

    if trainer is None:
        if strategy is not None:
            kwargs["strategy"] = strategy
        trainer = Trainer(**kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


class FrozenBackbone(LightningModule):
    """A frozen backbone (``width``² x ``depth`` weights, eval mode) under a trained head: the
    fine-tuning shape incremental saves are for. Records nothing; deterministic given the seed."""

    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))
        self.backbone.requires_grad_(False).eval()
        self.head = torch.nn.Linear(width, 1)
        self.width = width

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(32, self.width, generator=gen)
        return DataLoader(TensorDataset(x, x.mean(dim=1, keepdim=True)), batch_size=32 // STEPS_PER_EPOCH)
