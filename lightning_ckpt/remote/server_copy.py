"""Incremental saves to object storage: files of a new remote checkpoint that an earlier
checkpoint of this process already published are copied on the server (S3 ``CopyObject``,
fsspec ``copy``) into the new generation instead of being uploaded again.

Why a copy and not a reference to the earlier object: every remote checkpoint stays complete on
its own. Deleting any other one (top-k retention, ``remove_checkpoint``, a lifecycle rule, a
user's ``aws s3 rm``) never breaks it, readers need nothing new, and no retention has to keep
referenced objects alive. A server-side copy moves no byte through this machine; the store
keeps one object per checkpoint, as it does today.

Which files: exactly those ``incremental.Tracker`` proves unchanged (``incremental.Reused.remote``
names the earlier checkpoint's URL and file). The copy is made only when that checkpoint's
committed generation still lists the file with the same size and digest, stored with the same
encoding; otherwise the file is uploaded from its local copy, and a save that has none (a spool
save: the file was never written) fails with nothing committed.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from fsspec import AbstractFileSystem

from lightning_ckpt.errors import CheckpointError
from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.remote.commit import Committed, read_committed
from lightning_ckpt.remote.transfer import RemoteOptions
from lightning_ckpt.store.reuse import Reused


@dataclass
class ServerCopies:
    """The files of one publication to copy from earlier checkpoints (see the module docstring); a
    ``remote.commit.CopySource``."""

    sources: dict[str, tuple[str, str]]  # file -> (earlier checkpoint's URL, file name there)
    absent: frozenset[str]  # files with no local copy: copied, or the publication fails
    options: RemoteOptions
    copied: dict[str, int] = field(default_factory=dict)  # file -> object bytes copied
    _committed: dict[str, Committed | None] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def of(cls, reuse: Mapping[str, Reused] | None, options: RemoteOptions) -> ServerCopies | None:
        sources = {name: r.remote for name, r in (reuse or {}).items() if r.remote is not None}
        if not sources:
            return None
        absent = frozenset(name for name, r in (reuse or {}).items() if r.id is None)
        return cls(sources, absent, options)

    def copy(self, fs: AbstractFileSystem, name: str, record: fmt.FileRecord, encoding: str | None, target: str) -> int | None:
        """Copy file ``name`` (``record``, stored with ``encoding``) to the object ``target`` on the
        server; its object size, or ``None`` when it is not to be or cannot be copied."""
        if name not in self.sources:
            return None
        url, source_name = self.sources[name]
        committed = self._committed_of(url)
        listed = None if committed is None else committed.manifest.files.get(source_name)
        if committed is None or listed is None or (listed.size, listed.digest) != (record.size, record.digest):
            return None
        path, stored_as = committed.object_of(source_name)
        if stored_as != encoding:
            return None
        try:
            fs.copy(path, target)
        except FileNotFoundError:  # replaced or removed since: the caller uploads it, or fails
            return None
        size = committed.objects[source_name]["size"] if encoding else record.size
        with self._lock:
            self.copied[name] = size
        return size

    def _committed_of(self, url: str) -> Committed | None:
        with self._lock:
            if url not in self._committed:
                try:
                    self._committed[url] = read_committed(url, self.options)
                except (CheckpointError, OSError):
                    self._committed[url] = None
            return self._committed[url]
