"""``--mode activations`` (benchmarks/activations.py): the mode is wired, the verdicts judge the
targets, and one tiny measurement of each kind runs in this process."""

from __future__ import annotations

import pytest

import benchmarks as bench  # python -m benchmarks --mode MODE
from benchmarks import activations as bench_activations


def test_bench_mode_activations_is_wired_and_judges_the_targets(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--mode", "activations", "--help"])
    assert exit_info.value.code == 0 and "every 2nd layer" in capsys.readouterr().out
    row = lambda mb, s: {"peak_activation_bytes": mb * 1e6, "step_seconds": s}  # noqa: E731
    verdicts = bench_activations._verdicts({"off": row(100, 1.0), "every layer": row(30, 1.3), "selective": row(70, 1.1)})
    assert verdicts["every_layer_met"] and verdicts["selective_met"]
    assert verdicts["selective_share_of_every_layer_saving"] == pytest.approx(30 / 70)
    assert not bench_activations._verdicts({"off": row(100, 1.0), "every layer": row(30, 1.5), "selective": row(90, 1.0)})["every_layer_met"]


def test_bench_activations_times_every_configuration_on_one_model_and_measures_memory():
    task = {"device": "cpu", "layers": 2, "hidden": 16, "heads": 2, "seq": 8, "batch": 2, "vocab": 32, "steps": 2, "threads": 0}
    timing = bench_activations._measure_time({**task, "configs": bench_activations.CONFIGS, "repeats": 2})
    assert timing["errors"] == {}
    assert [sorted(r) for r in timing["rounds"]] == [sorted(bench_activations.CONFIGS)] * 2
    assert all(len(times) == 2 and all(t > 0 for t in times) for r in timing["rounds"] for times in r.values())
    memory = bench_activations._measure_memory({**task, "options": {"every_n_layers": 2}})
    assert memory["param_bytes"] > 0 and memory["peak_activation_bytes"] >= 0
    bad = bench_activations._measure_time({**task, "configs": {"off": None, "bad": {"every_n_layers": 0}}, "repeats": 2})
    assert set(bad["errors"]) == {"bad"} and all(set(r) == {"off"} for r in bad["rounds"])
