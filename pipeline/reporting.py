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


def markdown_table(results: dict) -> str:
    """Markdown tables of ``results`` (overall, then one per source set)."""
    header = ("| method | tau | tokens/s | speedup | oracle gain share [95% CI] | overhead ms (% decode) | lossless (= ar) | prompts |\n"
              "|---|---|---|---|---|---|---|---|")
    sections = [("All prompts", results["methods"])] + [(f"Source set `{s}`", b) for s, b in sorted(results.get("per_set", {}).items())]
    lines = ["# Eval results", ""]
    config = results.get("config", {})
    if config:
        lines += ["Decode config: " + ", ".join(f"{k}={v}" for k, v in config.items()), ""]
    for title, block in sections:
        lines += [f"## {title}", "", header]
        for method, r in block.items():
            ci = r.get("oracle_gain_share_ci")
            share = _fmt(r.get("oracle_gain_share"))
            if ci and ci[0] is not None:
                share += f" [{_fmt(ci[0])}, {_fmt(ci[1])}]"
            lines.append(f"| {method} | {_fmt(r.get('tau'))} | {_fmt(r.get('tokens_per_s'), 1)} | {_fmt(r.get('speedup'))}x | "
                         f"{share} | {_fmt(r.get('overhead_ms'), 3)} ({_fmt(r.get('overhead_pct'), 3)}%) | "
                         f"{_exact(r)} | {r.get('n_prompts')} |")
        lines.append("")
    lines += ["tau: mean acceptance length (tokens per target verify). speedup: tokens/s over `ar` in the same run. "
              "oracle gain share: (tau - tau_fixed) / (tau_oracle - tau_fixed), bootstrap 95% interval over prompts. "
              "overhead: time choosing B per prompt (the predictor's featurize + forward), and its share of decode time.", ""]
    return "\n".join(lines)


def tau_curves(labels: pd.DataFrame, normalize: bool = False) -> Figure:
    """Mean tau(B) over prompts per source set (and over all prompts), from label rows.

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
    """Share of prompts whose label (``column``) is each candidate, per source set (grouped bars)."""
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
    ax.set_ylabel("share of prompts")
    ax.set_title("optimal B per prompt")
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


def confusion(predicted: list[int], label: list[int], candidates: list[int], title: str = "blockpilot vs label") -> Figure:
    """Heat map of ``confusion_counts`` with the counts written in the cells and the accuracy in the title."""
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
    ax.set_title(f"{title} (acc {acc:.2f}, n={counts.sum()})")
    return fig


def speedup_bars(results: dict) -> Figure:
    """Speedup vs ``ar`` per method (bars), overall and per source set."""
    frame = results_frame(results)
    methods = list(results["methods"])
    sets = ["all"] + sorted(results.get("per_set", {}))
    fig = Figure(figsize=(max(6, 1.2 * len(methods) * max(1, len(sets)) / 2), 4), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(sets)
    for i, s in enumerate(sets):
        sub = frame[frame["set"] == s].set_index("method")
        values = [float(sub.loc[m, "speedup"]) if m in sub.index and sub.loc[m, "speedup"] is not None else 0.0 for m in methods]
        ax.bar(np.arange(len(methods)) + (i - (len(sets) - 1) / 2) * width, values, width, label=s)
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_xticks(range(len(methods)), methods)
    ax.set_ylabel("speedup vs ar (tokens/s)")
    ax.set_title("speedup per method")
    ax.legend(fontsize=8)
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
                figures[f"confusion_{method}"] = confusion(predicted, label, candidates, f"{method} vs label")
    for name, fig in figures.items():
        paths[name] = out_dir / f"{name}.png"
        fig.savefig(paths[name], dpi=120)
    return paths
