"""results.md and the figures on a hand-made results dict (values checked by hand)."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from pipeline.evaluation.report import (MIN_REQUESTS, block_sizes_used, confusion, fallback_note, markdown_table, request_count,
                                speed_intervals, speedup_bars)


def row(pid, source_set, tokens, ms, chosen, steps=4, tau=2.0, block_sizes=None):
    return {"id": pid, "source_set": source_set, "new_tokens": tokens, "prefill_ms": 0.0, "schedule_ms": 0.0,
            "decode_ms": ms, "chosen_b": chosen[0], "chosen_bs": chosen, "steps": steps, "tau": tau,
            "block_sizes": sorted(set(chosen)) if block_sizes is None else block_sizes}


def results_of(rows: dict) -> dict:
    methods = {m: {"rows": r, "tau": 1.5, "tokens_per_s": 10.0, "speedup": 1.0, "n_prompts": len(r),
                   "oracle_gain_share": 0.5, "oracle_gain_share_ci": [0.1, 0.9], "overhead_ms": 0.0, "overhead_pct": 0.0,
                   "lossless": True} for m, r in rows.items()}
    return {"config": {"max_new_tokens": 8, "temperature": 0.0, "seed": 0, "block_size": None}, "methods": methods,
            "per_set": {}, "predictors": {"blockpilot": {"fallback": {"block_size": 8, "margin": 1.01}}}}


def test_table_names_the_b_used_counts_requests_and_marks_small_rows():
    rows = {"ar": [row("a", "s", 10, 1000.0, [1]), row("b", "s", 10, 1000.0, [1, 1])],
            "fixed": [row("a", "s", 10, 500.0, [8], block_sizes=[2, 8]), row("b", "s", 10, 2000.0, [8, 8])],  # 2: clipped
            "ema": [row("a", "s", 10, 500.0, [8], block_sizes=[6, 8, 10]), row("b", "s", 10, 500.0, [8, 8])]}
    results = results_of(rows)
    table = markdown_table(results)
    assert "block_size=None" not in table
    assert request_count(rows["fixed"]) == 3 and block_sizes_used(rows["fixed"]) == "8"
    assert block_sizes_used(rows["ema"]) == "8, per step up to 10"
    assert block_sizes_used([row("a", "s", 1, 1.0, [6]), row("b", "s", 1, 1.0, [9, 7])]) == "6-9"
    assert block_sizes_used([row("a", "s", 1, 1.0, [8], block_sizes=[6, 8])], per_step=True) == "8, per step"
    assert "| ema † | 8, per step up to 10 |" in table
    assert "| fixed † | 8 |" in table and "| 2 (3) |" in table and 3 < MIN_REQUESTS and "†: fewer than" in table
    ar_line = next(line for line in table.splitlines() if line.startswith("| ar"))
    assert "0.50" not in ar_line  # ar drafts nothing: no oracle gain share
    # fixed: prompt a 20 tok/s (ar 10), prompt b 5 tok/s (ar 10); resamples {a,a}, {a,b}, {b,b} -> 20, 8, 5 tok/s
    intervals = speed_intervals(results, "fixed", samples=2000, seed=0)
    assert intervals["tokens_per_s"][0] == pytest.approx(5.0) and intervals["tokens_per_s"][1] == pytest.approx(20.0)
    assert intervals["speedup"] == pytest.approx([0.5, 2.0])
    assert "[5.00, 20.00]" in table and "[0.50, 2.00]x" not in table and "[0.50, 2.00]" in table


def test_speedup_figure_is_readable_and_confusion_says_when_the_check_fell_back():
    rows = {m: [row("a", "s", 10, 1000.0, [b])] for m, b in (("ar", 1), ("fixed", 8), ("blockpilot", 8))}
    results = results_of(rows)
    results["per_set"] = {f"set{i}": results["methods"] for i in range(5)}
    canvas = FigureCanvasAgg(speedup_bars(results))
    canvas.figure.set_dpi(120)
    canvas.draw()
    assert canvas.get_width_height() == (1080, 540)
    note = fallback_note(results, "blockpilot")
    assert note == "deploy check fell back: always B_train=8" and fallback_note(results, "fixed") is None
    assert note in confusion([8, 8], [6, 8], [6, 8], "blockpilot vs label", note).axes[0].get_title()


def test_speedup_figure_draws_the_bootstrap_intervals(tmp_path):
    """Each bar with two or more prompts gets its speedup's 95% interval (the one results.md prints); one prompt: none."""
    rows = {"ar": [row("a", "s", 10, 1000.0, [1]), row("b", "s", 10, 1000.0, [1]), row("c", "t", 10, 1000.0, [1])],
            "fixed": [row("a", "s", 10, 500.0, [8]), row("b", "s", 10, 2000.0, [8]), row("c", "t", 10, 800.0, [8])],
            "ema": [row("a", "s", 10, 400.0, [8]), row("b", "s", 10, 600.0, [8]), row("c", "t", 10, 900.0, [8])]}
    results = results_of(rows)
    results["methods"]["fixed"]["speedup"], results["methods"]["ema"]["speedup"] = 1.1, 2.0
    results["per_set"] = {"s": {m: dict(results["methods"][m]) for m in rows}, "t": {m: dict(results["methods"][m]) for m in rows}}
    fig = speedup_bars(results)
    ax = fig.axes[0]
    from matplotlib.container import ErrorbarContainer

    errorbars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(errorbars) == 2  # fixed, ema
    segments = {m: [tuple(np.round(seg[:, 1], 6)) for seg in c.lines[2][0].get_segments()] for m, c in zip(("fixed", "ema"), errorbars)}
    for m in ("fixed", "ema"):
        expected = [tuple(np.round(speed_intervals(results, m, s)["speedup"], 6)) for s in (None, "s")]
        assert segments[m] == expected, m  # "all" and set s; set t has one prompt: no interval
    assert segments["fixed"][1] == (0.5, 2.0)
    canvas = FigureCanvasAgg(fig)
    canvas.figure.set_dpi(120)
    canvas.print_png(str(tmp_path / "speedup.png"))
    assert (tmp_path / "speedup.png").stat().st_size > 10_000
