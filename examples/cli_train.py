"""Train from a LightningCLI YAML config with lightning_ckpt's plugin and callback.

    python examples/cli_train.py fit --config examples/config.yaml

Everything it writes goes under ``demo-output/cli/`` (the config's ``default_root_dir``, with the
checkpoints in ``checkpoints/``), relative to the working directory: from the repository root that
is the git-ignored folder the demo also writes to.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo import Regressor  # noqa: E402


def main() -> None:
    LightningCLI(Regressor, save_config_callback=None)


if __name__ == "__main__":
    main()
