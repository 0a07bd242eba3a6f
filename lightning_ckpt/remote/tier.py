"""The local tier: a copy of each remote checkpoint on local disk, and the ``Uploader`` thread.

A save is committed on the local disk first (the ordinary atomic directory of ``writer.py``):
in the local tier (``RemoteOptions.local_dir``), kept there up to ``local_keep`` published
checkpoints, or in a spool folder removed once published. A load uses the tier's copy when it is
current, else downloads (into the tier, or a temporary folder removed after loading).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator

from lightning_ckpt.format import manifest as fmt
from lightning_ckpt.format import reader
from lightning_ckpt.remote.commit import (
    CopySource,
    Published,
    fetch,
    publish,
    read_committed,
    read_pointer,
    remove,
)
from lightning_ckpt.remote.transfer import RemoteOptions
from lightning_ckpt.store import commit as writer


def spool_target(root: str | None = None) -> tuple[str, str]:
    """(the local checkpoint directory, the private temporary folder holding it) that a save is
    committed in before it is uploaded, or a load downloads into, without a local tier; under
    ``root``, default the temporary folder."""
    spool = tempfile.mkdtemp(prefix=".lightning_ckpt-spool-", dir=root)
    return os.path.join(spool, "checkpoint"), spool


@contextlib.contextmanager
def spool_removed_on_failure(spool: str | None) -> Iterator[None]:
    """Remove ``spool`` (if any) when the block fails: what it held goes nowhere."""
    try:
        yield
    except BaseException:
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
        raise


_SHARED_MEMORY = "/dev/shm"


def _download_root(nbytes: int) -> str | None:
    """Where a load without a local tier downloads: shared memory when it has room for the
    checkpoint (twice over, so the download cannot starve it), so the objects land straight in
    the pages the loaded tensors map and never touch a disk; else the temporary folder."""
    try:
        free = os.statvfs(_SHARED_MEMORY)
    except OSError:
        return None
    return _SHARED_MEMORY if free.f_bavail * free.f_frsize > 2 * nbytes else None


def published_marker(local: str) -> str:
    """The file beside a local-tier checkpoint that records the remote generation it was published as."""
    folder, name = os.path.split(local)
    return os.path.join(folder, f".{name}.lckpt-published")


def mark_published(local: str, published: Published) -> None:
    """Record that ``local`` is ``published``, unless a newer save replaced it meanwhile."""
    try:
        with open(os.path.join(local, fmt.MANIFEST_FILE), "rb") as f:
            if fmt.digest(f.read()) != published.manifest_digest:
                return  # a newer checkpoint is there now, not uploaded yet
    except FileNotFoundError:
        return
    with open(published_marker(local), "w") as f:
        json.dump({"url": published.url, "generation": published.generation}, f)


def prune_local_tier(local: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` published checkpoints in ``local``'s folder; never one that is not
    published yet (it may be the only copy). Returns what was removed."""

    folder = os.path.dirname(local)
    published = []
    for entry in os.scandir(folder):
        if entry.is_dir() and not entry.name.startswith(".") and os.path.exists(published_marker(entry.path)):
            published.append((entry.stat().st_mtime, entry.path))
    published.sort(reverse=True)
    removed = []
    for _, path in published[keep:]:
        writer.remove_checkpoint(path)
        os.unlink(published_marker(path))
        removed.append(path)
    return removed


def publish_committed(
    local: str, url: str, options: RemoteOptions, spool: str | None, copies: CopySource | None = None
) -> Published:
    """Publish the locally committed checkpoint ``local`` to ``url``; then remove ``spool`` (the
    temporary folder it was committed in), or, in the local tier, mark it published and prune.
    ``copies``: files copied on the server from earlier checkpoints (incremental saves)."""
    try:
        published = publish(local, url, options, copies)
    finally:
        if spool is not None:
            shutil.rmtree(spool, ignore_errors=True)
    if spool is None:
        mark_published(local, published)
        prune_local_tier(local, options.local_keep)
    return published


def remove_everywhere(url: str, options: RemoteOptions) -> None:
    """Remove the remote checkpoint at ``url`` and its local-tier copy."""
    remove(url, options)
    if options.local_dir is not None:
        remove_local_copy(options.local_path(url))


def remove_local_copy(local: str) -> None:

    writer.remove_checkpoint(local)
    try:
        os.unlink(published_marker(local))
    except FileNotFoundError:
        pass


def local_copy_for_load(url: str, options: RemoteOptions) -> tuple[str, Callable[[], None]]:
    """A committed local directory holding ``url``'s checkpoint, and what to call once it is loaded.

    With a local tier: its copy when it is the remote's committed generation, or newer than the
    remote (a save whose upload had not finished); else the remote one is downloaded into the
    tier. Without: the remote one is downloaded into a temporary folder, in shared memory when it
    has room, removed after loading (loaded tensors map its files; unlinking them keeps the mapped
    data valid, and the memory is freed with the tensors).
    """
    if options.local_dir is None:
        local, spool = spool_target(_download_root(read_committed(url, options).manifest.total_bytes))
        with spool_removed_on_failure(spool):
            fetch(url, options, local)
        return local, lambda: shutil.rmtree(spool, ignore_errors=True)
    local = options.local_path(url)
    if _local_copy_is_current(local, url, options):
        return local, lambda: None
    try:
        os.unlink(published_marker(local))
    except FileNotFoundError:
        pass
    fetch(url, options, local)
    return local, lambda: None


def _local_copy_is_current(local: str, url: str, options: RemoteOptions) -> bool:

    if not os.path.exists(os.path.join(local, fmt.MANIFEST_FILE)):
        return False
    fs, root = options.filesystem(url)
    pointer = read_pointer(fs, root, url)
    if pointer is None:
        return True  # never published (the upload was interrupted): the local copy is the newest
    try:
        with open(published_marker(local)) as f:
            if json.load(f).get("generation") == pointer["generation"]:
                return True
    except (OSError, ValueError):
        pass
    remote = read_committed(url, options).manifest
    mine = reader.read_manifest(local)
    # Not the published one: the newer of the two (a local save whose upload did not finish, or
    # a remote one written elsewhere); on a tie the remote, which is committed where it matters.
    return (mine.global_step or -1, mine.epoch or -1) > (remote.global_step or -1, remote.epoch or -1)


class Uploader:
    """Publishes (and removes) local-tier checkpoints on one background thread, in order, so a
    synchronous save returns once it is committed on local disk.

    A removal queued after a publish that failed is skipped (with a warning): the checkpoint it
    would remove may now be the newest one on the remote.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[str, Callable[[], Published | None]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._last_publish_failed = False
        self.errors: list[BaseException] = []
        self.results: list[Published] = []

    def publish(self, job: Callable[[], Published]) -> None:
        self._put("publish", job)

    def remove(self, url: str, job: Callable[[], None]) -> None:
        def remove_unless_replacement_failed() -> None:
            if self._last_publish_failed:
                warnings.warn(f"Kept {url!r}: the save that would have replaced it failed to upload.", stacklevel=1)
                return
            job()

        self._put("remove", remove_unless_replacement_failed)

    def _put(self, kind: str, job: Callable[[], Published | None]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="lightning_ckpt-upload", daemon=True)
            self._thread.start()
        self._jobs.put((kind, job))

    def _run(self) -> None:
        while True:
            kind, job = self._jobs.get()
            try:
                result = job()
                if kind == "publish":
                    self._last_publish_failed = False
                    if result is not None:
                        self.results.append(result)
            except BaseException as err:  # raised in the training thread at the next save or wait
                if kind == "publish":
                    self._last_publish_failed = True
                self.errors.append(err)
            finally:
                self._jobs.task_done()

    @property
    def busy(self) -> bool:
        return self._jobs.unfinished_tasks > 0

    def wait(self) -> None:
        """Block until every queued upload and removal has ended."""
        self._jobs.join()

    def take_errors(self) -> list[BaseException]:
        errors, self.errors = self.errors, []
        return errors
