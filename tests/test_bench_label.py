"""The label benchmark runs on tiny models (in seconds): the CLI writes the ratios JSON, and its check
finds replay and brute force in exact agreement and reports the latency model's rank agreement with the measured
speeds of its own rows. Speed goals are printed by the benchmark, not tested."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from conftest import composed
from pipeline import PROJECT_ROOT
from pipeline.bench_label import bench_label, report


def average_ranks(values: list[float]) -> list[float]:
    """1-based ranks, tied values sharing their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i : j + 1]:
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def ranked_correlation(a: list[float], b: list[float]) -> float | None:
    """Spearman's rho as Pearson's r of average ranks (None when a side is constant)."""
    if len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return statistics.correlation(average_ranks(a), average_ranks(b))


def fastest(candidates: list[int], tokens_per_s: list[float]) -> int:
    """The fastest candidate, the smaller B on ties."""
    best = max(tokens_per_s)
    return min(b for b, v in zip(candidates, tokens_per_s) if v == best)


def test_latency_rank_agreement_on_a_constructed_case():
    """Known values: one swapped pair of five (rho 0.9, Kendall 0.8), a reversed order (-1, -1), a constant
    prediction (skipped by both correlations; its tie goes to the smaller B, which is the measured fastest)."""
    from pipeline.bench_label import rank_agreement  # the function the benchmark reports with

    predicted = [[1, 2, 3, 4, 5], [10, 20, 30, 40, 50], [5, 5, 5, 5, 5]]
    measured = [[1, 2, 3, 5, 4], [50, 40, 30, 20, 10], [5, 4, 3, 2, 1]]
    result = rank_agreement(predicted, measured, [[4, 5, 6, 7, 8]] * 3)
    assert result["spearman"] == pytest.approx((0.9 - 1.0) / 2)
    assert result["kendall"] == pytest.approx((0.8 - 1.0) / 2)
    assert result["best_agreement"] == pytest.approx(1 / 3) and result["n_prompts"] == 3
    assert ranked_correlation(predicted[0], measured[0]) == pytest.approx(0.9)  # the test's own reference agrees
    assert ranked_correlation([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # ties: average ranks


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
    assert data["tau_agreement"] == 1.0 and data["label_agreement"] == 1.0 and data["disagreements"] == []
    rows = data["speed_rows"]
    # brute force decoded every prompt once per K=9 candidate (the union, which holds the K=5 set): one measured
    # decode and one latency-model prediction per candidate
    assert sorted(r["id"] for r in rows) == ["b0", "b1", "b2"]
    for r in rows:
        assert r["candidates"] == data["candidates"]["9"]
        assert len(r["measured_decode_ms"]) == len(r["predicted_decode_ms"]) == len(r["predicted_tokens_per_s"]) == 9
        assert all(ms > 0 for ms in r["measured_decode_ms"]) and all(v > 0 for v in r["measured_tokens_per_s"])
    # the rank agreement it reports is the one of its own rows, by an independent Spearman and fastest-B count
    rank = data["latency_rank_agreement"]
    rhos = [rho for r in rows if (rho := ranked_correlation(r["predicted_tokens_per_s"], r["measured_tokens_per_s"])) is not None]
    assert rank["n_prompts"] == 3
    assert rank["spearman"] == pytest.approx(sum(rhos) / len(rhos)) if rhos else math.isnan(rank["spearman"])
    same_best = [fastest(r["candidates"], r["predicted_tokens_per_s"]) == fastest(r["candidates"], r["measured_tokens_per_s"])
                 for r in rows]
    assert rank["best_agreement"] == pytest.approx(sum(same_best) / 3)
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
