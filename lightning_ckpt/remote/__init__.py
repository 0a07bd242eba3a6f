"""Checkpoints on object storage and every other fsspec filesystem (``s3://``, ``gs://``, ``memory://`` ...).

A save is committed on the local disk first (the ordinary atomic directory of ``writer.py``), then
published. Three jobs, data flowing down this list:

* ``tier``: the local tier (a local copy of each remote checkpoint, or a spool folder), the
  ``Uploader`` thread of synchronous saves, the local copy a load reads;
* ``commit``: publishing and the commit: generations and the ``CURRENT`` pointer, reading what
  is committed, removal and the clean-up of interrupted saves;
* ``transfer``: streaming one object up or down (codecs, digests, retries) and ``RemoteOptions``.

This package re-exports the names the rest of lightning_ckpt and users use; patch a module's own
globals (``commit._cleaned``) on the module that owns them.
"""

from lightning_ckpt.remote.commit import (
    CURRENT_FILE,
    POINTER_FORMAT,
    POINTER_VERSION,
    Committed,
    Published,
    clean_orphans,
    exists,
    fetch,
    listing,
    new_generation,
    publish,
    read_committed,
    read_pointer,
    remove,
    verify,
)
from lightning_ckpt.remote.tier import (
    Uploader,
    local_copy_for_load,
    mark_published,
    prune_local_tier,
    publish_committed,
    published_marker,
    remove_everywhere,
    remove_local_copy,
    spool_removed_on_failure,
    spool_target,
)
from lightning_ckpt.remote.transfer import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PART_SIZE,
    ENCODINGS,
    RemoteOptions,
    is_remote,
    url_key,
    zstd_module,
)

__all__ = [
    "CURRENT_FILE",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "ENCODINGS",
    "POINTER_FORMAT",
    "POINTER_VERSION",
    "Committed",
    "Published",
    "RemoteOptions",
    "Uploader",
    "clean_orphans",
    "exists",
    "fetch",
    "is_remote",
    "listing",
    "local_copy_for_load",
    "mark_published",
    "new_generation",
    "prune_local_tier",
    "publish",
    "publish_committed",
    "published_marker",
    "read_committed",
    "read_pointer",
    "remove",
    "remove_everywhere",
    "remove_local_copy",
    "spool_removed_on_failure",
    "spool_target",
    "url_key",
    "verify",
    "zstd_module",
]
