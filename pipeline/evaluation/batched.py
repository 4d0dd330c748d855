"""The batched decoding benchmark's library (``python -m pipeline.bench_batch`` is its entry point; the figures are
described there): the workload, the batch-1 ``ar`` references, one run per (arrivals, concurrency, method), and the
metrics of each run (tokens/s with the project's one bootstrap interval, TPOT, TTFT, exact match)."""

from __future__ import annotations

import logging
import math
import platform
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from pipeline.evaluation.checks import check_bench_config
from pipeline.evaluation.stats import bootstrap_interval

log = logging.getLogger(__name__)
FIELDS = ("tokens_per_s", "tokens_per_s_ci", "tpot_ms_p50", "tpot_ms_p99", "ttft_ms_p50", "ttft_ms_p99", "exact_match")


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100, linear) of ``values``; NaN when empty."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


def bootstrap_ci(units: list[tuple[float, int]], scale: float, resamples: int, seed: int) -> list[float | None]:
    """95% percentile interval (``pipeline.evaluation.stats.bootstrap_interval``) of sum(tokens) / sum(ms) * 1000 *
    ``scale`` over resamples of ``units`` ((ms, tokens) each: a batched step or a prefill); [None, None] for < 2 units."""
    ms = np.array([u[0] for u in units], dtype=float)
    tok = np.array([u[1] for u in units], dtype=float)
    return bootstrap_interval(lambda idx: tok[idx].sum(1) / np.maximum(ms[idx].sum(1), 1e-9) * 1e3 * scale,
                              len(units), int(resamples), int(seed))


def run_metrics(reqs, batch, references: list[str], tokenizer, resamples: int, seed: int) -> dict:
    """The documented figures of one batched run (see the module doc)."""
    start = min(r.arrived_s for r in reqs)
    end = max(r.finished_s for r in reqs)
    tokens = sum(r.stats.new_tokens for r in reqs)
    wall_s = max(end - start, 1e-9)
    units = [(r.stats.prefill_ms, 1) for r in reqs] + [(ms, n) for ms, n in batch.step_log]
    busy_ms = sum(u[0] for u in units)
    tokens_per_s = tokens / wall_s
    busy_rate = tokens / max(busy_ms, 1e-9) * 1e3
    tpot = [(r.finished_s - r.first_token_s) * 1e3 / (r.stats.new_tokens - 1) for r in reqs if r.stats.new_tokens > 1]
    ttft = [(r.first_token_s - r.arrived_s) * 1e3 for r in reqs]
    texts = [tokenizer.decode(r.stats.output_ids) for r in reqs]
    steps = sum(len(r.stats.taus) for r in reqs)
    return {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_ci": bootstrap_ci(units, tokens_per_s / busy_rate, resamples, seed),
        "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "exact_match": sum(t == ref for t, ref in zip(texts, references)) / len(reqs),
        "requests": len(reqs), "new_tokens": tokens, "wall_s": wall_s,
        "tau": sum(sum(r.stats.taus) for r in reqs) / max(1, steps),
        "mean_batch": float(np.mean([v[2] for v in batch.rows])) if batch.rows else 0.0,
        "mean_verified_rows": float(np.mean([v[0] for v in batch.rows])) if batch.rows else 0.0,
        "batched_steps": len(batch.rows),
    }


def load_bench_prompts(cfg: DictConfig, tokenizer) -> list:
    """The benchmark's prompts as [1, n] chat-templated ids: ``data``'s sets, only ``bench.split``'s when set."""
    from pipeline.prompts import chat_input_ids, load_prompt_sets, prompt_id_of

    prompts = load_prompt_sets(cfg.data.sets, cfg.data.get("limit"), cfg.data.get("seed"), cfg.data.get("offset", 0))
    if cfg.bench.split:
        from pipeline.policy.data import split_prompt_ids

        try:
            keep = {prompt_id_of(i) for i in split_prompt_ids(cfg.bench.features_dir)[cfg.bench.split]}
        except (FileNotFoundError, KeyError, OSError) as err:
            raise FileNotFoundError(f"bench.split={cfg.bench.split} needs the dataset stage's splits at "
                                    f"{cfg.bench.features_dir} ({err}); run make all for run_name={cfg.run_name} or set "
                                    "bench.split=null") from err
        prompts = [p for p in prompts if p.id in keep]
    if not prompts:
        raise ValueError("no prompt to benchmark: check data (and bench.split)")
    if "mixed" in list(cfg.bench.methods or []):
        from pipeline.policy.checks import check_cache_seed_disjoint

        check_cache_seed_disjoint(cfg.get("policy"), [p.id for p in prompts], cfg.bench.split)
    if cfg.bench.requests:
        prompts = [prompts[i % len(prompts)] for i in range(int(cfg.bench.requests))]
    return [chat_input_ids(tokenizer, p.turns) for p in prompts]


def sources(cfg: DictConfig):
    """Where the benchmark's methods read their inputs (``pipeline.policy.setup.Sources``): the run's predictors
    folder (its ``verify_width`` calibration, else the drafter's), its labels and splits (read only by ``mixed`` with
    ``policy.mixed.cache_seed=labels``), ``bench.block_size``, up to the largest concurrency."""
    from pipeline.policy.setup import Sources

    return Sources("bench", str(Path(cfg.paths.data) / "predictors" / str(cfg.run_name)),
                   labels_dir=str(Path(cfg.paths.data) / "labels" / str(cfg.run_name)),  # policy.mixed.cache_seed=labels
                   features_dir=str(cfg.bench.features_dir), block_size=cfg.bench.get("block_size"),
                   block_size_key="bench.block_size", max_requests=max(int(c) for c in cfg.bench.concurrency))


def bench_batch(cfg: DictConfig) -> dict:
    """Run the benchmark (see the module doc); returns the JSON-ready dict.

    Every method is built by the one method table (``pipeline.policy.setup``, as the server builds it), afresh for each
    run (a policy's learned state does not carry from one run to the next).

    Raises:
        ValueError: for a bad ``bench`` setting (before loading), or a drafting method without a drafter.
        FileNotFoundError: for ``verify_width`` / ``budget`` without a calibration.
    """
    check_bench_config(cfg)
    from pipeline.decoding import DecodeConfig
    from pipeline.decoding.batched import BatchedDecoder
    from pipeline.decoding.scheduler import decode_all
    from pipeline.decoding.build import build_decoder
    from pipeline.policy import setup

    b = cfg.bench
    torch.manual_seed(int(cfg.seed))
    if b.get("num_threads"):
        torch.set_num_threads(int(b.num_threads))
    methods = list(b.methods)
    drafting = [m for m in methods if m != "ar"]
    if drafting and not cfg.model.get("drafter"):
        raise ValueError(f"methods {drafting} need a drafter: set model.drafter or use bench.methods=[ar]")
    decoder = build_decoder(cfg.model)
    tokenizer = decoder.target.tokenizer
    src = sources(cfg)
    inputs = setup.load_inputs(cfg, decoder, methods, src)
    setup.build_methods(cfg, decoder, inputs, methods, src)  # a B the drafter cannot draft fails before any decode
    prompts = load_bench_prompts(cfg, tokenizer)
    configs = [DecodeConfig(int(b.max_new_tokens), float(b.temperature), int(cfg.seed) + i) for i in range(len(prompts))]

    def run(method: str, prompts, configs, **kwargs) -> tuple[list, BatchedDecoder]:
        factory = setup.build_methods(cfg, decoder, inputs, [method], src)[method]
        batch = BatchedDecoder(decoder, factory.batch)
        return decode_all(decoder, prompts, [factory() for _ in prompts], configs, batch=batch, **kwargs), batch

    if b.warmup:
        run(drafting[0] if drafting else "ar", prompts[:2], [DecodeConfig(4)] * len(prompts[:2]))

    log.info("bench_batch: batch-1 ar over %d requests", len(prompts))
    t0 = time.perf_counter()
    references, ar_tokens = [], 0
    for ids, config in zip(prompts, configs):
        stats = decoder.generate(ids, 1, config)
        references.append(tokenizer.decode(stats.output_ids))
        ar_tokens += stats.new_tokens
    batch1 = ar_tokens / (time.perf_counter() - t0)
    log.info("bench_batch: batch-1 ar %.1f tokens/s", batch1)

    rng = np.random.default_rng(int(cfg.seed))
    gaps = rng.exponential(1.0 / float(b.rate), size=len(prompts)) if "poisson" in b.arrivals else None
    by_arrivals: dict = {}
    for pattern in b.arrivals:
        times = None if pattern == "burst" else np.cumsum(gaps) - gaps[0]
        per_c = by_arrivals[pattern] = {}
        for level, c in enumerate(b.concurrency):
            per_c[str(int(c))] = {}
            # methods run one after another, so a host that drifts (15-30% here) favours whichever runs on the faster
            # side: every other concurrency level runs them in reverse order
            for method in methods if level % 2 == 0 else methods[::-1]:
                reqs, batch = run(method, prompts, configs, max_batch=int(c),
                                  arrival_times_s=None if times is None else [float(t) for t in times])
                fig = run_metrics(reqs, batch, references, tokenizer, int(b.bootstrap), int(cfg.seed))
                fig["speedup_vs_batch1_ar"] = fig["tokens_per_s"] / batch1
                per_c[str(int(c))][method] = fig
                log.info("bench_batch: %s c=%d %s: %.1f tokens/s (%.2fx batch-1 ar), TPOT p50 %.1f ms, exact %.2f",
                         pattern, int(c), method, fig["tokens_per_s"], fig["speedup_vs_batch1_ar"], fig["tpot_ms_p50"],
                         fig["exact_match"])
            per_c[str(int(c))] = {m: per_c[str(int(c))][m] for m in methods}  # reported in the configured order
    foresight = None
    costs = inputs.batch_costs
    block_size = setup.drafted_block_size(cfg, decoder, src)
    if b.get("labels_dir") and costs is not None:
        from pipeline.labeling.store import read_label_table
        from pipeline.policy.budget import batched_foresight_bound

        labels, _ = read_label_table(b.labels_dir)
        foresight = batched_foresight_bound(labels, costs, block_size, [int(c) for c in b.concurrency])
    first = list(b.arrivals)[0]
    return {
        "foresight": foresight,
        "batch1_ar_tokens_per_s": batch1, "arrivals": first, "by_concurrency": by_arrivals[first],
        "by_arrivals": by_arrivals, "block_size": block_size, "requests": len(prompts),
        "max_new_tokens": int(b.max_new_tokens), "temperature": float(b.temperature), "rate": float(b.rate),
        "costs": costs.to_dict() if costs is not None else None,
        "info": {"host": platform.node(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                 "target": decoder.target.name, "drafter": str(cfg.model.drafter), "forward": decoder.forward_path(),
                 "exact_batching": decoder.forward.exact},
    }


def markdown(result: dict) -> str:
    """One row per (arrivals, concurrency, method): tokens/s with its interval, x batch-1 ar, TPOT, TTFT, exact match."""
    header = ["arrivals", "concurrency", "method", "tokens/s", "95% CI", "x batch-1 ar", "TPOT p50 ms", "TPOT p99 ms",
              "TTFT p50 ms", "TTFT p99 ms", "tau", "exact match"]
    lines = [f"batch-1 ar: {result['batch1_ar_tokens_per_s']:.1f} tokens/s ({result['requests']} requests, "
             f"{result['max_new_tokens']} new tokens, T={result['temperature']}, B={result['block_size']})", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for pattern, per_c in result["by_arrivals"].items():
        for c, per_m in per_c.items():
            for method, f in per_m.items():
                lo, hi = f["tokens_per_s_ci"]
                lines.append("| " + " | ".join([pattern, c, method, f"{f['tokens_per_s']:.1f}", f"[{lo:.1f}, {hi:.1f}]",
                                                f"{f['speedup_vs_batch1_ar']:.2f}", f"{f['tpot_ms_p50']:.1f}",
                                                f"{f['tpot_ms_p99']:.1f}", f"{f['ttft_ms_p50']:.0f}",
                                                f"{f['ttft_ms_p99']:.0f}", f"{f['tau']:.2f}", f"{f['exact_match']:.2f}"]) + " |")
    return "\n".join(lines)
