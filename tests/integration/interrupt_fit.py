"""Run by test_interrupt.py: trains with async saves every step until it receives SIGINT."""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import TinyRegressor, trainer_kwargs  # noqa: E402

import lightning_ckpt as lc  # noqa: E402


class ReportWriterPid(Callback):
    """After a few saves, write the writer process id where the test can see it; slow down."""

    def __init__(self, io: lc.ShardedCheckpointIO, pid_file: str) -> None:
        self.io, self.pid_file = io, pid_file

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == 3 and self.io.async_saver.worker.pid is not None:
            with open(self.pid_file + ".tmp", "w") as f:
                f.write(str(self.io.async_saver.worker.pid))
            os.replace(self.pid_file + ".tmp", self.pid_file)
        time.sleep(0.05)


def main(out: str, pid_file: str) -> None:
    io = lc.ShardedCheckpointIO(async_save=True)
    checkpoint = ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=2, monitor="train_loss", save_last=True)
    trainer = Trainer(max_epochs=10_000, callbacks=[checkpoint, ReportWriterPid(io, pid_file)], plugins=[io], **trainer_kwargs())
    trainer.fit(TinyRegressor())


if __name__ == "__main__":
    # Ctrl-C in a terminal raises KeyboardInterrupt; a process started in the background by a
    # shell without job control inherits SIGINT ignored, and Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main(sys.argv[1], sys.argv[2])
