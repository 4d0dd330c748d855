"""The step benchmark runs on tiny models (seconds): the CLI writes the JSON with the documented keys and
a Markdown table. Speed goals are printed by the benchmark, not tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from pipeline import PROJECT_ROOT
from pipeline.models.backend import batch_invariant, resolve_backend


def test_bench_step_cli_writes_the_documented_keys(tiny, tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, "-m", "pipeline.bench_step", f"model.target={tiny.target_dir('llama')}",
           f"model.drafter={tiny.drafter_dir('llama', 'trained')}", "contexts=[16,40]", "widths=[1,2,8]",
           "block_sizes=[2,8]", "repeats=2", "warmup=1", "num_threads=1", "'backends=[auto,eager]'",
           "'kv_caches=[dynamic,preallocated]'", "model.draft_precision=exact",
           f"out={out}", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    result = subprocess.run(" ".join(cmd), shell=True, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    keys = ("ar_ms", "forward_ms", "drafter_ms", "step_ms", "step_over_ar")
    auto = resolve_backend("auto", "cpu", torch.float32)  # smallm where the kernel builds, else the fallback
    assert data["backend"] == auto and set(data["by_backend"]) == {auto, "eager"}
    for name, fig in data["by_backend"].items():  # the forward path that ran, and whether it is batch-invariant
        assert fig["forward_path"]["backend"].split(":")[0] == name
        assert fig["forward_path"]["batch_invariant"] is batch_invariant(name)
        assert fig["forward_path"]["drafter"] in ("native exact", "transformers")  # the model's, not auto's choice
    assert data["kv_cache"] == "dynamic" and set(data["by_kv_cache"]) == {"dynamic", "preallocated"}
    assert data["by_kv_cache"]["dynamic"] == data["by_backend"]  # by_backend: the first KV cache's
    assert all(set(per) == {auto, "eager"} for per in data["by_kv_cache"].values())
    assert all(fig["kv_cache"] == kind for kind, per in data["by_kv_cache"].items() for fig in per.values())
    for per in [data, *data["by_backend"].values(), *data["by_kv_cache"]["preallocated"].values()]:
        assert set(per["by_context"]) == {"16", "40"}
        for fig in [per, *per["by_context"].values()]:
            assert set(keys) <= set(fig)
            assert set(fig["forward_ms"]) == {"1", "2", "8"}
            assert set(fig["drafter_ms"]) == set(fig["step_ms"]) == set(fig["step_over_ar"]) == {"2", "8"}
            assert fig["ar_ms"] > 0 and all(v > 0 for v in fig["step_ms"].values())
            assert fig["step_over_ar"]["8"] == fig["step_ms"]["8"] / fig["ar_ms"]
    assert data["by_backend"][auto]["ar_ms"] == data["ar_ms"]  # the top level is the first context of the first backend
    table = out.with_suffix(".md").read_text()
    assert table.startswith("| backend | context | ar_ms") and table.count("\n") == 2 + 8  # 2 caches x 2 backends x 2 L
    assert table.splitlines()[0].endswith("| kv_cache | floor ar (ar/floor) | floor q=8 (q=8/floor) |")
    assert table.count("| preallocated |") == 4
    # the physical floor beside each figure: weights read once at the measured bandwidth, products at the FMA rate
    limits = data["info"]["limits"]
    assert limits["read_gb_s"] > 0 and limits["gflop_s"] > 0 and data["info"]["cpu"]
    for fig in data["by_backend"].values():
        floors = fig["floor_ms"]
        assert fig["weight_mb"] > 0 and 0 < floors["ar_ms"] <= floors["forward_ms"]["8"]
        assert floors["forward_ms"]["1"] == floors["ar_ms"]
