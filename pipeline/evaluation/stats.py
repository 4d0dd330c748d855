"""Statistics of the eval stage: per-method summaries, the oracle gain share, tokens/s intervals and gains, and the
one percentile bootstrap every interval of the project is drawn with (also ``pipeline.evaluation.retest``'s).

Everything here is plain numpy over per-prompt rows (``runs.merge_turns``): no model, no torch.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from pipeline.decoding.trees import tree_summary

GAIN_METHODS = ("verify_width", "hybrid", "tree")
"""Per-step methods whose tokens/s gain over ``GAIN_BASES`` is reported, paired by prompt."""
GAIN_BASES = ("fixed", "best_fixed", "ar", "verify_width")


def bootstrap_interval(statistic: Callable[[np.ndarray], np.ndarray], n: int, samples: int = 1000, seed: int = 0,
                       level: float = 0.95) -> list[float | None]:
    """Percentile bootstrap interval of a statistic over ``n`` units (prompts, requests), resampled with replacement.

    Args:
        statistic: maps resample indices [samples, n] (ints in 0..n-1) to the statistic of each resample [samples];
            non-finite values (e.g. a ratio whose denominator vanished) are dropped.
        n: units; samples: resamples; seed: the generator's seed (the interval is deterministic given it);
        level: the central coverage (0.95: the 2.5th and 97.5th percentiles).
    Returns:
        ``[low, high]``, or ``[None, None]`` for fewer than two units (one prompt has no spread to resample) or when no
        resample gives a finite value.
    """
    if n < 2:
        return [None, None]
    idx = np.random.default_rng(seed).integers(0, n, size=(int(samples), n))
    values = np.asarray(statistic(idx), dtype=float)
    values = values[np.isfinite(values)]
    if not len(values):
        return [None, None]
    tail = 100.0 * (1.0 - level) / 2.0
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100.0 - tail))]


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def summarize(rows: list[dict], reference: dict[str, list[int]] | None) -> dict:
    """Aggregate per-prompt rows of one method: ``n_prompts``, ``tau`` (accepted tokens / steps), ``new_tokens``,
    ``tokens_per_s`` (new tokens over prefill + schedule + decode seconds), ``tpot_ms``, ``decode_ms``, ``schedule_ms``,
    ``overhead_ms`` (per prompt) and ``overhead_pct`` (of decode time); ``verify_width`` / ``drafted`` for a
    verify-width policy; ``exact_matches`` and ``lossless`` (the exact-match rate against ``reference``, ar's outputs)."""
    steps = sum(r["steps"] for r in rows)
    accepted = sum(r["tau"] * r["steps"] for r in rows)
    new_tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["prefill_ms"] + r["schedule_ms"] + r["decode_ms"] for r in rows) / 1e3
    decode_ms = sum(r["decode_ms"] for r in rows)
    schedule_ms = sum(r["schedule_ms"] for r in rows)
    out = {
        "n_prompts": len(rows),
        "tau": accepted / steps if steps else 0.0,
        "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / seconds if seconds else 0.0,
        "tpot_ms": decode_ms / max(1, new_tokens - len(rows)),
        "decode_ms": decode_ms,
        "schedule_ms": schedule_ms,
        "overhead_ms": schedule_ms / len(rows) if rows else 0.0,
        "overhead_pct": 100.0 * schedule_ms / decode_ms if decode_ms else 0.0,
    }
    widths = [k for r in rows for k in r.get("verify_widths", [])]
    if widths:  # mean drafts verified per step
        out["verify_width"] = float(np.mean(widths))
    trees = [t for r in rows for t in r.get("trees", [])]
    if trees:  # a tree policy: its shapes and the rank-acceptance table
        out["tree"] = tree_summary(trees)
    confidences = [c for r in rows for c in r.get("confidences", [])]
    if any(c is not None for c in confidences):  # a verify-width policy: the share of steps that drafted at all
        out["drafted"] = float(np.mean([c is not None for c in confidences]))
    if reference is not None:
        matches = sum(r["output_ids"] == reference[r["id"]] for r in rows)
        out["exact_matches"] = matches
        out["lossless"] = matches / len(rows) if rows else None  # exact-match rate vs ar, not a bare flag
    return out


def oracle_gain_share(rows: dict[str, list[dict]], method: str, samples: int = 1000, seed: int = 0) -> tuple[float | None, list]:
    """(tau_method - tau_fixed) / (tau_oracle - tau_fixed) over the prompts all three decoded, with a
    percentile bootstrap 95% interval over prompts (tau = accepted tokens / steps of the resampled prompts).

    Returns:
        (share or None when the oracle gains nothing over fixed, [low, high] or [None, None]; the interval is
        None as well for a single prompt).
    """
    by_id = {m: {r["id"]: r for r in rows[m]} for m in (method, "fixed", "oracle")}
    ids = [i for i in by_id[method] if i in by_id["fixed"] and i in by_id["oracle"]]
    if not ids:
        return None, [None, None]
    acc = np.array([[by_id[m][i]["tau"] * by_id[m][i]["steps"] for i in ids] for m in (method, "fixed", "oracle")])
    steps = np.array([[by_id[m][i]["steps"] for i in ids] for m in (method, "fixed", "oracle")], dtype=float)

    def share(a: np.ndarray, s: np.ndarray) -> np.ndarray:
        tau = a / np.maximum(s, 1e-12)
        gain = tau[2] - tau[1]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(gain > 1e-9, (tau[0] - tau[1]) / gain, np.nan)

    point = _finite(float(share(acc.sum(1), steps.sum(1))))
    ci = bootstrap_interval(lambda idx: share(acc[:, idx].sum(-1), steps[:, idx].sum(-1)), len(ids), samples, seed)
    return point, ci


def method_rows(results: dict, method: str, source_set: str | None = None) -> list[dict]:
    """The per-prompt rows of ``method`` (of one source set when given)."""
    rows = results["methods"].get(method, {}).get("rows", [])
    return [r for r in rows if source_set is None or r.get("source_set") == source_set]


def speed_intervals(results: dict, method: str, source_set: str | None = None, samples: int = 1000,
                    seed: int = 0, base: str = "ar") -> dict[str, list[float | None]]:
    """Percentile bootstrap 95% intervals over prompts of ``tokens_per_s`` and of ``speedup`` (paired with ``base``).

    tokens/s of a resample = its new tokens / its prefill + schedule + decode seconds; the speedup divides by
    ``base``'s (default ``ar``) tokens/s over the same prompts. Returns ``{"tokens_per_s": [lo, hi], "speedup": [lo, hi]}``
    (``[None, None]`` without rows, and for a single prompt: no interval).
    """
    rows = {r["id"]: r for r in method_rows(results, method, source_set)}
    ar = {r["id"]: r for r in method_rows(results, base, source_set)}
    ids = [i for i in rows if i in ar]

    def arrays(table):
        tokens = np.array([table[i]["new_tokens"] for i in ids], dtype=float)
        seconds = np.array([(table[i]["prefill_ms"] + table[i]["schedule_ms"] + table[i]["decode_ms"]) / 1e3 for i in ids])
        return tokens, seconds

    tokens, seconds = arrays(rows)
    ar_tokens, ar_seconds = arrays(ar)

    def speed(idx):
        return tokens[idx].sum(1) / np.maximum(seconds[idx].sum(1), 1e-12)

    def ratio(idx):
        return speed(idx) / np.maximum(ar_tokens[idx].sum(1) / np.maximum(ar_seconds[idx].sum(1), 1e-12), 1e-12)

    return {"tokens_per_s": bootstrap_interval(speed, len(ids), samples, seed),
            "speedup": bootstrap_interval(ratio, len(ids), samples, seed)}


def speed_gains(results: dict, source_set: str | None = None) -> dict[str, dict[str, dict]]:
    """Tokens/s gain of each per-step method over each baseline, paired by prompt: ``{method: {base: {"gain", "ci"}}}``.

    ``gain`` = tokens/s(method) / tokens/s(base) - 1 over the prompts both decoded; ``ci`` its percentile bootstrap 95%
    interval over prompts (``speed_intervals`` with ``base``). Only methods and bases that ran.
    """
    block = results["methods"] if source_set is None else results.get("per_set", {}).get(source_set, {})
    out: dict[str, dict[str, dict]] = {}
    for method in GAIN_METHODS:
        if method not in block:
            continue
        for base in GAIN_BASES:
            if base == method or base not in block or not block[base].get("tokens_per_s"):
                continue
            lo, hi = speed_intervals(results, method, source_set, base=base)["speedup"]
            out.setdefault(method, {})[base] = {
                "gain": block[method]["tokens_per_s"] / block[base]["tokens_per_s"] - 1.0,
                "ci": [lo - 1.0 if lo is not None else None, hi - 1.0 if hi is not None else None]}
    return out


def summarize_all(rows: dict[str, list[dict]], methods: list[str], reference: dict, boot: dict,
                  shares: Callable[[str], bool] = lambda m: True) -> dict[str, dict]:
    """Summary of every method over ``rows`` (one source set or all): ``summarize`` + speedup + oracle gain share.

    Args:
        shares: whether a method has an oracle gain share (a per-request choice of B); the others get None
            (``ar``, the per-step verify widths, transformers' own decoding).
    """
    block = {m: summarize(rows[m], reference) for m in methods}
    ar_speed = block["ar"]["tokens_per_s"]
    both = "fixed" in rows and "oracle" in rows
    for m in methods:
        block[m]["speedup"] = block[m]["tokens_per_s"] / ar_speed if ar_speed else 0.0
        if both and shares(m):
            share, ci = oracle_gain_share(rows, m, int(boot.get("samples", 1000)), int(boot.get("seed", 0)))
        else:
            share, ci = None, [None, None]
        block[m]["oracle_gain_share"], block[m]["oracle_gain_share_ci"] = share, ci
    return block
