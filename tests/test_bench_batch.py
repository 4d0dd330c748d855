"""The batched benchmark runs on tiny models (seconds): the CLI writes the documented JSON (every concurrency and
method, both arrival patterns) and a Markdown table, and every request's text equals its batch-1 ar text. Speed is
printed by the benchmark, not tested. Bad settings fail before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from pipeline import PROJECT_ROOT
from pipeline.evaluation.batched import FIELDS, bootstrap_ci
from pipeline.evaluation.checks import check_bench_config
from pipeline.policy.calibration import AcceptanceCalibration


def test_bench_batch_cli_writes_the_documented_json(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "turns": [t], "source": "mine"}) for i, t in enumerate(
        ["def add(a, b):", "The quick brown fox", "Natalia sold clips", "def fib(n):", "add two numbers"])) + "\n")
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(AcceptanceCalibration([0.5] * 8, [1.0] * 8).to_dict()))
    out = tmp_path / "batch.json"
    cmd = [sys.executable, "-m", "pipeline.bench_batch", f"model.target={tiny.target_dir('llama')}",
           f"model.drafter={tiny.drafter_dir('llama', 'trained')}", "model.backend=smallm",
           f"'data.sets=[{{name: mine, source: \"{prompts}\"}}]'", "data.limit=null",
           "'bench.concurrency=[1,3]'", "bench.max_new_tokens=12", "bench.rate=50", "bench.bootstrap=50",
           f"policy.verify_width.calibration={calibration}", "'policy.budget.costs.rows=[1,4,8]'",
           "policy.budget.costs.repeats=1", "policy.budget.costs.context=16", f"policy.budget.costs.cache={tmp_path / 'costs'}",
           "'policy.verify_width.latency.context_buckets=[16]'", "policy.verify_width.latency.repeats=1",
           f"policy.verify_width.latency.cache={tmp_path / 'latency'}", "logger.enabled=false",
           "bench.num_threads=1", "bench.warmup=false",
           f"out={out}", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "BLOCKPILOT_SMALLM_EXACT_ROWS": "4"}
    result = subprocess.run(" ".join(cmd), shell=True, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["batch1_ar_tokens_per_s"] > 0 and data["requests"] == 5 and data["arrivals"] == "burst"
    assert set(data["by_arrivals"]) == {"burst", "poisson"} and data["by_concurrency"] == data["by_arrivals"]["burst"]
    assert data["info"]["exact_batching"] is True
    for per_c in data["by_arrivals"].values():
        assert set(per_c) == {"1", "3"}
        for per_m in per_c.values():
            assert set(per_m) == {"ar", "fixed", "verify_width", "budget"}
            for fig in per_m.values():
                assert set(FIELDS) <= set(fig)
                assert fig["exact_match"] == 1.0  # every request's text is its batch-1 ar text
                lo, hi = fig["tokens_per_s_ci"]
                assert 0 < lo <= hi and fig["tokens_per_s"] > 0
                assert fig["new_tokens"] == per_m["ar"]["new_tokens"] <= 5 * 12
                assert fig["ttft_ms_p50"] <= fig["ttft_ms_p99"] and fig["tpot_ms_p50"] <= fig["tpot_ms_p99"]
    assert data["by_concurrency"]["3"]["ar"]["mean_batch"] > data["by_concurrency"]["1"]["ar"]["mean_batch"] == 1.0
    table = out.with_suffix(".md").read_text()
    assert table.startswith("batch-1 ar:") and table.count("| burst |") == 8 and table.count("| poisson |") == 8
    assert list((tmp_path / "costs").glob("batch-costs-*.json"))  # the cost model is cached for the next run


def _cfg(**bench):
    base = {"concurrency": [1, 4], "methods": ["ar"], "arrivals": ["burst"], "rate": 1.0, "max_new_tokens": 8,
            "temperature": 0.0, "bootstrap": 10, "requests": None, "split": None}
    return OmegaConf.create({"bench": {**base, **bench}})


@pytest.mark.parametrize("bench, message", [
    ({"concurrency": []}, "bench.concurrency"), ({"concurrency": [0]}, "bench.concurrency"),
    ({"methods": ["beam"]}, "bench.methods"), ({"arrivals": ["zipf"]}, "bench.arrivals"),
    ({"arrivals": ["poisson"], "rate": 0}, "bench.rate"), ({"max_new_tokens": 0}, "bench.max_new_tokens"),
    ({"temperature": -1}, "bench.temperature"), ({"split": "dev"}, "bench.split"), ({"requests": 0}, "bench.requests")])
def test_bad_settings_fail_before_loading(bench, message):
    with pytest.raises(ValueError, match=message):
        check_bench_config(_cfg(**bench))
    check_bench_config(_cfg())


def test_bootstrap_interval():
    units = [(10.0, 2), (10.0, 4), (20.0, 6)]
    lo, hi = bootstrap_ci(units, 1.0, 200, 0)
    assert 200.0 <= lo <= 12 / 40 * 1e3 <= hi <= 400.0
    assert bootstrap_ci([(10.0, 3)] * 4, 0.5, 20, 0) == [150.0, 150.0]
