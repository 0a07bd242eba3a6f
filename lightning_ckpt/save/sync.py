"""Synchronous saves: ``SyncSaver`` runs a ``job.SaveJob`` in the caller and returns once it is
committed (a URL: published, or committed in the local tier and handed to the upload thread,
``remote.tier.Uploader``). Asks ``changes.Tracker`` what a save may reuse and tells it what
committed."""

from __future__ import annotations

import dataclasses
import time
import warnings

from lightning_ckpt import remote
from lightning_ckpt.errors import CheckpointWriteError
from lightning_ckpt.save import hooks
from lightning_ckpt.save import job as savejob
from lightning_ckpt.save.changes import Tracker, begin_incremental
from lightning_ckpt.save.job import Destination, Prepared
from lightning_ckpt.save.outcomes import Outcomes
from lightning_ckpt.store.commit import WriteResult
from lightning_ckpt.store.shards import ShardWriter


class SyncSaver:
    """Saves in the caller: returns once committed (a URL: published, or committed in the local
    tier and handed to the upload thread)."""

    def __init__(
        self, writer: ShardWriter, options: remote.RemoteOptions, outcomes: Outcomes, tracker: Tracker | None = None
    ) -> None:
        self.writer, self.options, self.outcomes = writer, options, outcomes
        self.tracker = tracker  # incremental saves (``None``: every save writes every file)
        self.uploader = remote.Uploader()
        outcomes.collectors.append(self.collect)
        hooks.register_sync(self)

    def save(self, path: str, prepared: Prepared, start: float) -> WriteResult:
        """Write, commit and publish ``prepared`` at ``path`` (``start``: ``perf_counter`` at the call)."""
        reuse, ticket = begin_incremental(self.tracker, prepared, path, self.options)
        destination = Destination.resolve(path, self.options)
        job = prepared.job(destination, reuse=reuse)
        try:
            result = job.run(self.writer, upload=self.uploader.publish)
        except CheckpointWriteError:
            if self.tracker is None:
                raise
            self.tracker.clear()
            if not any(r.id is None for r in reuse.values()):
                raise
            # A file left on the server could not be copied from the earlier checkpoint (removed
            # behind this plugin's back): nothing was committed; save it whole, once.
            job = prepared.job(Destination.resolve(path, self.options))
            result = job.run(self.writer, upload=self.uploader.publish)
        except BaseException:
            if self.tracker is not None:
                self.tracker.clear()
            raise
        if self.tracker is not None and ticket is not None:
            self.tracker.committed(*ticket[:2], result.stored, *ticket[2:])
        if job.publishes and job.destination.spool is not None:  # durable once published: the whole call
            result = dataclasses.replace(result, path=path, seconds=time.perf_counter() - start)
        self.outcomes.last_save = result
        return result

    def remove(self, path: str) -> None:
        """Remove ``path``; a URL with a local tier behind the uploads in flight."""
        if remote.is_remote(path) and self.options.local_dir is not None:
            self.uploader.remove(path, lambda: savejob.remove(path, self.options))
        else:
            savejob.remove(path, self.options)

    def collect(self) -> None:
        published, self.uploader.results = self.uploader.results, []
        for done in published:  # local tier: uploaded in the background
            self.outcomes.unpolled.append(WriteResult(
                path=done.url, nbytes=done.nbytes, seconds=done.seconds, files=done.files, direct_io=False, reused_bytes=done.copied_bytes
            ))

    def raise_errors(self) -> None:
        """What a background upload raised, per ``on_error``."""
        self.outcomes.report_any(self.uploader.take_errors())

    def wait(self) -> None:
        self.uploader.wait()
        self.raise_errors()

    def finish_at_exit(self) -> None:
        """Interpreter exit: finish the uploads in flight; warn about what failed."""
        try:
            self.uploader.wait()
            for error in self.uploader.take_errors():
                warnings.warn(str(error), stacklevel=1)
        except Exception:  # exiting anyway; the next run cleans up
            pass


__all__ = ["SyncSaver"]
