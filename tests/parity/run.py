"""Parity harness: Lightning's own checkpoint tests, stock and with our callback / CheckpointIO.

    python tests/parity/run.py --src /path/to/pytorch-lightning [--ref 2.6.6] [--modes stock,io]

Copies the pinned tests out of a git checkout (or bare clone) of Lightning into
``tests/parity/.cache/`` (git-ignored: Lightning's code is never committed here; no PyPI sdist
ships the tests), runs them once per mode (see ``parity_plugin.py``), prints a table of counts and
every test that passes stock but not with our classes, and writes everything to ``--json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ("stock", "callback", "io")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
# What is run, and what those tests import from Lightning's test tree.
SUITE = ("tests/tests_pytorch/checkpointing/", "tests/tests_pytorch/callbacks/test_model_checkpoint")
SUPPORT = (
    "pyproject.toml",  # Lightning's pytest settings (strict markers, FutureWarning as error, ...)
    "src/version.info",
    "tests/tests_pytorch/__init__.py",
    "tests/tests_pytorch/conftest.py",
    "tests/tests_pytorch/helpers/",
    "tests/tests_pytorch/callbacks/__init__.py",
    "tests/legacy/back-compatible-versions.txt",  # read at import by test_legacy_checkpoints.py
)


def git(src: Path, *args: str) -> bytes:
    result = subprocess.run(["git", "-C", str(src), *args], capture_output=True, check=False)
    if result.returncode != 0:
        sys.exit(f"git {' '.join(args)} failed in {src}: {result.stderr.decode().strip()}")
    return result.stdout


def extract(src: Path, ref: str, cache: Path) -> tuple[Path, str]:
    """Lightning's tests at ``ref`` under ``cache``; returns (folder, commit)."""
    probe = subprocess.run(["git", "-C", str(src), "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        sys.exit(f"{src}: no commit or tag {ref!r} (git -C {src} fetch --tags, or pass another ref)")
    commit = probe.stdout.strip()
    dest = cache / f"lightning-{ref}"
    stamp = dest / ".extracted"
    if stamp.is_file() and stamp.read_text() == commit:
        return dest, commit
    listing = git(src, "ls-tree", "-r", "--name-only", commit, "--", *{p.split("/", 1)[0] for p in SUITE + SUPPORT})
    wanted = [p for p in listing.decode().splitlines() if p.startswith(SUITE + SUPPORT)]
    # `git archive` may warn about unrelated missing blobs in partial clones; the listed paths are complete.
    archive = subprocess.run(["git", "-C", str(src), "archive", "--format=tar", commit, "--", *wanted],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    stamp.write_text(commit)
    return dest, commit


def run_mode(mode: str, root: Path, results: Path, timeout: int, budget: int, select: str | None) -> dict[str, Any]:
    """One pytest session in ``mode``; returns its exit status, duration and per-test outcomes."""
    tests = sorted(str(p.relative_to(root)) for s in SUITE for p in root.glob(s + ("" if s.endswith("/") else "*.py")))
    outcomes, log = results / f"{mode}.json", results / f"{mode}.log"
    outcomes.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", *tests, "-p", "parity_plugin", "-p", "no:cacheprovider",
               "-q", "-rfE", "--color=no", f"--timeout={timeout}",
               "-c", str(root / "pyproject.toml"), "--rootdir", str(root), "--confcutdir", str(root)]
    if select:
        command += ["-k", select]
    env = dict(os.environ, PARITY_MODE=mode, PARITY_OUTCOMES=str(outcomes),
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    with log.open("w") as out:
        try:
            status = subprocess.run(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=budget, check=False).returncode
        except subprocess.TimeoutExpired:
            status = -1  # whole-session guard; the outcomes file is then missing
    seconds = round(time.monotonic() - start, 1)
    tests_run = json.loads(outcomes.read_text()) if outcomes.is_file() else {}
    return {"exit": status, "seconds": seconds, "log": str(log), "tests": tests_run}


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    counts = {m: {o: sum(t["outcome"] == o for t in r["tests"].values()) for o in OUTCOMES} for m, r in runs.items()}
    stock = runs.get("stock", {}).get("tests", {})
    regressions: dict[str, list[dict[str, str]]] = {}
    for mode, run in runs.items():
        if mode == "stock":
            continue
        regressions[mode] = [
            {"test": test, "outcome": run["tests"].get(test, {}).get("outcome", "missing"),
             "message": run["tests"].get(test, {}).get("message", "")}
            for test, result in sorted(stock.items())
            if result["outcome"] == "passed" and run["tests"].get(test, {}).get("outcome") != "passed"
        ]
    return {"counts": counts, "regressions": regressions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="git checkout or bare clone of pytorch-lightning")
    parser.add_argument("--ref", help="tag or commit (default: the installed lightning's version)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    parser.add_argument("--budget", type=int, default=5400, help="seconds per mode, whole session")
    parser.add_argument("--jobs", type=int, default=1, help="modes run at the same time")
    parser.add_argument("-k", dest="select", help="pytest -k expression (a subset, for debugging)")
    parser.add_argument("--cache", type=Path, default=HERE / ".cache")
    parser.add_argument("--json", type=Path, default=HERE / ".cache" / "results.json")
    args = parser.parse_args()

    import lightning
    import torch

    ref = args.ref or lightning.__version__
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    root, commit = extract(args.src.resolve(), ref, args.cache.resolve())
    tested_version = (root / "src" / "version.info").read_text().strip()
    if tested_version != lightning.__version__:
        print(f"warning: tests of Lightning {tested_version} run against installed {lightning.__version__}")
    results = args.cache.resolve() / "results"
    results.mkdir(parents=True, exist_ok=True)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {m: pool.submit(run_mode, m, root, results, args.timeout, args.budget, args.select) for m in modes}
        runs = {m: f.result() for m, f in futures.items()}
    summary = summarize(runs)

    print(f"\nLightning tests {ref} ({commit[:10]}), lightning {lightning.__version__}, torch {torch.__version__}")
    print(f"{'mode':<10}" + "".join(f"{o:>9}" for o in OUTCOMES) + f"{'seconds':>9}  exit")
    for mode, run in runs.items():
        row = "".join(f"{summary['counts'][mode][o]:>9}" for o in OUTCOMES)
        print(f"{mode:<10}{row}{run['seconds']:>9}  {run['exit']}")
    for mode, tests in summary["regressions"].items():
        print(f"\n{mode}: {len(tests)} test(s) pass stock but not here")
        for entry in tests:
            print(f"  {entry['outcome']:<8} {entry['test']}\n           {entry['message'][:200]}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"lightning_tests": {"ref": ref, "commit": commit, "version": tested_version},
              "lightning": lightning.__version__, "torch": torch.__version__,
              "modes": {m: {k: v for k, v in r.items() if k != "tests"} for m, r in runs.items()},
              **summary, "outcomes": {m: r["tests"] for m, r in runs.items()}}
    args.json.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    main()
