"""Outputs of the eval stage: results.json, results.md, the figures and W&B (the figures are also drawn by
``notebooks/analysis.ipynb``).

Figures are ``matplotlib.figure.Figure`` objects built without pyplot (no global state, any backend):
  * ``tau_curves``: mean tau per candidate block size, one line per source set, from the labels;
  * ``optimal_b_hist``: how often each block size is a prompt's label, per source set;
  * ``confusion``: predicted block size vs label block size (counts);
  * ``speedup_bars``: speedup vs ``ar`` per method, overall and per source set, with bootstrap 95% intervals.
``markdown_table`` renders ``results.json`` as Markdown (headed by the run, date and commit it came from,
``provenance``); ``write_report`` writes all of them beside it; ``write_json``, ``log_summary`` and ``log_to_wandb``
write the rest of an eval run's outputs.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from pipeline.evaluation.stats import GAIN_BASES, GAIN_METHODS, method_rows, speed_gains, speed_intervals  # noqa: F401
from pipeline.files import write_json_atomic
from pipeline.policy.registry import METHODS

log = logging.getLogger(__name__)

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


def request_count(rows: list[dict]) -> int:
    """Requests (turns) behind per-prompt rows: an MT-Bench prompt is two requests."""
    return sum(len(r.get("chosen_bs") or [r.get("chosen_b")]) for r in rows)


PER_STEP_METHODS = tuple(m for m, d in METHODS.items() if d.per_step)
"""Eval methods whose schedule changes B after every step (the B column says so)."""


def has_gain_share(method: str) -> bool:
    """Whether the oracle gain share means anything for ``method`` (a per-request choice of B; not ``ar``, the per-step
    verify widths or transformers' own decoding)."""
    return METHODS[method].gain_share if method in METHODS else method != "ar"


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
    origin = results.get("provenance") or {}
    if origin:
        lines += [f"Run `{origin.get('run_name')}`, {origin.get('date_utc')} UTC, commit `{origin.get('git_commit') or 'unknown'}`"
                  + (f", {origin['command']}" if origin.get("command") else "") + ".", ""]
    config = {k: v for k, v in results.get("config", {}).items() if k != "block_size"}
    if config:
        lines += ["Decode config: " + ", ".join(f"{k}={v}" for k, v in config.items()), ""]
    few = False
    for title, source_set, block in sections:
        lines += [f"## {title}", "", header]
        for method, r in block.items():
            rows = method_rows(results, method, source_set)
            share = _fmt(r.get("oracle_gain_share")) if has_gain_share(method) else ""
            ci = r.get("oracle_gain_share_ci")
            if has_gain_share(method) and ci and ci[0] is not None:
                share += f" [{_fmt(ci[0])}, {_fmt(ci[1])}]"
            speed = f"{_fmt(r.get('tokens_per_s'))}"
            speedup = f"{_fmt(r.get('speedup'))}x"
            if rows and method != "ar":
                intervals = speed_intervals(results, method, source_set)
                lo, hi = intervals["tokens_per_s"]
                speed += f" [{_fmt(lo)}, {_fmt(hi)}]" if lo is not None else ""  # one prompt: no interval
                lo, hi = intervals["speedup"]
                speedup += f" [{_fmt(lo)}, {_fmt(hi)}]" if lo is not None else ""
            requests = request_count(rows) if rows else r.get("n_prompts")
            mark = ""
            if requests is not None and requests < MIN_REQUESTS:
                mark, few = " †", True
            lines.append(f"| {method}{mark} | {block_sizes_used(rows, method in PER_STEP_METHODS)} | {_fmt(r.get('tau'))} | {speed} | {speedup} | "
                         f"{share} | {_fmt(r.get('overhead_ms'), 3)} ({_fmt(r.get('overhead_pct'), 3)}%) | "
                         f"{_exact(r)} | {r.get('n_prompts')} ({requests}) |")
        lines.append("")
        gains = speed_gains(results, source_set)
        if gains:
            lines += ["Tokens/s gain, paired by prompt [bootstrap 95% CI]: " + "; ".join(
                f"`{m}` vs `{b}` {100 * g['gain']:+.1f}% [{_fmt(None if g['ci'][0] is None else 100 * g['ci'][0], 1)}, "
                f"{_fmt(None if g['ci'][1] is None else 100 * g['ci'][1], 1)}]" for m, per in gains.items() for b, g in per.items()), ""]
    bound = (results.get("verify_width") or {}).get("bound")
    if bound:
        lines += [f"## Verify-width headroom (B={bound['block_size']}, modelled)", "",
                  "Speedup over `ar` from the run's latency model and the labels' replays: `fixed` at B, and a verify width "
                  "chosen with foresight of each step's acceptance (no verify-width policy can beat it with this drafter "
                  "here), without and with a draft on every step.", "",
                  "| set | requests | fixed | foresight | foresight, drafting every step |", "|---|---|---|---|---|"]
        for name, b in [("all", bound["all"]), *bound["per_set"].items()]:
            lines.append(f"| {name} | {b['requests']} | {_fmt(b['fixed'])}x | {_fmt(b['foresight'])}x | "
                         f"{_fmt(b['foresight_drafting'])}x |")
        lines.append("")
    lines += ["B: the block sizes decoded with (a range when they varied per request or per step). tau: mean acceptance length "
              "(tokens per target verify). speedup: tokens/s over `ar` in the same run; intervals are percentile bootstrap "
              "95% over prompts (speedup paired with `ar` on the same prompts). oracle gain share: (tau - tau_fixed) / "
              "(tau_oracle - tau_fixed), bootstrap 95% interval over prompts (none for a single prompt, and no share for methods "
              "that do not choose B per request). overhead: time choosing B per request (the "
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
    """Speedup vs ``ar`` per method (bars), overall and per source set (groups on the x axis), with the percentile
    bootstrap 95% interval over prompts of each bar (``speed_intervals``, paired with ``ar``: the intervals of
    results.md) as an error bar where there is one (none for a single prompt), at a fixed size (9 x 4.5 in: 1080 x 540 px
    at the report's 120 dpi)."""
    frame = results_frame(results)
    methods = [m for m in results["methods"] if m != "ar"]
    sets = ["all"] + sorted(results.get("per_set", {}))
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        sub = frame[frame["method"] == m].set_index("set")
        values = [float(sub.loc[s, "speedup"]) if s in sub.index and sub.loc[s, "speedup"] is not None else 0.0 for s in sets]
        x = np.arange(len(sets)) + (i - (len(methods) - 1) / 2) * width
        ax.bar(x, values, width, label=m)
        spans = [speed_intervals(results, m, None if s == "all" else s)["speedup"] if method_rows(results, m, None if s == "all" else s)
                 else [None, None] for s in sets]
        drawn = [j for j, (lo, hi) in enumerate(spans) if lo is not None and hi is not None]
        if drawn:
            low = [max(0.0, values[j] - spans[j][0]) for j in drawn]
            high = [max(0.0, spans[j][1] - values[j]) for j in drawn]
            ax.errorbar(x[drawn], [values[j] for j in drawn], yerr=[low, high], fmt="none", ecolor="black", elinewidth=1,
                        capsize=3)
    ax.axhline(1.0, color="grey", lw=1, ls="--", label="ar")
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel("speedup vs ar (tokens/s)")
    ax.set_title("speedup per method and source set (error bars: bootstrap 95% intervals over prompts)")
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


def verify_width_figure(results: dict) -> Figure | None:
    """The verify-width policy at a glance (None when it did not run): the calibration's reliability (predicted vs
    observed acceptance), the chosen k against the drafter's first-draft probability, and the cost curve it used
    (``pipeline.costs``: verify ms by tokens verified, per context bucket, with the draft's cost; dots: the measured points)."""
    info = results.get("verify_width") or {}
    rows = method_rows(results, "verify_width") + method_rows(results, "hybrid")
    if not info or not rows:
        return None
    fig = Figure(figsize=(15, 4.2))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    table = info.get("reliability") or []
    if table:
        ax1.plot([0, 1], [0, 1], color="gray", lw=0.8, ls="--")
        ax1.scatter([r["predicted"] for r in table], [r["observed"] for r in table],
                    s=[8 + 40 * math.sqrt(r["count"] / max(t["count"] for t in table)) for r in table])
    ax1.set(xlabel="calibrated P(accept)", ylabel="observed acceptance", xlim=(0, 1), ylim=(0, 1),
            title=f"reliability ({info.get('reliability_split', '?')} split samples)")
    pairs = [(c, k) for r in rows for c, k in zip(r.get("confidences", []), r.get("verify_widths", [])) if c is not None]
    if pairs:
        conf, width = np.array(pairs, dtype=float).T
        edges = np.linspace(0, 1, 11)
        which = np.clip(np.digitize(conf, edges) - 1, 0, 9)
        ax2.scatter(conf, width + np.random.default_rng(0).uniform(-0.15, 0.15, len(width)), s=4, alpha=0.25)
        means = [(0.5 * (edges[i] + edges[i + 1]), width[which == i].mean()) for i in range(10) if (which == i).any()]
        ax2.plot(*zip(*means), color="black", marker="o", label="mean k")
        ax2.legend()
    ax2.set(xlabel="drafter's probability of draft 1", ylabel="drafts verified k", title="chosen verify width per step")
    b = info.get("block_size")
    if info.get("latency_model"):  # the one fitted (monotone) curve the policy read, over the measured points
        from pipeline.costs import CostModel

        costs = CostModel.from_dict(info["latency_model"])
        widths = sorted(costs.verify_points)
        for j, bucket in enumerate(costs.context_buckets):
            ax3.plot(widths, [costs.verify_ms(w, bucket) for w in widths], color=f"C{j}", label=f"verify, L={bucket}")
            ax3.plot(widths, [costs.verify_points[w][j] for w in widths], ls="none", marker=".", color=f"C{j}", alpha=0.5)
            if b and int(b) in costs.draft_points:
                ax3.axhline(costs.draft_ms(int(b), bucket), ls=":", lw=0.8, color=f"C{j}")
    ax3.set(xlabel="tokens verified (k + 1)", ylabel="ms",
            title=f"cost curve (dots: measured; dotted: draft at B={b})")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    return fig


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
    width_figure = verify_width_figure(results)
    if width_figure is not None:
        figures["verify_width"] = width_figure
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


def provenance(cfg) -> dict:
    """Where a results file came from: ``run_name``, the UTC date, the git commit of the code (``-dirty`` with local
    edits; None outside a git checkout) and the command (``python -m pipeline.evaluate`` + its overrides when known)."""
    from pipeline import PROJECT_ROOT

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short=12", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    command = None
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            command = "python -m pipeline.evaluate " + " ".join(HydraConfig.get().overrides.task)
    except (ImportError, ValueError):
        pass
    return {"run_name": str(cfg.get("run_name")), "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "git_commit": commit, "command": command}


def write_json(results: dict, out: str | Path) -> Path:
    """Write ``results`` atomically at ``out``."""
    return write_json_atomic(out, results, newline=False)


def log_summary(results: dict) -> None:
    """One log line per method (tau, tokens/s, speedup, overhead, oracle gain share where it means something,
    exact-match rate) and the paired tokens/s gains."""
    for m, r in results["methods"].items():
        share = r.get("oracle_gain_share")
        shown = f"  gain share {'-' if share is None else f'{share:.2f}'}" if has_gain_share(m) else ""
        log.info("%-16s tau %.2f  tok/s %.2f  speedup %.2fx  overhead %.3f ms (%.3f%%)%s  lossless %s", m, r["tau"],
                 r["tokens_per_s"], r["speedup"], r["overhead_ms"], r["overhead_pct"], shown, r.get("lossless"))
    for m, bases in results.get("gains", {}).get("all", {}).items():
        for base, g in bases.items():
            log.info("%s vs %s: tokens/s %+.1f%% [%s, %s]", m, base, 100 * g["gain"],
                     *("-" if c is None else f"{100 * c:+.1f}%" for c in g["ci"]))


def log_to_wandb(run, results: dict, report: dict[str, Path]) -> None:
    """Summary scalars, the results table and the figures of one eval run."""
    import wandb

    for m, r in results["methods"].items():
        run.summary.update({f"{m}/{k}": v for k, v in r.items() if isinstance(v, (int, float, bool))})
    for s, block in results.get("per_set", {}).items():
        for m, r in block.items():
            run.summary.update({f"{s}/{m}/{k}": v for k, v in r.items() if isinstance(v, (int, float, bool))})
    for s, per in results.get("gains", {}).items():  # verify_width / hybrid over fixed, best_fixed, ar (paired)
        for m, bases in per.items():
            for base, g in bases.items():
                run.summary.update({f"{s}/{m}/gain_vs_{base}": g["gain"], f"{s}/{m}/gain_vs_{base}_ci_low": g["ci"][0]})
    bound = (results.get("verify_width") or {}).get("bound")
    if bound:  # the foresight bound of any verify-width policy (modelled speedups over ar)
        for s, b in [("all", bound["all"]), *bound["per_set"].items()]:
            run.summary.update({f"{s}/verify_width_bound/{k}": v for k, v in b.items()})
    origin = results.get("provenance") or {}
    run.summary.update({f"provenance/{k}": v for k, v in origin.items() if v is not None})
    frame = results_frame(results).astype(object).where(lambda f: f.notna(), None)
    payload = {"eval/results": wandb.Table(dataframe=frame)}
    payload.update({f"eval/{name}": wandb.Image(str(path)) for name, path in report.items() if path.suffix == ".png"})
    run.log(payload)
