"""``python -m benchmarks --mode MODE [...]``, from the repository root."""

import sys

from benchmarks import main

sys.exit(main())
