"""Tables and figures of the eval stage (also drawn by ``notebooks/analysis.ipynb``).

Figures are ``matplotlib.figure.Figure`` objects built without pyplot (no global state, any backend):
  * ``tau_curves``: mean tau per candidate block size, one line per source set, from the labels;
  * ``optimal_b_hist``: how often each block size is a prompt's label, per source set;
  * ``confusion``: predicted block size vs label block size (counts);
  * ``speedup_bars``: speedup vs ``ar`` per method, overall and per source set.
``markdown_table`` renders ``results.json`` as Markdown; ``write_report`` writes all of them beside it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

METRIC_COLUMNS = ("tau", "tokens_per_s", "speedup", "oracle_gain_share", "overhead_ms", "overhead_pct", "lossless", "n_prompts")


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def results_frame(results: dict) -> pd.DataFrame:
    """One row per (source set, method): ``set`` (``all`` for overall), ``method`` and the metric columns."""
    rows = []
    blocks = [("all", results["methods"])] + sorted((s, b) for s, b in results.get("per_set", {}).items())
    for name, block in blocks:
        for method, r in block.items():
            row = {"set": name, "method": method}
            row.update({k: r.get(k) for k in METRIC_COLUMNS})
            ci = r.get("oracle_gain_share_ci")
            row["ci_low"], row["ci_high"] = (ci if ci else (None, None))
            rows.append(row)
    return pd.DataFrame(rows)


def _exact(r: dict) -> str:
    """The exact-match column: ``k/n`` prompts token-identical to ``ar`` (older results: their ``lossless`` value)."""
    if r.get("exact_matches") is not None and r.get("n_prompts"):
        return f"{r['exact_matches']}/{r['n_prompts']}"
    return _fmt(r.get("lossless"))


MIN_REQUESTS = 10
"""Rows with fewer requests than this are marked in ``markdown_table``: their tokens/s and speedups are anecdotes."""


def method_rows(results: dict, method: str, source_set: str | None = None) -> list[dict]:
    """The per-prompt rows of ``method`` (of one source set when given)."""
    rows = results["methods"].get(method, {}).get("rows", [])
    return [r for r in rows if source_set is None or r.get("source_set") == source_set]


def request_count(rows: list[dict]) -> int:
    """Requests (turns) behind per-prompt rows: an MT-Bench prompt is two requests."""
    return sum(len(r.get("chosen_bs") or [r.get("chosen_b")]) for r in rows)


PER_STEP_METHODS = ("ema",)
"""Eval methods whose schedule changes B after every step (the B column says so)."""


def block_sizes_used(rows: list[dict], per_step: bool = False) -> str:
    """The B a method picked after prefill over ``rows``: ``8``, or ``6-10`` when it varied per request, plus
    ``, per step up to 10`` when some step drafted a larger block than the prompt's first choices (a per-step
    schedule; the clipped last block of a fixed B is never larger), or ``, per step`` for ``per_step`` methods
    that never grew. ``–`` without rows."""
    chosen = sorted({int(b) for r in rows for b in (r.get("chosen_bs") or [r.get("chosen_b")]) if b is not None})
    if not chosen:
        return "–"
    text = str(chosen[0]) if len(chosen) == 1 else f"{chosen[0]}-{chosen[-1]}"
    first = {r["id"]: max(int(b) for b in (r.get("chosen_bs") or [r.get("chosen_b")]) if b is not None)
             for r in rows if any(b is not None for b in (r.get("chosen_bs") or [r.get("chosen_b")]))}
    larger = [int(b) for r in rows if r["id"] in first for b in (r.get("block_sizes") or []) if int(b) > first[r["id"]]]
    return text + (f", per step up to {max(larger)}" if larger else (", per step" if per_step else ""))


def speed_intervals(results: dict, method: str, source_set: str | None = None, samples: int = 1000,
                    seed: int = 0) -> dict[str, list[float | None]]:
    """Percentile bootstrap 95% intervals over prompts of ``tokens_per_s`` and of ``speedup`` (paired with ``ar``).

    tokens/s of a resample = its new tokens / its prefill + schedule + decode seconds; the speedup divides by
    ``ar``'s tokens/s over the same prompts. Returns ``{"tokens_per_s": [lo, hi], "speedup": [lo, hi]}``
    (``[None, None]`` without rows).
    """
    rows = {r["id"]: r for r in method_rows(results, method, source_set)}
    ar = {r["id"]: r for r in method_rows(results, "ar", source_set)}
    ids = [i for i in rows if i in ar]
    if not ids:
        return {"tokens_per_s": [None, None], "speedup": [None, None]}

    def arrays(table):
        tokens = np.array([table[i]["new_tokens"] for i in ids], dtype=float)
        seconds = np.array([(table[i]["prefill_ms"] + table[i]["schedule_ms"] + table[i]["decode_ms"]) / 1e3 for i in ids])
        return tokens, seconds

    tokens, seconds = arrays(rows)
    ar_tokens, ar_seconds = arrays(ar)
    idx = np.random.default_rng(seed).integers(0, len(ids), size=(samples, len(ids)))
    speed = tokens[idx].sum(1) / np.maximum(seconds[idx].sum(1), 1e-12)
    ar_speed = ar_tokens[idx].sum(1) / np.maximum(ar_seconds[idx].sum(1), 1e-12)
    ratio = speed / np.maximum(ar_speed, 1e-12)
    return {"tokens_per_s": [float(np.percentile(speed, 2.5)), float(np.percentile(speed, 97.5))],
            "speedup": [float(np.percentile(ratio, 2.5)), float(np.percentile(ratio, 97.5))]}


def markdown_table(results: dict) -> str:
    """Markdown tables of ``results`` (overall, then one per source set).

    Columns: the B each method decoded with, tau, tokens/s and speedup with bootstrap 95% intervals over
    prompts, the oracle gain share (none for ``ar``, which drafts nothing), overhead, losslessness, and the
    prompt and request counts; a row with fewer than ``MIN_REQUESTS`` requests is marked.
    """
    header = ("| method | B | tau | tokens/s [95% CI] | speedup [95% CI] | oracle gain share [95% CI] | overhead ms (% decode) | "
              "lossless | prompts (requests) |\n|---|---|---|---|---|---|---|---|---|")
    sections = [("All prompts", None, results["methods"])] + [(f"Source set `{s}`", s, b) for s, b in sorted(results.get("per_set", {}).items())]
    lines = ["# Eval results", ""]
    config = {k: v for k, v in results.get("config", {}).items() if k != "block_size"}
    if config:
        lines += ["Decode config: " + ", ".join(f"{k}={v}" for k, v in config.items()), ""]
    few = False
    for title, source_set, block in sections:
        lines += [f"## {title}", "", header]
        for method, r in block.items():
            rows = method_rows(results, method, source_set)
            share = "" if method == "ar" else _fmt(r.get("oracle_gain_share"))
            ci = r.get("oracle_gain_share_ci")
            if method != "ar" and ci and ci[0] is not None:
                share += f" [{_fmt(ci[0])}, {_fmt(ci[1])}]"
            speed = f"{_fmt(r.get('tokens_per_s'))}"
            speedup = f"{_fmt(r.get('speedup'))}x"
            if rows and method != "ar":
                intervals = speed_intervals(results, method, source_set)
                lo, hi = intervals["tokens_per_s"]
                speed += f" [{_fmt(lo)}, {_fmt(hi)}]"
                lo, hi = intervals["speedup"]
                speedup += f" [{_fmt(lo)}, {_fmt(hi)}]"
            requests = request_count(rows) if rows else r.get("n_prompts")
            mark = ""
            if requests is not None and requests < MIN_REQUESTS:
                mark, few = " †", True
            lines.append(f"| {method}{mark} | {block_sizes_used(rows, method in PER_STEP_METHODS)} | {_fmt(r.get('tau'))} | {speed} | {speedup} | "
                         f"{share} | {_fmt(r.get('overhead_ms'), 3)} ({_fmt(r.get('overhead_pct'), 3)}%) | "
                         f"{_exact(r)} | {r.get('n_prompts')} ({requests}) |")
        lines.append("")
    lines += ["B: the block sizes decoded with (a range when they varied per request or per step). tau: mean acceptance length "
              "(tokens per target verify). speedup: tokens/s over `ar` in the same run; intervals are percentile bootstrap "
              "95% over prompts (speedup paired with `ar` on the same prompts). oracle gain share: (tau - tau_fixed) / "
              "(tau_oracle - tau_fixed), bootstrap 95% interval over prompts. overhead: time choosing B per request (the "
              "predictor's featurize + forward), and its share of decode time.", ""]
    if few:
        lines += [f"†: fewer than {MIN_REQUESTS} requests; its tokens/s and speedup are not a finding.", ""]
    return "\n".join(lines)


def tau_curves(labels: pd.DataFrame, normalize: bool = False) -> Figure:
    """Mean tau(B) over requests per source set (and over all requests), from label rows (one per request).

    Args:
        labels: label rows (``source_set``, ``candidates``, ``tau``).
        normalize: divide each prompt's tau vector by its maximum first (shape, not level).
    """
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    candidates = list(labels["candidates"].iloc[0])
    tau = np.stack(labels["tau"].map(np.asarray).to_list()).astype(float)
    if normalize:
        tau = tau / tau.max(1, keepdims=True)
    groups = [("all", np.ones(len(labels), bool))] + [(s, (labels["source_set"] == s).to_numpy()) for s in sorted(labels["source_set"].unique())]
    for name, mask in groups:
        ax.plot(candidates, tau[mask].mean(0), marker="o", lw=2.5 if name == "all" else 1.2,
                color="black" if name == "all" else None, label=f"{name} (n={int(mask.sum())})")
    ax.set_xlabel("block size B (tokens)")
    ax.set_ylabel("tau / max tau" if normalize else "mean acceptance length tau (tokens)")
    ax.set_xticks(candidates)
    ax.set_title("tau vs block size (labels)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def optimal_b_hist(labels: pd.DataFrame, column: str = "label_tau") -> Figure:
    """Share of requests whose label (``column``) is each candidate, per source set (grouped bars)."""
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    candidates = list(labels["candidates"].iloc[0])
    sets = sorted(labels["source_set"].unique())
    width = 0.8 / max(1, len(sets))
    for i, s in enumerate(sets):
        counts = labels.loc[labels["source_set"] == s, column].value_counts()
        share = [counts.get(b, 0) / max(1, counts.sum()) for b in candidates]
        ax.bar(np.arange(len(candidates)) + (i - (len(sets) - 1) / 2) * width, share, width, label=f"{s} (n={int(counts.sum())})")
    ax.set_xticks(range(len(candidates)), [str(b) for b in candidates])
    ax.set_xlabel(f"optimal block size ({column})")
    ax.set_ylabel("share of requests")
    ax.set_title("optimal B per request")
    ax.legend(fontsize=8)
    return fig


def confusion_counts(predicted: list[int], label: list[int], candidates: list[int]) -> np.ndarray:
    """Counts [C, C]: row = label block size, column = predicted block size (values outside the candidates dropped)."""
    index = {b: i for i, b in enumerate(candidates)}
    counts = np.zeros((len(candidates), len(candidates)), dtype=int)
    for p, t in zip(predicted, label):
        if p in index and t in index:
            counts[index[t], index[p]] += 1
    return counts


def confusion(predicted: list[int], label: list[int], candidates: list[int], title: str = "blockpilot vs label",
              note: str | None = None) -> Figure:
    """Heat map of ``confusion_counts`` with the counts written in the cells, the accuracy in the title and
    ``note`` under it (e.g. that the deploy check fell back to the training B)."""
    counts = confusion_counts(predicted, label, candidates)
    fig = Figure(figsize=(4.5, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(counts, cmap="Blues")
    for i in range(len(candidates)):
        for j in range(len(candidates)):
            ax.text(j, i, str(counts[i, j]), ha="center", va="center", color="white" if counts[i, j] > counts.max() / 2 else "black")
    ax.set_xticks(range(len(candidates)), [str(b) for b in candidates])
    ax.set_yticks(range(len(candidates)), [str(b) for b in candidates])
    ax.set_xlabel("predicted B")
    ax.set_ylabel("label B")
    acc = np.trace(counts) / max(1, counts.sum())
    ax.set_title(f"{title} (acc {acc:.2f}, n={counts.sum()} requests)" + (f"\n{note}" if note else ""), fontsize=10)
    return fig


def fallback_note(results: dict, method: str) -> str | None:
    """A line for the confusion matrix of ``method`` when its exported predictor always keeps the training B
    (the train stage's bootstrap check rejected its departures), else None."""
    fallback = (results.get("predictors", {}).get(method) or {}).get("fallback") or {}
    if fallback.get("margin") is not None and float(fallback["margin"]) > 1.0:
        return f"deploy check fell back: always B_train={fallback.get('block_size')}"
    return None


def speedup_bars(results: dict) -> Figure:
    """Speedup vs ``ar`` per method (bars), overall and per source set (groups on the x axis), at a fixed size
    (9 x 4.5 in: 1080 x 540 px at the report's 120 dpi)."""
    frame = results_frame(results)
    methods = [m for m in results["methods"] if m != "ar"]
    sets = ["all"] + sorted(results.get("per_set", {}))
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        sub = frame[frame["method"] == m].set_index("set")
        values = [float(sub.loc[s, "speedup"]) if s in sub.index and sub.loc[s, "speedup"] is not None else 0.0 for s in sets]
        ax.bar(np.arange(len(sets)) + (i - (len(methods) - 1) / 2) * width, values, width, label=m)
    ax.axhline(1.0, color="grey", lw=1, ls="--", label="ar")
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel("speedup vs ar (tokens/s)")
    ax.set_title("speedup per method and source set")
    ax.legend(fontsize=9, ncols=min(4, len(methods) + 1), loc="upper left", bbox_to_anchor=(0, -0.12))
    return fig


def predicted_vs_label(results: dict, labels: pd.DataFrame, method: str, column: str = "label_tau") -> tuple[list[int], list[int]]:
    """(chosen B of ``method``, label B) over the evaluated requests (every turn of a prompt) that have a label."""
    from pipeline.prompts import request_id

    label_of = dict(zip(labels["id"], labels[column]))
    predicted, label = [], []
    for row in results["methods"].get(method, {}).get("rows", []):
        chosen = row.get("chosen_bs") or [row.get("chosen_b")]
        for turn, b in enumerate(chosen):
            rid = request_id(row["id"], turn)
            if b is not None and rid in label_of:
                predicted.append(int(b))
                label.append(int(label_of[rid]))
    return predicted, label


def write_report(results: dict, out_dir: str | Path, labels: pd.DataFrame | None = None, label_column: str = "label_tau",
                 predictor_methods: tuple[str, ...] = ("blockpilot", "full_vocab"), table_name: str = "results.md") -> dict[str, Path]:
    """Write the Markdown table (``table_name``) and the PNG figures into ``out_dir``; returns ``{name: path}``.

    Label figures (tau curves, optimal-B histogram, confusion matrices) need ``labels``; a confusion
    matrix is drawn for each predictor method that ran.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"table": out_dir / table_name}
    paths["table"].write_text(markdown_table(results))
    figures = {"speedup": speedup_bars(results)}
    if labels is not None and len(labels):
        figures["tau_curves"] = tau_curves(labels)
        figures["optimal_b_hist"] = optimal_b_hist(labels, label_column)
        candidates = [int(b) for b in labels["candidates"].iloc[0]]
        for method in predictor_methods:
            predicted, label = predicted_vs_label(results, labels, method, label_column)
            if predicted:
                figures[f"confusion_{method}"] = confusion(predicted, label, candidates, f"{method} vs label",
                                                           fallback_note(results, method))
    for name, fig in figures.items():
        paths[name] = out_dir / f"{name}.png"
        fig.savefig(paths[name], dpi=120)
    return paths
