"""Print what scripts/gpu_check.sh has measured so far: ``python scripts/gpu_check_summary.py DEST STEP``.

STEP is one of versions, cost_curve, eval, label, bench_label (that step's figures) or ``all``. A file that is
missing (a step not run yet, failed or cut off) is reported as such; nothing here measures anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FLAT = 1.25  # a cost curve is "flat" when a forward of the widest q costs at most this many times a 1-token one


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def versions(dest: Path) -> None:
    v = _load(dest / "versions.json")
    if v is None:
        print("versions: not measured")
        return
    device = v.get("gpu") or v.get("cpu")
    print(f"versions: torch {v['torch']} (CUDA {v['torch_cuda']}, cuDNN {v['cudnn']}), transformers {v['transformers']}, "
          f"python {v['python']}, {v['device']}: {device}"
          + (f" (sm {v['compute_capability']}, {v['gpu_memory_gib']} GiB)" if v.get("gpu") else ""))


def cost_curve(dest: Path) -> None:
    data = _load(dest / "cost_curve.json")
    if data is None:
        print("cost curve: not measured")
        return
    path = data.get("forward_path") or {}
    print(f"cost curve ({data['info']['device']}, {data['info']['dtype']}, backend {data['backend']}, batch-invariant "
          f"{path.get('batch_invariant')}):")
    for context, fig in data["by_context"].items():
        widths = sorted(fig["forward_ms"], key=int)
        one = fig["forward_ms"][widths[0]]
        ratios = {q: fig["forward_ms"][q] / one for q in widths}
        verdict = "flat" if max(ratios.values()) <= FLAT else "rising"
        print(f"  context {context}: forward ms by q " + ", ".join(f"{q}: {fig['forward_ms'][q]:.2f}" for q in widths)
              + f"; cost(q)/cost(1) up to {max(ratios.values()):.2f} -> {verdict} (flat: <= {FLAT})")
        print(f"  context {context}: ar {fig['ar_ms']:.2f} ms, step/ar by B "
              + ", ".join(f"{b}: {r:.2f}" for b, r in sorted(fig["step_over_ar"].items(), key=lambda kv: int(kv[0]))))


def eval_(dest: Path) -> None:
    ev = _load(dest / "eval.json")
    if ev is None:
        print("eval: not measured")
        return
    path = ev.get("forward_path") or {}
    print(f"eval (forward path {path.get('backend')}, batch-invariant {path.get('batch_invariant')}):")
    for m, r in ev["methods"].items():
        print(f"  {m:12s} tau {r['tau']:.2f}  tokens/s {r['tokens_per_s']:.1f}  speedup {r['speedup']:.2f}x  "
              f"exact match vs ar {r.get('lossless')}")
    methods = ev["methods"]
    if "verify_width" in methods and "fixed" in methods:
        vw, fixed = methods["verify_width"], methods["fixed"]
        print(f"  verify_width vs fixed: tokens/s {vw['tokens_per_s'] / fixed['tokens_per_s']:.3f}x, vs ar: "
              f"{vw['speedup']:.3f}x")


def label(dest: Path) -> None:
    directory = dest / "labels"
    if not any(directory.glob("shard-*.parquet")):
        print("label: not measured")
        return
    from pipeline.labeling.store import read_labels

    labels = read_labels(directory)
    cands = list(labels["candidates"].iloc[0])
    mean_tau = [float(sum(t[i] for t in labels["tau"]) / len(labels)) for i in range(len(cands))]
    print(f"label {len(labels)} prompts  mean tau per B {dict(zip([int(c) for c in cands], [round(t, 2) for t in mean_tau]))}")
    print(f"label_tau counts {labels['label_tau'].value_counts().sort_index().to_dict()}  "
          f"label_speed counts {labels['label_speed'].value_counts().sort_index().to_dict()}")


def bench_label(dest: Path) -> None:
    bench = _load(dest / "bench_label.json")
    if bench is None:
        print("bench_label: not measured")
        return
    for k in bench["replay_over_ar"]:
        print(f"bench K={k}: replay {bench['replay_over_ar'][k]:.2f}x AR, brute {bench['brute_over_ar'][k]:.2f}x AR")
    if "tau_agreement" in bench:
        rank = bench.get("latency_rank_agreement") or {}
        print(f"bench {bench.get('dtype')} exact match: speculative output == B=1 output in {bench['output_agreement']:.3f} "
              f"of {bench.get('pairs')} (prompt, B) decodes")
        print(f"bench agreement of replay with brute force: tau {bench['tau_agreement']:.3f}  "
              f"label {bench['label_agreement']:.3f}  latency spearman {rank.get('spearman')}  kendall {rank.get('kendall')}")
        for d in bench.get("disagreements", [])[:10]:
            print("  disagreement", d)


STEPS = {"versions": versions, "cost_curve": cost_curve, "eval": eval_, "label": label, "bench_label": bench_label}

if __name__ == "__main__":
    dest, which = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "all")
    for name, show in STEPS.items():
        if which in ("all", name):
            show(dest)
