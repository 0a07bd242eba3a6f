"""The post-save slowdown window, computed from step times alone."""

from __future__ import annotations

import pytest

from lightning_ckpt.lightning.monitor import SaveMonitor, SaveRecord


def _record(step_index: int) -> SaveRecord:
    return SaveRecord(0, "x.ckpt", step_index, step_index, 0.5, 0.0, 100, 0.5, 0, 0, 0, 0, False)


def _feed(monitor: SaveMonitor, durations: list[float]) -> list[SaveRecord]:
    closed, now = [], 0.0
    closed += monitor.on_step_start(now)
    for d in durations:
        now += d
        closed += monitor.on_step_start(now)
    return closed


def test_slowdown_and_recovery_steps():
    monitor = SaveMonitor(window=4)
    record = _record(step_index=4)
    monitor.add(record)
    # 4 normal steps, the save step, then 2 slow steps and back to normal.
    closed = _feed(monitor, [1.0, 1.0, 1.0, 1.0, 3.0, 2.0, 1.5, 1.0, 1.0])
    assert closed == [record]
    assert record.pre_step_median_s == pytest.approx(1.0)
    assert record.post_step_median_s == pytest.approx(1.25)  # median of 2.0, 1.5, 1.0, 1.0
    assert record.slowdown == pytest.approx(1.25) and record.recovery_steps == 2
    # The median hides the step right after the save; the worst step and the lost time do not.
    assert record.worst_slowdown == pytest.approx(2.0)
    assert record.lost_s == pytest.approx(2.0 + 1.0 + 0.5 + 0.0 + 0.0)  # save step + window, beyond 1.0 s


def test_window_waits_for_enough_steps_and_finish_closes_it():
    monitor = SaveMonitor(window=10)
    record = _record(step_index=2)
    monitor.add(record)
    assert _feed(monitor, [1.0, 1.0, 5.0, 1.05]) == []
    assert monitor.finish() == [record]
    assert record.recovery_steps == 0 and record.slowdown == pytest.approx(1.05)


def test_validation_time_is_not_a_step():
    monitor = SaveMonitor(window=2)
    monitor.on_step_start(0.0)
    monitor.pause(1.0)  # the step ended when validation started
    monitor.on_step_start(100.0)  # the next training step after a long validation
    monitor.on_step_start(101.0)
    assert monitor.step_times == pytest.approx([1.0, 1.0])


def test_stall_counts_the_call_the_release_and_the_copy_wait():
    record = _record(step_index=0)  # call 0.5 s, release 0 s
    record.release_s = 0.25
    assert record.stall_s == pytest.approx(0.75)  # copy wait not known yet
    record.copy_wait_s = 0.1
    assert record.stall_s == pytest.approx(0.85)
    data = record.as_dict()
    assert data["stall_s"] == pytest.approx(0.85) and data["call_s"] == 0.5 and data["copy_wait_s"] == 0.1
    assert record.metrics()["ckpt/stall_s"] == pytest.approx(0.85) and record.metrics()["ckpt/copy_wait_s"] == 0.1


@pytest.mark.parametrize(
    ("name", "nbytes", "durable_s", "skipped", "released", "expected"),
    [
        # async, as printed at the save: size and durability are known later
        ("epoch=12-step=48000.ckpt", None, None, True, None,
         "ckpt epoch=12-step=48000.ckpt: size pending, stall 14 ms, durable pending, untrimmed heap 1.23 GB"),
        ("epoch=12-step=48000.ckpt", 12_340_000_000, 3.21, False, 1_100_000_000,
         "ckpt epoch=12-step=48000.ckpt: size 12.34 GB, stall 14 ms, durable 3.21 s, heap 1.10 GB released"),
        ("last.ckpt", 103_000_000, 0.52, False, None,
         "ckpt last.ckpt (step 48000): size 103 MB, stall 14 ms, durable 520 ms, trimming heap 1.23 GB"),
    ],
)  # fmt: skip
def test_the_save_line_labels_every_figure_within_100_columns(name, nbytes, durable_s, skipped, released, expected):
    from rich.text import Text

    from lightning_ckpt.lightning.monitor import save_line

    record = SaveRecord(
        3, f"/data/runs/a-long-experiment-name/checkpoints/{name}", 48000, 48000, 0.0123, 0.0021, nbytes, durable_s,
        12_340_000_000, 14_560_000_000, 0, 0, False, heap_left_bytes=1_230_000_000, release_skipped=skipped,
        released_bytes=released,
    )  # fmt: skip
    line = Text.from_markup(save_line(record)).plain
    assert line == expected and len(line) <= 100
