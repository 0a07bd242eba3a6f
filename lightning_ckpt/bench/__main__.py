"""``python -m lightning_ckpt.bench [...]``: the same as ``python -m lightning_ckpt bench [...]``."""

import sys

from lightning_ckpt.bench import main

sys.exit(main())
