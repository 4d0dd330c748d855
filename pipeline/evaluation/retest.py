"""The per-request policy re-tested where it could win: leave-one-set-out folds, tau and speed labels, offline
(the library of the ``retest`` entry point, ``pipeline.retest``).

    python -m pipeline.retest run_name=main                      # the labels of make all
    python -m pipeline.retest experiment=policy                  # candidates 1..16 (conf/experiment/policy.yaml)

For every label target in ``retest.targets`` (``tau``: tau-optimal labels; ``speed``: tokens/s-optimal, from the
label stage's latency model) and every source set of the labels, one fold holds that set out entirely
(``dataset.holdout_set``): the dataset stage builds the features from the other sets (train/validation), the train
stage fits and exports the predictor (its bootstrap deploy check included), and the held-out set's requests score
it offline against their labels: the value (tau, or tokens/s) of the predictor's pick against ``fixed`` (the
training block size), ``best_fixed`` (the train split's best single B) and ``oracle`` (each request's best), with
the oracle gain share (pick - fixed) / (oracle - fixed) and a percentile bootstrap 95% interval over requests.

Offline means the label stage's measured tau(B) and its latency-model tokens/s, not a new decode: the eval stage
remains the final measurement for a predictor worth deploying. Writes ``retest.out/retest.json`` and ``retest.md``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.files import write_atomic

log = logging.getLogger(__name__)


def fold_scores(predictor, dd, target: str) -> dict[str, np.ndarray]:
    """The held-out split's per-request values (``tau`` or ``tokens_per_s``) [n, C], the train split's, and the
    predictor's picks [n] (class indices, its deploy rule included)."""
    from pipeline.policy.training import split_tensors

    test = split_tensors(dd["test"], "tau")
    with torch.no_grad():
        scores = predictor.net(test["x"], test.get("ids"), test.get("id_weights"))
    picks = [predictor.candidates.index(int(b)) for b in predictor.choose(scores)]  # block sizes -> class indices
    column = "tau" if target == "tau" else "tokens_per_s"
    values = np.asarray(dd["test"].with_format("numpy", columns=[column])[column], dtype=np.float64)
    train_values = np.asarray(dd["train"].with_format("numpy", columns=[column])[column], dtype=np.float64)
    return {"values": values, "train_values": train_values, "picks": np.asarray(picks, dtype=np.int64)}


def gain_share(values: np.ndarray, pick_index: np.ndarray, fixed_index: int, samples: int = 1000,
               seed: int = 0) -> dict:
    """Offline comparison of per-request picks on ``values`` [n, C]: means of pick / fixed / oracle and the gain share.

    Returns:
        ``{"pick", "fixed", "oracle", "gain_share", "gain_share_ci", "departures", "n"}``; the share and its interval are
        None when the oracle gains nothing over fixed.
    """
    n = len(values)
    pick = values[np.arange(n), pick_index]
    fixed = values[:, fixed_index]
    oracle = values.max(1)

    def share(idx):
        gain = oracle[idx].mean(-1) - fixed[idx].mean(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(gain > 1e-12, (pick[idx].mean(-1) - fixed[idx].mean(-1)) / gain, np.nan)

    from pipeline.evaluation.stats import bootstrap_interval

    point = float(share(np.arange(n)))
    finite = np.isfinite(point)
    return {"pick": float(pick.mean()), "fixed": float(fixed.mean()), "oracle": float(oracle.mean()),
            "gain_share": point if finite else None,
            "gain_share_ci": bootstrap_interval(share, n, samples, seed) if finite else [None, None],
            "departures": int((pick_index != fixed_index).sum()), "n": int(n)}


def run_retest(cfg: DictConfig) -> dict:
    """Every (target, held-out set) fold (see the module docstring); returns the results dict.

    Raises:
        FileNotFoundError: without labels; ValueError: for an unknown target or held-out set.
    """
    from pipeline.policy.data import build_dataset, load_feature_dataset, read_label_table
    from pipeline.policy.export import load_predictor
    from pipeline.policy.fallback import ALWAYS_FALLBACK
    from pipeline.policy.training import TARGETS, train_predictor

    r = cfg.retest
    labels, meta = read_label_table(r.labels_dir)
    sets = list(r.holdout_sets) if r.get("holdout_sets") else sorted(labels["source_set"].unique())
    targets = [str(t) for t in r.targets]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"retest.targets {unknown}: choose from {list(TARGETS)}")
    out = Path(r.out)
    results = {"labels_dir": str(r.labels_dir), "candidates": [int(c) for c in labels["candidates"].iloc[0]],
               "training_block_size": meta.get("training_block_size"), "features": OmegaConf.to_container(cfg.features, resolve=True),
               "predictor": str(cfg.predictor.name), "folds": {}}
    boot = r.get("bootstrap") or {}
    for target in targets:
        for holdout in sets:
            fold = out / target / holdout
            base = OmegaConf.to_container(cfg, resolve=True)
            base["dataset"].update({"labels_dir": str(r.labels_dir), "out": str(fold / "features"), "holdout_set": holdout})
            base["train"].update({"features_dir": str(fold / "features"), "out": str(fold / "predictor"), "target": target,
                                  "calibration": None})
            base.setdefault("logger", {})["enabled"] = False
            fold_cfg = OmegaConf.create(base)
            log.info("fold target=%s holdout=%s", target, holdout)
            build_dataset(fold_cfg)
            train_predictor(fold_cfg)
            dd, info = load_feature_dataset(fold / "features")
            predictor = load_predictor(fold / "predictor")
            scored = fold_scores(predictor, dd, target)
            candidates = [int(c) for c in info["candidates"]]
            trained_b = info.get("training_block_size")
            fixed_index = candidates.index(trained_b) if trained_b in candidates else int(np.argmax(scored["train_values"].mean(0)))
            best_index = int(np.argmax(scored["train_values"].mean(0)))
            entry = gain_share(scored["values"], scored["picks"], fixed_index, int(boot.get("samples", 1000)),
                               int(boot.get("seed", 0)))
            entry["best_fixed"] = float(scored["values"][:, best_index].mean())
            entry["best_fixed_block_size"] = candidates[best_index]
            entry["fixed_block_size"] = candidates[fixed_index]
            entry["picked_block_sizes"] = {str(candidates[i]): int((scored["picks"] == i).sum()) for i in np.unique(scored["picks"])}
            fallback = predictor.meta.get("fallback") or {}
            entry["deploy_check_kept_departures"] = float(fallback.get("margin", 0.0)) < ALWAYS_FALLBACK
            results["folds"].setdefault(target, {})[holdout] = entry
    write_retest(results, out)
    return results


def markdown(results: dict) -> str:
    """The folds as Markdown tables, one per label target."""
    lines = ["# Per-request policy re-test (leave one set out, offline on labels)", "",
             f"Candidates {results['candidates']}, training B {results['training_block_size']}, predictor "
             f"`{results['predictor']}`, features `{results['features'].get('name')}` ({results['features'].get('parts')}).", ""]
    for target, folds in results["folds"].items():
        unit = "tau (tokens)" if target == "tau" else "tokens/s (latency model)"
        lines += [f"## Labels by {target}: {unit}", "",
                  "| held-out set | requests | fixed | best_fixed | blockpilot | oracle | gain share [95% CI] | departures | picks |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for holdout, e in folds.items():
            ci = e["gain_share_ci"]
            share = "–" if e["gain_share"] is None else f"{e['gain_share']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci[0] is not None else "")
            picks = ", ".join(f"B={b}: {c}" for b, c in e["picked_block_sizes"].items())
            lines.append(f"| {holdout} | {e['n']} | {e['fixed']:.3f} (B={e['fixed_block_size']}) | {e['best_fixed']:.3f} "
                         f"(B={e['best_fixed_block_size']}) | {e['pick']:.3f} | {e['oracle']:.3f} | {share} | {e['departures']} | {picks} |")
        lines.append("")
    return "\n".join(lines)


def write_retest(results: dict, out: Path) -> None:
    """``retest.json`` and ``retest.md`` into ``out``, atomically."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("retest.json", json.dumps(results, indent=2)), ("retest.md", markdown(results))):
        write_atomic(out / name, text + "\n")
