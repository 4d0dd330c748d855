"""The label benchmark runs on tiny models (in seconds): the CLI writes the ratios JSON, and its check
finds replay and brute force in exact agreement. Speed goals are printed by the benchmark, not tested."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import composed
from pipeline import PROJECT_ROOT
from pipeline.bench_label import bench_label, report


def reference_spearman(a: list[float], b: list[float]) -> float:
    """Pearson correlation of average ranks (ties share the mean of their positions); NaN for a constant side."""
    def ranks(x: list[float]) -> np.ndarray:
        order = sorted(range(len(x)), key=lambda i: x[i])
        out = np.zeros(len(x))
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            out[[order[k] for k in range(i, j + 1)]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


@pytest.fixture
def bench_overrides(tiny, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = ["def add(a, b):", "Natalia sold clips to 48 of her friends", "Write a function that returns the sum"]
    prompts.write_text("".join(json.dumps({"id": f"b{i}", "turns": [t]}) + "\n" for i, t in enumerate(texts)))
    return [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'trained')}",
            f"data.sets=[{{name:tiny,source:'{prompts}'}}]", "data.limit=null", "num_prompts=3",
            "decode.max_new_tokens=16", "label.latency.context_buckets=[8,32]", "label.latency.repeats=1",
            "logger.enabled=false"]


def test_bench_label_cli_writes_ratios_and_agreement(bench_overrides, tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    cmd = [sys.executable, "-m", "pipeline.bench_label", *bench_overrides, "check=true", f"out={out}", "num_threads=1",
           f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["replay_over_ar"]) == set(data["brute_over_ar"]) == {"5", "9"}
    assert data["candidates"] == {"5": [6, 7, 8, 9, 10], "9": list(range(4, 13))}
    assert all(v > 0 for v in [*data["replay_over_ar"].values(), *data["brute_over_ar"].values()])
    # brute force decodes once per candidate, and the K=9 set contains the K=5 set
    assert data["brute_over_ar"]["9"] > data["brute_over_ar"]["5"]
    assert data["tau_agreement"] == 1.0 and data["label_agreement"] == 1.0 and data["disagreements"] == []
    assert len(data["speed_rows"]) == 3 and len(data["speed_rows"][0]["predicted_tokens_per_s"]) == 9
    # the cost model's rank agreement is the speed rows' own, recomputed independently (average ranks, first maximum)
    rank, rows = data["latency_rank_agreement"], data["speed_rows"]
    rhos = [r for row in rows if not math.isnan(r := reference_spearman(row["predicted_tokens_per_s"],
                                                                         row["measured_tokens_per_s"]))]
    assert rank["n_prompts"] == 3 and rank["spearman"] == pytest.approx(sum(rhos) / len(rhos))
    best = [row["candidates"][int(np.argmax(row["predicted_tokens_per_s"]))]
            == row["candidates"][int(np.argmax(row["measured_tokens_per_s"]))] for row in rows]
    assert rank["best_agreement"] == pytest.approx(sum(best) / len(best))
    assert "replay" in result.stdout and "tau_agreement 1.000" in result.stdout


def test_bench_check_agrees_at_temperature(bench_overrides, trained_decoder):
    overrides = [*bench_overrides, "check=true", "decode.temperature=0.9", "decode.seed=5", "num_prompts=2", "ks=[9]"]
    with composed("bench_label", overrides) as cfg:
        results = bench_label(cfg, decoder=trained_decoder)
    assert results["n_prompts"] == 2 and list(results["replay_over_ar"]) == [9]
    assert results["tau_agreement"] == 1.0 and results["label_agreement"] == 1.0
    text = report(results)
    assert "K=9" in text and "tau_agreement 1.000" in text


def test_bench_needs_a_drafter(bench_overrides, tiny):
    with composed("bench_label", bench_overrides) as cfg:
        with pytest.raises(ValueError, match="needs a drafter"):
            bench_label(cfg, decoder=tiny.decoder("llama", kind=None))


def test_bench_reports_where_replay_and_brute_force_part(bench_overrides, trained_decoder, monkeypatch):
    """A planted disagreement (brute force pretends one draft fewer was accepted at B=8's first step)."""
    import pipeline.bench_label as bench

    real = bench.brute_force

    def skewed(decoder, prefill, candidates, config, consume=False):
        result = real(decoder, prefill, candidates, config, consume)
        stats = result.stats.get(8)
        if stats is not None and stats.taus and stats.taus[0] >= 2:
            stats.taus = [stats.taus[0] - 1, *stats.taus[1:]]
        return result

    monkeypatch.setattr(bench, "brute_force", skewed)
    with composed("bench_label", [*bench_overrides, "check=true", "ks=[9]", "num_prompts=2"]) as cfg:
        results = bench.bench_label(cfg, decoder=trained_decoder)
    assert 0 < len(results["disagreements"]) <= 2
    assert results["tau_agreement"] == pytest.approx(1 - len(results["disagreements"]) / 18)
    first = results["disagreements"][0]
    assert (first["block_size"], first["step"], first["lossless"]) == (8, 0, True)
    assert first["brute_tau"] == first["replay_tau"] - 1
    assert first["target_gap"] >= 0 and first["draft_gap"] >= 0
    assert "target gap" in report(results)


def test_bench_check_reports_the_output_agreement_with_b1_and_the_dtype(bench_overrides, tiny):
    """Issue 15 item 10: the check reports, with the dtype, how many (prompt, B) decodes equal the B=1 output, here
    in bfloat16 (where batch-variant rounding may break exact equality), against an independent count."""
    from pipeline.decoding import DecodeConfig, SpeculativeDecoder
    from pipeline.models.drafter import DFlashDrafter
    from pipeline.models.target import load_target
    from pipeline.prompts import chat_input_ids, load_prompt_sets

    import torch

    target = load_target(str(tiny.target_dir("llama")), dtype="bfloat16")
    drafter = DFlashDrafter.from_pretrained(tiny.drafter_dir("llama", "trained"), dtype=torch.bfloat16)
    decoder = SpeculativeDecoder(target, drafter)
    with composed("bench_label", [*bench_overrides, "check=true", "ks=[5]"]) as cfg:
        results = bench_label(cfg, decoder=decoder)
        prompts = load_prompt_sets(cfg.data.sets)
    config = DecodeConfig(16)
    equal = pairs = 0
    for prompt in prompts:
        ids = chat_input_ids(target.tokenizer, prompt.turns[:1])
        ar = decoder.generate(ids, 1, config).output_ids
        for b in results["candidates"][5]:
            pairs += 1
            equal += decoder.generate(ids, b, config).output_ids == ar
    assert results["dtype"] == "bfloat16" and results["pairs"] == pairs == 15
    assert results["output_agreement"] == pytest.approx(equal / pairs)
    assert f"bfloat16: speculative output == B=1 output in {equal / pairs:.3f} of 15" in report(results)
