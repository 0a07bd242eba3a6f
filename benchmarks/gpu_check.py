"""``make gpu-check`` (``python -m benchmarks.gpu_check``): every CUDA path and GPU figure of the
project in one prepared command, for a borrowed GPU machine with a short lease.

Each step is one existing program (the GPU test tier, or a benchmark with ``--json``) run as a
subprocess with its own timeout, in its own process group, from a temporary working folder; a
step that fails, crashes or hangs is recorded and the next one runs. After every step the results
are written to ``--out`` (default ``$OUT`` or ``gpu-check/``), so a check killed midway still
leaves what it measured:

* ``gpu-check.json``: ``{"device", "torch", ..., "steps": [{"name", "status", "reason", "seconds",
  "timeout_s", "figures", ...}]}``, ``status`` one of ``passed`` / ``failed`` / ``skipped``;
* ``gpu-check.md``: the same as a table to read, then each step's figures;
* ``gpu-check.log``: every step's command and output (its head and tail) under a header;
* ``gpu-check-reports.json``: each benchmark's own ``--json`` report, by step.

Without a CUDA device every GPU step is ``skipped`` with the reason, and the run takes seconds.
The parent process imports nothing but the standard library: torch is only imported by the
environment probe and the steps (a CUDA context held here would stay for the whole check).

The step sizes are chosen to fit one H100 in about eight minutes (the timeouts sum to at most
``DEADLINE_S``); ``--timeout-scale`` stretches them, ``--steps`` picks some, ``--list`` prints the
commands.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The whole check must end inside one 600 s device call, make's own start included.
DEADLINE_S = 580.0
PROBE_TIMEOUT_S = 30.0
MIN_STEP_S = 5.0  # a step with less time left than this is not started
PYTEST_PER_TEST_TIMEOUT_S = 90  # with pytest-timeout only: one hanging test must not take the tier
LOG_HEAD_CHARS = 2_000
LOG_TAIL_CHARS = 10_000
PARSE_TAIL_CHARS = 400_000  # what a parser sees of a step's output
MAX_REPORT_BYTES = 4_000_000  # a benchmark report larger than this is left out of the reports file
FILES = ("gpu-check.json", "gpu-check.md", "gpu-check.log", "gpu-check-reports.json")
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"

Figures = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Produced:
    """What a step's program left: its ``output`` (stdout and stderr, the last
    ``PARSE_TAIL_CHARS``), its ``--json`` report if it wrote one, and its ``folder``."""

    output: str
    report: dict[str, Any] | None
    folder: Path


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a step's parser read: its ``figures``, a one-line ``summary`` for the table, a
    ``problem`` that fails the step although its program exited 0 (a benchmark row that errored,
    a peak over its budget), and ``nothing_ran``: why a step that exited 0 measured nothing
    (then it is ``skipped``, not ``passed``)."""

    figures: Figures = field(default_factory=dict)
    summary: str = ""
    problem: str | None = None
    nothing_ran: str | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """One step: ``argv`` after the Python executable, with ``{work}`` (the step's temporary
    folder, also its working directory) and ``{json}`` (where its report is asked for) filled in
    at run time; ``parse`` reads the figures from what it produced. ``cuda``: skipped without a
    CUDA device. ``from_root``: runs in the repository root instead of its folder (pytest prints
    test ids relative to where it runs), for a program that writes nothing where it runs."""

    name: str
    what: str
    argv: tuple[str, ...]
    timeout_s: float
    parse: Callable[[Produced], Parsed]
    cuda: bool = True
    from_root: bool = False


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a subprocess ended: its exit code (``None`` when it was killed at its timeout), the
    seconds it ran, and its output (stdout and stderr together, in order)."""

    returncode: int | None
    seconds: float
    output: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


# --- running one step -------------------------------------------------------------------------------


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the step's process group, SIGKILL after 3 s: its forked measurement processes
    go with it (an async save's writer process has a session of its own and exits when its socket to
    the killed process closes)."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(argv: Sequence[str], timeout_s: float, cwd: Path, env: dict[str, str], output_path: Path) -> Outcome:
    """Run ``argv`` in ``cwd`` until it exits or ``timeout_s`` passes (then its process group is
    killed). Its output goes to ``output_path`` as it is written (a file, not a pipe: nothing is
    lost when it is killed, and a chatty program never blocks on a full pipe)."""
    start = time.monotonic()
    with open(output_path, "wb") as sink:
        proc = subprocess.Popen(
            list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
            _kill_group(proc)
        except BaseException:  # Ctrl-C: the step's processes must not outlive the check
            _kill_group(proc)
            raise
    seconds = time.monotonic() - start
    data = output_path.read_bytes()
    return Outcome(returncode, seconds, data[-PARSE_TAIL_CHARS:].decode("utf-8", "replace"))


def step_env(work: Path) -> dict[str, str]:
    """The environment of a step: the source tree importable from any folder, unbuffered output,
    no bytecode written into the tree, temporary files inside the check's temporary folder, and
    nothing that would try the network."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update({
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "TMPDIR": str(work),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "COLUMNS": "200",  # rich's progress lines and tables, unwrapped in the log
    })
    return env


# --- the environment probe --------------------------------------------------------------------------

_PROBE = r"""
import importlib.metadata, importlib.util, json, platform, sys
info = {"python": platform.python_version(), "executable": sys.executable}
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
try:
    import torch
except Exception as exc:
    info["error"] = f"torch is not importable: {type(exc).__name__}: {exc}"
else:
    info.update(torch=torch.__version__, cuda_build=torch.version.cuda, cuda=bool(torch.cuda.is_available()))
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), device=props.name,
                    device_memory_gib=round(props.total_memory / 2**30, 1))
info["lightning"] = version("lightning") or version("pytorch-lightning")
info["torchao"] = version("torchao") if importlib.util.find_spec("torchao") else None
info["pytest"] = version("pytest")
info["pytest_timeout"] = version("pytest-timeout") if importlib.util.find_spec("pytest_timeout") else None
print(json.dumps(info))
"""


def probe_environment(work: Path, timeout_s: float) -> dict[str, Any]:
    """Python, torch, CUDA and the optional packages, read in a subprocess; ``error`` if torch
    cannot be imported or the probe failed."""
    outcome = run_command([sys.executable, "-c", _PROBE], timeout_s, work, step_env(work), work / "probe.out")
    lines = [line for line in outcome.output.splitlines() if line.startswith("{")]
    if outcome.returncode == 0 and lines:
        info: dict[str, Any] = json.loads(lines[-1])
    else:
        why = f"timed out after {timeout_s:g} s" if outcome.timed_out else f"exit code {outcome.returncode}"
        info = {"error": f"environment probe {why}: {_last_line(outcome.output)}"}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15, check=False,
        )
        if smi.returncode == 0 and smi.stdout.strip():
            info["nvidia_smi"] = smi.stdout.strip()
    info["probe_seconds"] = round(outcome.seconds, 2)
    return info


def _device_text(env: dict[str, Any]) -> str:
    if env.get("cuda"):
        count = env.get("device_count", 1)
        return f"{env.get('device')} ({env.get('device_memory_gib')} GiB)" + (f" x {count}" if count != 1 else "")
    return "cpu (no CUDA device)"


def _skip_reason(env: dict[str, Any]) -> str | None:
    """Why GPU steps cannot run here, or ``None``."""
    if "error" in env:
        return env["error"]
    return None if env.get("cuda") else NO_CUDA


# --- parsers -----------------------------------------------------------------------------------------


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _r(value: Any, digits: int = 4) -> Any:
    """A float rounded to ``digits`` significant digits (JSON and tables stay readable)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    return value


def _mb(value: Any) -> Any:
    return round(value / 1e6, 1) if isinstance(value, (int, float)) else None


def _compact(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without its ``None`` values (a figure this run did not produce)."""
    return {k: v for k, v in row.items() if v is not None}


def _median(summary: dict[str, Any], key: str) -> Any:
    entry = summary.get(key)
    return _r(entry.get("median")) if isinstance(entry, dict) else _r(entry)


_PYTEST_LINE = re.compile(r"^(\S+::\S+?)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
# tests/gpu/conftest.py: a failure's traceback as it happens, each test's duration after it
_PYTEST_FAILURE = re.compile(r"^--- (\S+) \(\w+\) failed ---\n(.*?)\n--- end \1 ---$", re.M | re.S)
_PYTEST_DURATION = re.compile(r"^  \((\S+): ([0-9.]+) s\)$", re.M)
# ``-v`` writes a test's id when it starts and its outcome on the same line when it ends
_PYTEST_STARTED = re.compile(r"^(\S+\.py::\S+)[ \t]*$", re.M)


def _junit_cases(path: Path) -> list[dict[str, Any]]:
    """Test cases of a pytest JUnit XML file (``junit_family=xunit1``: ``file`` is set)."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("file") or ""
        classname, name = case.get("classname") or "", case.get("name") or ""
        module = file[:-3].replace("/", ".") if file.endswith(".py") else ""
        inner = classname[len(module) + 1 :] if module and classname.startswith(module + ".") else ""
        nodeid = "::".join(p for p in (file or classname, inner, name) if p)
        outcome, message, text = "passed", "", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message, text = ("failed" if child.tag == "failure" else "error"), child.get("message") or "", child.text or ""
                break
            if child.tag == "skipped":
                outcome, message = ("xfailed" if child.get("type") == "pytest.xfail" else "skipped"), child.get("message") or ""
        cases.append({"test": nodeid, "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message, "text": text})
    return cases


def parse_pytest(produced: Produced) -> Parsed:
    """Counts, failing test ids with their short tracebacks, skip reasons and the slowest tests,
    from the JUnit file; from the ``-v`` lines if the run was cut short (then also the test that
    was running). A run in which every test skipped measured nothing."""
    figures: Figures = {}
    output, junit = produced.output, produced.folder / "junit.xml"
    if junit.is_file():
        cases = _junit_cases(junit)
        figures["source"] = "junit"
    else:
        seen = {m.group(1): m.group(2).lower() for m in _PYTEST_LINE.finditer(output)}
        # tests/gpu/conftest.py writes each failure's traceback and each test's duration as they
        # happen, under pytest's node id (relative to the rootdir, the -v lines' to the working
        # folder): matched by file name and test
        def key(test: str) -> str:
            return test.rsplit("/", 1)[-1]

        texts = {key(m.group(1)): m.group(2) for m in _PYTEST_FAILURE.finditer(output)}
        seconds = {key(m.group(1)): float(m.group(2)) for m in _PYTEST_DURATION.finditer(output)}
        cases = [
            {"test": t, "outcome": {"xpass": "passed"}.get(o, o), "seconds": seconds.get(key(t)), "message": "",
             "text": texts.get(key(t), "")}
            for t, o in seen.items()
        ]
        figures["source"] = "pytest -v lines (no JUnit file: the run was cut short)"
        started = [m.group(1) for m in _PYTEST_STARTED.finditer(output)]
        if started and started[-1] not in seen:
            figures["running_when_stopped"] = started[-1]
    counts: dict[str, int] = {}
    for case in cases:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    figures["counts"] = {k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped", "xfailed")}
    failures = [c for c in cases if c["outcome"] in ("failed", "error")]
    figures["failures"] = [
        {"test": c["test"], "message": c["message"][:500], "traceback": c["text"][-1500:]} for c in failures[:20]
    ]
    reasons: dict[str, int] = {}
    for case in cases:
        if case["outcome"] == "skipped":
            reason = case["message"].strip()[:200] or "(no reason)"
            reasons[reason] = reasons.get(reason, 0) + 1
    figures["skip_reasons"] = reasons
    timed = sorted((c for c in cases if (c["seconds"] or 0) >= 0.05), key=lambda c: -c["seconds"])
    figures["slowest"] = [[c["test"], round(c["seconds"], 1)] for c in timed[:8]]
    n = figures["counts"]
    summary = f"{n['passed']} passed, {n['failed']} failed, {n['error']} errors, {n['skipped']} skipped"
    problems = []
    if failures:
        problems.append(f"{len(failures)} failed: " + ", ".join(c["test"].split("::", 1)[-1] for c in failures[:5])
                        + (" ..." if len(failures) > 5 else ""))
    if "running_when_stopped" in figures:
        problems.append(f"stopped while running {figures['running_when_stopped']}")
    problem = "; ".join(problems) or None
    nothing_ran = None
    if not n["passed"] and not failures and n["skipped"]:
        nothing_ran = "every test skipped: " + next(iter(reasons))
    return Parsed(figures, summary, problem, nothing_ran)


def parse_async(produced: Produced) -> Parsed:
    """``--mode async``: per contender the stalls, the time until durable, the steps while
    writing and the memory; the plain pinned copy; the ratios the issue's targets use."""
    if produced.report is None:
        return Parsed(summary="no report")
    results = produced.report["results"]
    figures: Figures = {"state_gb": _r(results.get("state_bytes", 0) / 1e9)}
    rows = {}
    for name, entry in results.get("contenders", {}).items():
        s = entry["summary"]
        rows[name] = _compact({
            "baseline_step_s": _median(s, "baseline_step_median_seconds"),
            "stall_first_s": _median(s, "stall_first_seconds"),
            "stall_steady_s": _median(s, "stall_steady_median_seconds"),
            "stall_with_next_steady_s": _median(s, "stall_with_next_steady_median_seconds"),
            "durable_first_s": _median(s, "durable_first_seconds"),
            "durable_steady_s": _median(s, "durable_steady_median_seconds"),
            "writing_median_x": _median(s, "step_while_writing_steady_median_ratio"),
            "writing_p95_x": _median(s, "step_while_writing_steady_p95_ratio"),
            "peak_rss_mb": _median(s, "peak_rss_mb"),
            "cuda_peak_extra_mb": _median(s, "cuda_peak_extra_mb"),
        })
    figures["contenders"] = rows
    copy = results.get("plain_copy")
    if copy:
        figures["plain_copy"] = {"seconds": _median(copy["summary"], "seconds"), "GBps": _median(copy["summary"], "GBps")}
    ratios = results.get("ratios", {})
    figures["stall_steady_vs_torch_io"] = {k: _r(v) for k, v in (ratios.get("stall_steady_vs_torch_io") or {}).items()}
    figures["sharded_async_vs_dcp_async"] = {k: _r(v) for k, v in (ratios.get("sharded_async_vs_dcp_async") or {}).items()}
    ours, torch_io, dcp = rows.get("sharded_async", {}), rows.get("torch_io", {}), rows.get("dcp_async", {})
    parts = []
    if ours:
        parts.append(f"sharded_async stall {ours.get('stall_steady_s')} s, +next {ours.get('stall_with_next_steady_s')} s,"
                     f" durable {ours.get('durable_steady_s')} s, writing {ours.get('writing_median_x')}/{ours.get('writing_p95_x')}x")
    if torch_io:
        parts.append(f"torch_io stall {torch_io.get('stall_steady_s')} s")
    if dcp:
        parts.append(f"dcp_async stall {dcp.get('stall_steady_s')} s, durable {dcp.get('durable_steady_s')} s")
    if rows.get("async_io"):
        parts.append(f"async_io durable {rows['async_io'].get('durable_steady_s')} s")
    errors = results.get("errors") or []
    figures["errors"] = errors
    return Parsed(figures, "; ".join(parts), "; ".join(errors)[:500] if errors else None)


def _rows(report: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list(report["results"]) if report else []


def parse_offload_optimizers(produced: Produced) -> Parsed:
    """``--mode offload --device cuda``: step time, peak device memory and host bytes per
    optimizer; torchao's row only where it is importable."""
    rows = {
        r["contender"]: _compact({
            "step_s": _r(r.get("median_step_seconds")),
            "peak_device_mb": _mb(r.get("peak_device_bytes")),
            "device_bytes_per_param": _r(r.get("device_bytes_per_param")),
            "host_rss_mb": _mb(r.get("host_rss_bytes")),
            "pinned_mb": _mb(r.get("pinned_bytes")),
            "params": r.get("params"),
        })
        for r in _rows(produced.report)
    }
    figures: Figures = {"contenders": rows}
    if rows and not any(name.startswith("torchao") for name in rows):
        figures["torchao"] = "skipped: torchao is not importable here (its CPUOffloadOptimizer row needs it)"
    summary = "; ".join(
        f"{name}: {row.get('step_s')} s" + (f", {row['peak_device_mb']} MB peak" if "peak_device_mb" in row else "")
        for name, row in rows.items()
    )
    return Parsed(figures, summary)


def parse_offload_fsdp2(produced: Produced) -> Parsed:
    """``--mode offload --fsdp2 --device cuda``: per contender the step, the peak device memory and
    the optimizer's host bytes; ChunkedAdamW on the offloaded shards against torch's AdamW there
    (the issue's target: at most 0.8x). A contender that failed gives its error; it fails the step."""
    rows = {
        r["contender"]: _compact({
            "step_s": _r(r.get("median_step_seconds")),
            "vs_offloaded_adamw": _r(r.get("vs_offloaded_adamw")),
            "peak_device_mb": _mb(r.get("peak_device_bytes")),
            "host_optimizer_mb": _mb((r.get("host_optimizer_bytes_per_rank") or [None])[0]),
            "error": r.get("error"),
        })
        for r in _rows(produced.report)
    }
    failed = [f"{name}: {row['error']}" for name, row in rows.items() if "error" in row and "torchao" not in name]
    summary = "; ".join(
        f"{name}: {row.get('step_s')} s, {row.get('peak_device_mb')} MB peak"
        + (f" ({row['vs_offloaded_adamw']}x offloaded AdamW)" if "vs_offloaded_adamw" in row else "")
        for name, row in rows.items() if "error" not in row
    )  # fmt: skip
    return Parsed({"contenders": rows}, summary, "; ".join(failed) or None)


def parse_offload_save(produced: Produced) -> Parsed:
    """``--mode offload --save --device cuda``: an async save's stall and durable time, what the
    call staged and what came off the device, ``ChunkedAdamW`` against ``AdamW``."""
    rows = {
        r["contender"]: {
            "stall_s": _r(r.get("median_stall_seconds")),
            "durable_s": _r(r.get("median_durable_seconds")),
            "staged_in_call_mb": _mb(r.get("staged_in_call_bytes")),
            "optimizer_d2h_mb": _mb(r.get("optimizer_d2h_bytes")),
            "arena_copied_mb": _mb(r.get("arena_copied_bytes")),
            "copied_on_write_mb": _mb(r.get("copied_on_write_bytes")),
        }
        for r in _rows(produced.report)
    }
    summary = "; ".join(f"{name}: stall {row['stall_s']} s, durable {row['durable_s']} s" for name, row in rows.items())
    return Parsed({"contenders": rows}, summary)


def parse_offload_strategy(produced: Produced) -> Parsed:
    """``--mode offload --strategy --device cuda``: step time against the model resident and the
    allocator's peak against the budget; fails where the strategy's row errored or its peak is
    over the budget."""
    rows: dict[str, Any] = {}
    for r in _rows(produced.report):
        rows[r["contender"]] = _compact({
            "step_s": _r(r.get("median_step_seconds")),
            "vs_resident": _r(r.get("vs_resident")),
            "tokens_per_s": _r(r.get("tokens_per_second")),
            "params": r.get("params"),
            "parameter_mb": _mb(r.get("parameter_bytes")),
            "budget_mb": _mb(r.get("device_memory_budget")),
            "peak_device_mb": _mb(r.get("peak_device_bytes")),
            "streamed_chunks": r.get("streamed_chunks"),
            "slots": r.get("slots"),
            "h2d_mb": _mb(r.get("h2d_bytes")),
            "d2h_mb": _mb(r.get("d2h_bytes")),
            "error": r.get("error"),
        })
    ours = rows.get("ChunkedOffloadStrategy", {})
    problem = None
    if produced.report and not ours:
        problem = "no ChunkedOffloadStrategy row"
    elif ours.get("error"):
        problem = f"ChunkedOffloadStrategy: {ours['error']}"
    elif ours.get("peak_device_mb") and ours.get("budget_mb") and ours["peak_device_mb"] > ours["budget_mb"]:
        problem = f"allocator peak {ours['peak_device_mb']} MB over the budget {ours['budget_mb']} MB"
    if ours.get("peak_device_mb") and ours.get("budget_mb"):
        ours["peak_vs_budget"] = _r(ours["peak_device_mb"] / ours["budget_mb"])
    summary = "; ".join(
        f"{name}: {row.get('step_s')} s" + (f" ({row['vs_resident']}x resident)" if "vs_resident" in row else "")
        + (f", peak {row['peak_device_mb']} / budget {row['budget_mb']} MB" if "budget_mb" in row else "")
        + (f", error: {row['error'][:80]}" if "error" in row else "")
        for name, row in rows.items()
    )
    return Parsed({"contenders": rows}, summary, problem)


_LARGEST_LINE = re.compile(r"(strategy|resident) (\d+) layers \(([\d.]+)M params\): (.+)")


def parse_offload_largest(produced: Produced) -> Parsed:
    """``--mode offload --largest --device cuda``: the largest depth under the budget, streamed
    and resident, and why the next failed; from the progress lines when the search was cut short
    (each depth tried is logged as it finishes)."""
    probes: dict[str, list[Any]] = {}
    for kind, layers, mparams, outcome in _LARGEST_LINE.findall(produced.output):
        probes.setdefault(kind, []).append([int(layers), float(mparams), outcome.strip()[:200]])
    figures: Figures = {"probes": probes}
    rows: dict[str, Any] = {}
    for r in _rows(produced.report):
        rows[r["contender"]] = _compact({
            "largest_layers": r.get("largest_layers"),
            "mparams": _r(r["params"] / 1e6) if r.get("params") else None,
            "params_vs_resident": _r(r.get("params_vs_resident")),
            "step_s": _r(r.get("step_seconds")),
            "peak_device_mb": _mb(r.get("peak_device_bytes")),
            "budget_mb": _mb(r.get("device_memory_budget")),
            "next_layers": r.get("next_layers"),
            "next_reason": (r.get("next_reason") or "")[:300] or None,
        })
    if rows:
        figures["contenders"] = rows
        summary = "; ".join(
            f"{name}: {row.get('largest_layers')} layers ({row.get('mparams')}M params)"
            + (f", {row['params_vs_resident']}x resident" if "params_vs_resident" in row else "")
            for name, row in rows.items()
        )
    else:  # cut short: the deepest that trained so far, per kind
        best = {kind: max((p for p in ps if p[2].startswith("trains")), default=None, key=lambda p: p[0]) for kind, ps in probes.items()}
        figures["largest_so_far"] = {kind: (p[0] if p else None) for kind, p in best.items()}
        summary = "cut short; largest so far: " + ", ".join(f"{k} {v} layers" for k, v in figures["largest_so_far"].items())
    return Parsed(figures, summary)


def parse_fragmentation(produced: Produced) -> Parsed:
    """``--mode fragmentation``: per loop and release policy, the step after a save against the
    median step, allocator retries and peak reserved memory."""
    rows = {}
    problems = []
    for r in _rows(produced.report):
        name = f"{r['scenario']} / {r['policy']}" + (" / expandable" if r["expandable_segments"] else "")
        m = r["metrics"]
        if "error" in m:
            problems.append(f"{name}: {m['error']}"[:200])
        rows[name] = {k: _r(v) for k, v in m.items()}
    summary = "; ".join(
        f"{name}: after save {row.get('after_save_x')}x, retries {row.get('alloc_retries_per_100_steps')}"
        for name, row in rows.items() if "error" not in row
    )
    return Parsed({"configurations": rows}, summary, "; ".join(problems) or None)


def parse_load(produced: Produced) -> Parsed:
    """``--mode load --device cuda``: per contender the seconds, GB/s and ratio to the disk's read
    floor of a resume into CUDA parameters and moments (issue 36: ours <= 1.2x)."""
    rows: dict[str, Any] = {}
    problems = []
    for result in _rows(produced.report):
        for kind, row in result["contenders"].items():
            rows[f"{result['label']} / {kind}"] = _compact({
                "seconds": _r(row["seconds"]), "GBps": _r(row["gbps"]), "vs_read_floor": _r(row["vs_read_floor"]),
                "peak_extra_anon_mb": _r(row["peak_extra_anon_mb"]),
            })  # fmt: skip
        problems += result.get("errors") or []
    ours = {k: v for k, v in rows.items() if k.endswith("/ ShardedCheckpointIO")}
    summary = "; ".join(f"{k}: {v.get('seconds')} s, {v.get('vs_read_floor')}x the read floor" for k, v in ours.items())
    return Parsed({"contenders": rows}, summary, "; ".join(problems)[:300] or None)


# --- the steps ---------------------------------------------------------------------------------------


def _bench(*args: str) -> tuple[str, ...]:
    return ("-m", "benchmarks", *args, "--json", "{json}")


def build_steps(env: dict[str, Any]) -> list[Step]:
    """The steps in the order they run: correctness first, then figures by priority (the steps no
    GPU has run yet and the async saves before the others an H200 run measured). Sizes are
    chosen for one H100 (80 GB, 16 host cores) within each timeout; ``env`` (the probe) adds the
    per-test timeout where pytest-timeout is installed."""
    # pytest-timeout registers itself (an entry point): naming it with -p again is an error
    per_test = (f"--timeout={PYTEST_PER_TEST_TIMEOUT_S}",) if env.get("pytest_timeout") else ()
    return [
        Step(
            "gpu-tests", "the GPU test tier: every CUDA path's tests (pytest -m gpu tests/gpu)",
            ("-m", "pytest", "-m", "gpu", str(ROOT / "tests" / "gpu"), "-v", "--tb=short", "-rfE",
             "-p", "no:cacheprovider", "--basetemp={work}/pytest", "-o", "junit_family=xunit1",
             "--junitxml={work}/junit.xml", *per_test),
            # from the root: ids as tests/gpu/...; nothing lands there (no cache, its temporary
            # folders under --basetemp, no bytecode; each test runs in its own tmp_path)
            # 42 tests: ~200 s on an H200 (2026-11-27), the sharded ones in processes of their own
            240, parse_pytest, from_root=True,
        ),
        Step(
            "offload-fsdp2",
            "ChunkedAdamW on FSDP2 shards, one GPU (134M parameters, bf16 compute, 32768 tokens per step): shards on"
            " the GPU with fused AdamW on the GPU and with ChunkedAdamW; CPUOffloadPolicy with torch's fused CPU"
            " AdamW and with ChunkedAdamW (target: <= 0.8x); torchao if importable: step, peak device memory, host bytes",
            _bench("--mode", "offload", "--fsdp2", "--device", "cuda", "--ranks", "1", "--width", "4096", "--layers", "8",
                   "--batch", "32768", "--chunk-size", "64MiB", "--steps", "3", "--repeats", "1"),
            45, parse_offload_fsdp2,
        ),
        Step(
            "async-saves",
            "async saves in a training loop with the state on the GPU (1 GB): Lightning TorchCheckpointIO and"
            " AsyncCheckpointIO, DCP async_save and ShardedCheckpointIO(async_save=True): stall, steps while"
            " writing, time until durable, memory; one plain pinned copy as the floor",
            _bench("--mode", "async", "--device", "cuda", "--size", "1GB", "--repeats", "1",
                   "--saves", "3", "--every", "4", "--warmup", "6", "--timeout", "40",
                   "--contenders", "torch_io,async_io,dcp_async,sharded_async,plain_copy", "--dir", "{work}/ckpts"),
            90, parse_async,  # 78 s on an H200
        ),
        Step(
            "load-cuda",
            "a resume's load into CUDA parameters and moments (512 MB, cold page cache, each in a fresh process):"
            " the disk's read floor, ShardedCheckpointIO (every byte verified), Lightning TorchCheckpointIO, DCP"
            " in place: seconds, GB/s, ratio to the floor (target: ours <= 1.2x)",
            _bench("--mode", "load", "--device", "cuda", "--sizes", "512MB", "--repeats", "1",
                   "--contenders", "read floor,ShardedCheckpointIO,TorchCheckpointIO,DCP load in place",
                   "--dir", "{work}/ckpts"),
            35, parse_load,  # 21 s on the 2-core CPU machine; not yet run on a GPU
        ),
        Step(
            "offload-optimizers",
            "the optimizer on a 134M-parameter linear stack (bf16 autocast): AdamW fused on the GPU, ChunkedAdamW,"
            " FSDP2 CPUOffloadPolicy on one rank, torchao CPUOffloadOptimizer if importable: step time, peak"
            " device memory, host RSS and page-locked bytes",
            _bench("--mode", "offload", "--device", "cuda", "--width", "4096", "--layers", "8", "--batch", "4096",
                   "--chunk-size", "64MiB", "--steps", "3", "--repeats", "1"),
            20, parse_offload_optimizers,  # 17 s on an H200
        ),
        Step(
            "offload-save",
            "one async ShardedCheckpointIO save after a step, ChunkedAdamW against AdamW fused (134M parameters on"
            " the GPU): stall, durable, bytes staged in the call, optimizer bytes copied off the device",
            _bench("--mode", "offload", "--save", "--device", "cuda", "--width", "4096", "--layers", "8",
                   "--batch", "1024", "--chunk-size", "64MiB", "--steps", "3", "--repeats", "1"),
            40, parse_offload_save,  # 34 s on an H200: two writer processes start
        ),
        Step(
            "offload-strategy",
            "ChunkedOffloadStrategy streaming a bf16 decoder (8 x 2048, 436M parameters, 872 MB) under a 768 MB"
            " budget against the model resident and FSDP2 CPUOffloadPolicy: step time ratio, allocator peak"
            " against the budget, bytes copied",
            _bench("--mode", "offload", "--strategy", "--device", "cuda", "--width", "2048", "--layers", "8",
                   "--heads", "16", "--vocab", "8192", "--sequences", "2", "--seq-len", "512", "--budget", "768MB",
                   "--chunk-size", "128MiB", "--prefetch", "2", "--steps", "3", "--repeats", "1"),
            37, parse_offload_strategy,  # 33 s on an H200
        ),
        Step(
            "offload-largest",
            "the deepest decoder (width 1024) that trains under a 256 MB budget, streamed and resident: depths"
            " doubled then bisected, capped at 16 blocks (time)",
            _bench("--mode", "offload", "--largest", "--device", "cuda", "--width", "1024", "--heads", "8",
                   "--vocab", "4096", "--sequences", "2", "--seq-len", "512", "--budget", "256MB",
                   "--chunk-size", "32MiB", "--steps", "2", "--max-layers", "16"),
            38, parse_offload_largest,  # 36 s on an H200
        ),
        Step(
            "fragmentation",
            "emptying the CUDA cache after saves (never / on_pressure / always / expandable segments) in the"
            " fragmenting loop: the step after a save, allocator retries, peak reserved",
            _bench("--mode", "fragmentation", "--loops", "varying", "--steps", "50", "--every", "10"),
            25, parse_fragmentation,  # 23 s on an H200
        ),
    ]


# --- the check ---------------------------------------------------------------------------------------


def _fill(argv: Sequence[str], work: Path, json_path: Path) -> list[str]:
    return [a.replace("{work}", str(work)).replace("{json}", str(json_path)) for a in argv]


def run_step(step: Step, timeout_s: float, work: Path, log: Callable[[str, str], None]) -> dict[str, Any]:
    """Run ``step`` with ``timeout_s`` in a folder of its own under ``work``; its result entry.
    A parser error never loses the step's outcome: it is recorded in the figures."""
    folder = work / step.name
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / "report.json"
    argv = [sys.executable, *_fill(step.argv, folder, json_path)]
    cwd = ROOT if step.from_root else folder
    outcome = run_command(argv, timeout_s, cwd, step_env(work), folder / "output.txt")
    report = None
    if json_path.is_file():
        with contextlib.suppress(ValueError):
            report = json.loads(json_path.read_text())
    try:
        parsed = step.parse(Produced(outcome.output, report, folder))
    except Exception as exc:  # noqa: BLE001 - a report of an unexpected shape must not stop the check
        parsed = Parsed({"parse_error": f"{type(exc).__name__}: {exc}"}, "figures could not be read")
    status, reason = "passed", ""
    if outcome.timed_out:
        status, reason = "failed", f"timed out after {timeout_s:g} s"
    elif outcome.returncode != 0:
        status, reason = "failed", f"exit code {outcome.returncode}: {_last_line(outcome.output)}"
    if parsed.problem:
        status = "failed"
        reason = f"{reason}; {parsed.problem}" if reason else parsed.problem
    if status == "passed" and parsed.nothing_ran:
        status, reason = "skipped", parsed.nothing_ran
    log(step.name, f"$ {shlex.join(argv)}\n(cwd {cwd}; {status} after {outcome.seconds:.1f} s"
                   f" of {timeout_s:g} s{'; ' + reason if reason else ''})\n\n{_capped(outcome.output)}")
    return {
        "name": step.name,
        "status": status,
        "reason": reason,
        "seconds": round(outcome.seconds, 1),
        "timeout_s": round(timeout_s, 1),
        "figures": parsed.figures,
        "summary": parsed.summary,
        "command": shlex.join(argv),
        "what": step.what,
        "_report": report,
    }


def _capped(text: str) -> str:
    if len(text) <= LOG_HEAD_CHARS + LOG_TAIL_CHARS:
        return text
    cut = len(text) - LOG_HEAD_CHARS - LOG_TAIL_CHARS
    return f"{text[:LOG_HEAD_CHARS]}\n[... {cut} characters cut ...]\n{text[-LOG_TAIL_CHARS:]}"


def _skipped(step: Step, reason: str, timeout_s: float) -> dict[str, Any]:
    return {
        "name": step.name, "status": "skipped", "reason": reason, "seconds": 0.0, "timeout_s": round(timeout_s, 1),
        "figures": {}, "summary": "", "command": shlex.join([sys.executable, *step.argv]), "what": step.what,
    }


class Results:
    """The result files in ``out``, rewritten after every step."""

    def __init__(self, out: Path, header: dict[str, Any]) -> None:
        self.out = out
        self.header = header
        self.reports: dict[str, Any] = {}
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu-check.log").write_text(
            f"gpu-check started {header['started']}\nenvironment: {json.dumps(header['environment'])}\n"
        )

    def log(self, name: str, text: str) -> None:
        with open(self.out / "gpu-check.log", "a") as f:
            f.write(f"\n{'=' * 30} {name} {'=' * 30}\n{text.rstrip()}\n")

    def write(self, steps: list[dict[str, Any]], pending: list[dict[str, Any]]) -> None:
        for step in steps:
            report = step.pop("_report", None)
            if report is not None:
                size = len(json.dumps(report))
                self.reports[step["name"]] = report if size <= MAX_REPORT_BYTES else {"left_out": f"{size} bytes"}
        document = {**self.header, "seconds": round(time.monotonic() - self.header["_start"], 1), "steps": steps + pending}
        document.pop("_start", None)
        _write_atomic(self.out / "gpu-check.json", json.dumps(document, indent=2) + "\n")
        _write_atomic(self.out / "gpu-check.md", render_markdown(document))
        _write_atomic(self.out / "gpu-check-reports.json", json.dumps(self.reports, indent=1) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cell(text: Any, limit: int = 400) -> str:
    text = str(text).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bullets(value: Any, depth: int = 0) -> list[str]:
    pad = "  " * depth
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item and not _flat(item):
                lines += [f"{pad}- {key}:"] + _bullets(item, depth + 1)
            else:
                lines.append(f"{pad}- {key}: {_cell(json.dumps(item) if isinstance(item, (dict, list)) else item, 600)}")
        return lines
    if isinstance(value, list):
        return [line for item in value for line in (_bullets(item, depth) if isinstance(item, dict) else [f"{pad}- {_cell(item, 600)}"])]
    return [f"{pad}- {_cell(value, 600)}"]


def _flat(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return all(not isinstance(v, (dict, list)) for v in items) and len(json.dumps(value)) < 160


def render_markdown(document: dict[str, Any]) -> str:
    """The table a person reads first (step, status, seconds, key figures, reason), then each
    step's figures as lists."""
    env = document["environment"]
    lines = [
        "# GPU check",
        "",
        f"Device: {document['device']}; torch {document['torch']}; lightning {env.get('lightning')};"
        f" Python {env.get('python')}; started {document['started']}; {document['seconds']} s in all"
        f" (deadline {document['deadline_s']:g} s).",
        "",
        "| step | status | seconds | timeout s | key figures | reason |",
        "|---|---|---|---|---|---|",
    ]
    for step in document["steps"]:
        lines.append(
            f"| {step['name']} | {step['status']} | {step['seconds']} | {step['timeout_s']} | {_cell(step['summary'])}"
            f" | {_cell(step['reason'])} |"
        )
    for step in document["steps"]:
        lines += ["", f"## {step['name']}: {step['status']}", "", step["what"], "", f"`{step['command']}`"]
        if step["reason"]:
            lines += ["", f"Reason: {step['reason']}"]
        if step["figures"]:
            lines += [""] + _bullets(step["figures"])
    return "\n".join(lines) + "\n"


def run_check(
    steps: Sequence[Step],
    out: Path,
    *,
    environment: dict[str, Any],
    deadline_s: float = DEADLINE_S,
    timeout_scale: float = 1.0,
    run_anyway: bool = False,
    started: float | None = None,
    work: Path | None = None,
) -> list[dict[str, Any]]:
    """Run ``steps`` in order, each with its timeout (times ``timeout_scale``, cut to what is left
    of ``deadline_s`` since ``started``), writing the results to ``out`` after each; the result
    entries. Without CUDA (``environment``) a CUDA step is skipped unless ``run_anyway``."""
    started = time.monotonic() if started is None else started
    header = {
        "device": _device_text(environment),
        "torch": environment.get("torch"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "deadline_s": deadline_s,
        "timeout_total_s": round(sum(s.timeout_s * timeout_scale for s in steps), 1),
        "environment": environment,
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "_start": started,
    }
    results = Results(out, header)
    no_cuda = _skip_reason(environment)
    done: list[dict[str, Any]] = []

    def pending(after: int) -> list[dict[str, Any]]:
        return [_skipped(s, "not reached: the check stopped before this step (still running or killed)", s.timeout_s * timeout_scale)
                for s in steps[after:]]

    with contextlib.ExitStack() as stack:
        if work is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-")))
        results.write(done, pending(0))
        for index, step in enumerate(steps):
            timeout_s = step.timeout_s * timeout_scale
            left = deadline_s - (time.monotonic() - started)
            if step.cuda and no_cuda and not run_anyway:
                entry = _skipped(step, no_cuda, timeout_s)
            elif left - 2 < MIN_STEP_S:
                entry = _skipped(step, f"no time left: {max(left, 0):.0f} s of the {deadline_s:g} s deadline", timeout_s)
            else:
                print(f"gpu-check: {step.name} (timeout {min(timeout_s, left - 2):.0f} s) ...", file=sys.stderr, flush=True)
                entry = run_step(step, min(timeout_s, left - 2), work, results.log)
            if entry["status"] == "skipped" and not entry["seconds"]:
                results.log(step.name, f"skipped: {entry['reason']}")
            print(f"gpu-check: {step.name}: {entry['status']} ({entry['seconds']} s){' - ' + entry['reason'] if entry['reason'] else ''}",
                  file=sys.stderr, flush=True)
            done.append(entry)
            results.write(done, pending(index + 1))
    return done


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description="Every CUDA path and GPU figure of lightning_ckpt in one command (make gpu-check); without a"
        " CUDA device every step is skipped with its reason.",
    )
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check",
                        help="folder for gpu-check.{json,md,log} and gpu-check-reports.json (default: $OUT, else gpu-check)")
    parser.add_argument("--steps", default=None, help="comma list of steps to run (default: all; see --list)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every step's timeout (default 1)")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S,
                        help=f"seconds the whole check may take; later steps get what is left (default {DEADLINE_S:g})")
    parser.add_argument("--run-anyway", action="store_true",
                        help="run the GPU steps without a CUDA device too (each then fails fast after parsing its"
                        " command line: a check of the commands on a CPU machine)")
    parser.add_argument("--list", action="store_true", help="print the steps, their timeouts and commands, and exit")
    return parser


def _terminated(signum: int, frame: Any) -> None:
    # Steps run in sessions of their own (so that a timeout can end each one's whole group): a
    # SIGTERM to the check must unwind through run_command, which ends the running step's group.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run the check; 1 if a step failed, 0 otherwise (skipped steps included), 2 on bad options."""
    signal.signal(signal.SIGTERM, _terminated)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.timeout_scale <= 0 or args.deadline <= 0:
        parser.error("--timeout-scale and --deadline must be positive")
    started = time.monotonic()
    steps = build_steps({"pytest_timeout": True})
    if args.steps:
        wanted = [name.strip() for name in args.steps.split(",") if name.strip()]
        unknown = sorted(set(wanted) - {s.name for s in steps})
        if unknown:
            parser.error(f"--steps: unknown {', '.join(unknown)} (the steps: {', '.join(s.name for s in steps)})")
    if args.list:
        for step in steps:
            print(f"{step.name} (timeout {step.timeout_s * args.timeout_scale:g} s): {step.what}\n"
                  f"  python {shlex.join(step.argv)}\n")
        print(f"timeouts in all: {sum(s.timeout_s for s in steps) * args.timeout_scale:g} s (+ {PROBE_TIMEOUT_S:g} s for"
              f" the environment probe); deadline {args.deadline:g} s")
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        environment = probe_environment(work, PROBE_TIMEOUT_S)
        print(f"gpu-check: {_device_text(environment)}; torch {environment.get('torch')}"
              f"{'; ' + _skip_reason(environment) if _skip_reason(environment) else ''}", file=sys.stderr, flush=True)
        steps = build_steps(environment)
        if args.steps:
            steps = [s for s in steps if s.name in wanted]
        done = run_check(steps, Path(args.out), environment=environment, deadline_s=args.deadline,
                         timeout_scale=args.timeout_scale, run_anyway=args.run_anyway, started=started, work=work)
    print(f"gpu-check: results in {args.out}/ ({', '.join(FILES)})", file=sys.stderr)
    return 1 if any(entry["status"] == "failed" for entry in done) else 0


if __name__ == "__main__":
    raise SystemExit(main())
