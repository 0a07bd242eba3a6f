"""What kind of checkpoint a folder holds, told from its file names alone.

Importing this module imports no reader: ``torch.distributed.checkpoint`` (and DTensor with it, about
0.6 s of import) is needed only for a stock DCP folder, so callers decide here and import
``format.legacy`` for those folders alone (the CLI's start-up, a resume from our own format).
"""

from __future__ import annotations

import os
import re

from lightning_ckpt.format.manifest import MANIFEST_FILE

METADATA_FILE = ".metadata"  # DCP's
META_FILE = "meta.pt"  # Lightning's: the checkpoint dict less the DCP part
_DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")  # DCP FileSystemWriter: __<rank>_<file index>.distcp


def is_dcp_checkpoint(path: str) -> bool:
    """A folder with DCP's ``.metadata`` and no lightning_ckpt manifest."""
    return os.path.isfile(os.path.join(path, METADATA_FILE)) and not os.path.exists(os.path.join(path, MANIFEST_FILE))


def file_rank(name: str) -> int:
    """The global rank that wrote file ``name`` of a DCP folder: ``r`` for ``__<r>_<i>.distcp``, else 0."""
    match = _DATA_FILE.fullmatch(name)
    return int(match.group(1)) if match else 0
