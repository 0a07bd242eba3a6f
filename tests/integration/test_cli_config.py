"""ShardedCheckpointIO from a LightningCLI YAML config (class_path / init_args)."""

from __future__ import annotations

import os

import pytest
from models import TinyRegressor

import lightning_ckpt as lc

pytest.importorskip("jsonargparse")


def test_plugin_from_lightning_cli_yaml(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer:
  default_root_dir: {tmp_path}
  max_epochs: 1
  accelerator: cpu
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  plugins:
    - class_path: lightning_ckpt.ShardedCheckpointIO
      init_args:
        max_shard_size: 1MB
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {tmp_path / "ckpts"}
        every_n_train_steps: 2
        save_top_k: -1
        save_last: true
"""
    )
    cli = LightningCLI(TinyRegressor, args=["fit", "--config", str(config)], save_config_callback=None)
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, lc.ShardedCheckpointIO) and io.max_shard_size == 10**6
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert lc.load_checkpoint(tmp_path / "ckpts" / "last.ckpt", verify=True)["global_step"] == 4


def test_shipped_example_config_runs(tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "cli_train.py"), "fit", "--config",
         os.path.join(root, "examples", "config.yaml")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert os.listdir(tmp_path) == ["demo-output"]  # what .gitignore ignores in the repository
    out = tmp_path / "demo-output" / "cli" / "checkpoints"
    kept = sorted(n for n in os.listdir(out) if n.endswith(".ckpt"))
    assert "last.ckpt" in kept and len(kept) == 3, kept  # top-2 by train_loss + last
    for name in kept:
        lc.verify_checkpoint(out / name)
    run = tmp_path / "demo-output" / "cli" / "lightning_logs" / "version_0"  # the CSVLogger's run folder
    assert (run / "ckpt_metrics.jsonl").exists() and "ckpt/stall_s" in (run / "metrics.csv").read_text()
    assert "ckpt" in proc.stdout and "checkpoint saves" in proc.stdout  # rich per-save lines and summary


@pytest.mark.parametrize(("value", "mode"), [("auto", "auto"), ("true", "auto"), ("false", "never"), ("always", "always")])
def test_release_memory_from_lightning_cli_yaml(tmp_path, value, mode):
    """The option's ``Union[bool, Literal[...]]`` annotation parses from YAML as a bool or a mode."""
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer:
  logger: false
  callbacks:
    - class_path: lightning_ckpt.ShardedModelCheckpoint
      init_args:
        dirpath: {tmp_path / "ckpts"}
        release_memory: {value}
        release_threshold_mb: 64
"""
    )
    cli = LightningCLI(TinyRegressor, args=["--config", str(config)], run=False, save_config_callback=None)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, lc.ShardedModelCheckpoint)]
    assert callback.release_memory == mode and callback.release_threshold_mb == 64
