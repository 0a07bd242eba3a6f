"""``make gpu-check`` (``benchmarks/gpu_check.py``): without CUDA every step is skipped with its
reason and the result files are written; a step that fails, hangs or runs past the deadline never
stops the next; the figures are read from real reports and real pytest runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = {"python": "3", "torch": torch.__version__, "cuda": False}


def _python(code: str) -> tuple[str, ...]:
    return ("-c", code)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie (an orphan waits for whoever reaps
    orphans here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _entries(out: Path) -> dict[str, dict]:
    document = json.loads((out / "gpu-check.json").read_text())
    return {step["name"]: step for step in document["steps"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only mode (with CUDA the check runs for minutes)")
def test_without_cuda_every_step_is_skipped_with_its_reason_and_the_files_are_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 60

    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_check.FILES)
    document = json.loads((out / "gpu-check.json").read_text())
    assert document["device"] == "cpu (no CUDA device)" and document["torch"] == torch.__version__
    steps = document["steps"]
    assert [s["name"] for s in steps] == [s.name for s in gpu_check.build_steps({})]
    for step in steps:
        assert {"name", "status", "reason", "seconds", "timeout_s", "figures"} <= set(step)
        assert step["status"] == "skipped" and step["reason"] == gpu_check.NO_CUDA, step
        assert step["timeout_s"] > 0 and step["figures"] == {}
    # the whole check fits one 600 s device call
    assert sum(s["timeout_s"] for s in steps) + gpu_check.PROBE_TIMEOUT_S <= 600
    assert gpu_check.DEADLINE_S <= 600

    table = (out / "gpu-check.md").read_text()
    assert "| step | status | seconds | timeout s | key figures | reason |" in table
    for step in steps:
        assert f"| {step['name']} | skipped |" in table
    log = (out / "gpu-check.log").read_text()
    assert all(f" {step['name']} " in log for step in steps)


def test_a_step_that_hangs_or_fails_does_not_stop_the_next_and_its_processes_are_ended(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # the hanging step starts a child of its own: the whole process group must end at the timeout
    hang = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{child.pid}} ' + str(__import__('os').getpid()))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    steps = [
        gpu_check.Step("hangs", "sleeps past its timeout", _python(hang), 2.0, gpu_check.parse_async, cuda=False),
        gpu_check.Step("fails", "exits 3", _python("import sys; print('boom'); sys.exit(3)"), 30, gpu_check.parse_async, cuda=False),
        gpu_check.Step("passes", "exits 0", _python("print('fine')"), 30, gpu_check.parse_async, cuda=False),
        gpu_check.Step("needs-cuda", "skipped here", _python("print('never runs')"), 30, gpu_check.parse_async),
    ]
    out = tmp_path / "out"
    started = time.monotonic()

    done = gpu_check.run_check(steps, out, environment=CPU_ONLY)

    assert time.monotonic() - started < 20
    assert [(d["name"], d["status"]) for d in done] == [
        ("hangs", "failed"), ("fails", "failed"), ("passes", "passed"), ("needs-cuda", "skipped"),
    ]
    assert done[0]["reason"] == "timed out after 2 s" and 2 <= done[0]["seconds"] < 10
    assert done[1]["reason"] == "exit code 3: boom"
    assert done[3]["reason"] == gpu_check.NO_CUDA
    assert all(_ended(pid) for pid in map(int, pids.read_text().split()))
    entries = _entries(out)
    assert [entries[name]["status"] for name in ("hangs", "fails", "passes", "needs-cuda")] == ["failed", "failed", "passed", "skipped"]
    log = (out / "gpu-check.log").read_text()
    assert "started" in log and "boom" in log and "fine" in log and "never runs" not in log


def test_the_deadline_cuts_a_step_short_and_skips_the_steps_left_without_time(tmp_path: Path) -> None:
    steps = [
        gpu_check.Step("long", "would take 60 s", _python("import time; time.sleep(60)"), 100, gpu_check.parse_async, cuda=False),
        gpu_check.Step("late", "no time left", _python("print('never runs')"), 100, gpu_check.parse_async, cuda=False),
    ]
    deadline = gpu_check.MIN_STEP_S + 3
    done = gpu_check.run_check(steps, tmp_path, environment=CPU_ONLY, deadline_s=deadline)

    assert done[0]["status"] == "failed" and done[0]["reason"].startswith("timed out after")
    assert done[0]["seconds"] < deadline
    assert done[1]["status"] == "skipped" and done[1]["reason"].startswith("no time left")


def test_a_timeout_scale_applies_to_the_prepared_steps(tmp_path: Path) -> None:
    (step,) = [s for s in gpu_check.build_steps({}) if s.name == "fragmentation"]
    done = gpu_check.run_check([step], tmp_path, environment=CPU_ONLY, timeout_scale=1e-3, run_anyway=True)
    assert done[0]["status"] == "failed" and done[0]["reason"] == f"timed out after {step.timeout_s * 1e-3:g} s"


def _pytest_step(test_file: Path, timeout_s: float) -> gpu_check.Step:
    """The prepared ``gpu-tests`` step with ``test_file`` in place of ``tests/gpu``."""
    (step,) = [s for s in gpu_check.build_steps({}) if s.name == "gpu-tests"]
    argv = tuple(str(test_file) if a == str(ROOT / "tests" / "gpu") else a for a in step.argv)
    assert argv != step.argv
    return gpu_check.Step(step.name, step.what, argv, timeout_s, step.parse, cuda=False, from_root=step.from_root)


def test_test_results_come_from_the_junit_file_with_the_failures_and_their_tracebacks(tmp_path: Path) -> None:
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs two devices')\n"
        "def test_skips(): pass\n"
    )
    (done,) = gpu_check.run_check([_pytest_step(test_file, 60)], tmp_path / "out", environment=CPU_ONLY)

    figures = done["figures"]
    assert done["status"] == "failed" and done["reason"].startswith("exit code 1") and "test_fails" in done["reason"]
    assert figures["source"] == "junit"
    assert figures["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1, "xfailed": 0}
    (failure,) = figures["failures"]
    assert failure["test"].endswith("test_sample.py::test_fails") and "one is not two" in failure["traceback"]
    assert figures["skip_reasons"] == {"needs two devices": 1}


def test_a_test_run_cut_short_names_the_test_it_was_running_and_keeps_the_tracebacks(tmp_path: Path) -> None:
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(
        "import time, pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "def test_hangs(): time.sleep(60)\n"
    )
    # the GPU tier's conftest: failures written as they happen (pytest's summary never comes)
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "gpu" / "conftest.py").read_text())
    (done,) = gpu_check.run_check([_pytest_step(test_file, 8)], tmp_path / "out", environment=CPU_ONLY)

    figures = done["figures"]
    assert done["status"] == "failed" and done["reason"].startswith("timed out after 8 s; 1 failed: test_fails;")
    assert figures["counts"]["passed"] == 1 and figures["counts"]["failed"] == 1
    assert figures["running_when_stopped"].endswith("test_sample.py::test_hangs")
    (failure,) = figures["failures"]
    assert failure["test"].endswith("test_sample.py::test_fails") and "one is not two" in failure["traceback"]


def test_a_tier_that_only_skipped_is_skipped_not_passed(tmp_path: Path) -> None:
    test_file = tmp_path / "test_sample.py"
    test_file.write_text("import pytest\n@pytest.mark.gpu\n@pytest.mark.skip(reason='needs a CUDA device')\ndef test_skips(): pass\n")
    (done,) = gpu_check.run_check([_pytest_step(test_file, 60)], tmp_path / "out", environment=CPU_ONLY)
    assert done["status"] == "skipped" and done["reason"] == "every test skipped: needs a CUDA device"


@pytest.mark.parametrize(
    ("parse", "report", "figure"),
    [
        (gpu_check.parse_async, "bench-async-gpu-results.json", ("contenders", "sharded_async", "durable_steady_s")),
        (gpu_check.parse_offload_save, "bench-offload-save-results.json", ("contenders", "ChunkedAdamW", "stall_s")),
        (gpu_check.parse_offload_strategy, "bench-offload-strategy-results.json", ("contenders", "ChunkedOffloadStrategy", "peak_vs_budget")),
        (gpu_check.parse_offload_largest, "bench-offload-largest-results.json", ("contenders", "ChunkedOffloadStrategy", "largest_layers")),
        (gpu_check.parse_offload_fsdp2, "bench-offload-fsdp2-results.json", ("contenders", "FSDP2 + ChunkedAdamW", "step_s")),
        (gpu_check.parse_fragmentation, "bench-fragmentation-results.json", ("configurations", "varying / never / expandable", "alloc_retries_per_100_steps")),
        (gpu_check.parse_load, "bench-load-results.json", ("contenders", "1GB / ShardedCheckpointIO", "vs_read_floor")),
    ],
)
def test_the_figures_are_read_from_the_benchmarks_recorded_reports(parse, report, figure) -> None:
    """The reports under docs/ are what these programs wrote (the async one on an H100): a renamed
    key in a benchmark would otherwise leave the GPU check's figures silently empty."""
    recorded = json.loads((ROOT / "docs" / report).read_text())
    parsed = parse(gpu_check.Produced("", recorded, ROOT))
    value = parsed.figures
    for key in figure:
        value = value[key]
    assert value is not None and parsed.summary and parsed.problem is None


def test_a_benchmark_cut_short_still_gives_the_figures_of_its_progress_lines() -> None:
    """Lines as ``--mode offload --largest`` logs them (copied from a CPU run), with no report: the
    search was stopped at its timeout."""
    largest = (
        "09:39:58 strategy 1 layers (0.26M params): trains: 0.024 s/step\n"
        "09:40:00 strategy 2 layers (0.46M params): trains: 0.029 s/step\n"
        "09:40:03 resident 1 layers (0.26M params): trains: 0.013 s/step\n"
        "09:40:05 resident 2 layers (0.46M params): peak device memory 63.033 MiB over the budget (61.035 MiB)\n"
        "09:40:07 strategy 4 layers (0.85M params): trains: 0.105 s/step\n"
    )
    parsed = gpu_check.parse_offload_largest(gpu_check.Produced(largest, None, ROOT))
    assert parsed.figures["largest_so_far"] == {"strategy": 4, "resident": 1}
    assert parsed.figures["probes"]["resident"][1] == [2, 0.46, "peak device memory 63.033 MiB over the budget (61.035 MiB)"]

