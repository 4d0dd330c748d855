"""The drafts' acceptance calibration: the probability that each draft is accepted, from the drafter's confidence.

A calibration maps (p_j, j), the drafter's probability of its draft j and the draft's column, to a_j, the probability
that draft j is accepted given that drafts 1..j-1 were (``AcceptanceCalibration``: a logistic regression per column,
fitted in the train stage on the label stage's replay samples and exported as ``calibration.json``). A step that
verifies the first k drafts then yields on average ``1 + sum_{i<=k} prod_{j<=i} a_j`` tokens (``pipeline.policy.widths``
chooses k from that and the step's costs).

This module imports only numpy and torch (no transformers, no model code), so a process that is not ours (the vLLM
plugin, ``pipeline.integrations.vllm``) can read a calibration.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pipeline.files import write_json_atomic

CALIBRATION_NAME = "calibration.json"
_LOGIT_CLIP = 9.0


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.double().clamp(1e-6, 1 - 1e-6)
    return torch.log(p / (1 - p)).clamp(-_LOGIT_CLIP, _LOGIT_CLIP)


@dataclass
class AcceptanceCalibration:
    """a_j = P(draft j accepted | drafts < j accepted) = sigmoid(bias[j] + slope[j] * logit(p_j)).

    One intercept and one slope per draft column j = 1..``max_column`` (later columns share the last
    ones), fitted by L2-regularised logistic regression.

    Attributes:
        bias, slope: per column (``max_column`` floats each).
        info: how it was fitted (samples, log-loss, Brier score, where from).
    """

    bias: list[float]
    slope: list[float]
    info: dict = field(default_factory=dict)

    @property
    def max_column(self) -> int:
        return len(self.bias)

    def _design(self, p: torch.Tensor, column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = (column.long().clamp(1, self.max_column) - 1)
        return index, _logit(p)

    def predict(self, p: torch.Tensor, column: torch.Tensor | None = None) -> torch.Tensor:
        """Calibrated acceptance probabilities.

        Args:
            p: [R] the drafter's probabilities of its drafts (in (0, 1]).
            column: [R] draft columns j >= 1 (default 1..R: one block's drafts in order).
        Returns:
            [R] float64 probabilities a_j.
        """
        p = torch.as_tensor(p).reshape(-1).cpu()
        column = torch.arange(1, len(p) + 1) if column is None else torch.as_tensor(column).reshape(-1).cpu()
        index, x = self._design(p, column)
        bias = torch.tensor(self.bias, dtype=torch.float64)[index]
        slope = torch.tensor(self.slope, dtype=torch.float64)[index]
        return torch.sigmoid(bias + slope * x)

    @classmethod
    def fit(cls, p: Sequence[float], column: Sequence[int], accepted: Sequence[bool], max_column: int = 16,
            l2: float = 1e-4, info: dict | None = None) -> "AcceptanceCalibration":
        """Fit on samples (the drafter's probability, draft column, accepted?).

        Raises:
            ValueError: without samples, or when every sample has the same outcome.
        """
        p_t = torch.as_tensor(np.asarray(p, dtype=np.float64))
        col = torch.as_tensor(np.asarray(column, dtype=np.int64))
        y = torch.as_tensor(np.asarray(accepted, dtype=np.float64))
        if len(p_t) == 0 or len(p_t) != len(col) or len(p_t) != len(y):
            raise ValueError("calibration needs one (probability, column, accepted) per sample, and at least one; "
                             "label with label.mode=replay label.record_confidence=true")
        if float(y.min()) == float(y.max()):
            raise ValueError(f"every calibration sample is {'accepted' if y[0] else 'rejected'}; label more prompts")
        used = int(min(max_column, int(col.max())))
        index = col.clamp(1, used) - 1
        x = _logit(p_t)
        params = torch.zeros(2, used, dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS([params], lr=1.0, max_iter=200, line_search_fn="strong_wolfe")

        def loss_fn():
            optimizer.zero_grad()
            z = params[0][index] + params[1][index] * x
            loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y) + l2 * (params ** 2).sum()
            loss.backward()
            return loss

        optimizer.step(loss_fn)
        bias, slope = params.detach()[0].tolist(), params.detach()[1].tolist()
        out = cls(bias, slope, dict(info or {}))
        a = out.predict(p_t, col)
        out.info.update({"samples": int(len(y)), "accept_rate": float(y.mean()), "l2": l2,
                         "log_loss": float(torch.nn.functional.binary_cross_entropy(a, y)),
                         "brier": float(((a - y) ** 2).mean())})
        return out

    def to_dict(self) -> dict:
        return {"kind": "logistic_per_column", "bias": list(self.bias), "slope": list(self.slope), "info": self.info}

    @classmethod
    def from_dict(cls, data: dict) -> "AcceptanceCalibration":
        """Inverse of ``to_dict``.

        Raises:
            ValueError: for another kind of calibration or unequal bias/slope lengths.
        """
        if data.get("kind") != "logistic_per_column" or len(data.get("bias", [])) != len(data.get("slope", [])) \
                or not data.get("bias"):
            raise ValueError("not a verify-width calibration (kind logistic_per_column with equal, non-empty bias and "
                             "slope); refit it with the train stage (make train, train.calibration)")
        return cls([float(b) for b in data["bias"]], [float(s) for s in data["slope"]], dict(data.get("info", {})))


def reliability(calibration: AcceptanceCalibration, p: Sequence[float], column: Sequence[int],
                accepted: Sequence[bool], bins: int = 10) -> list[dict]:
    """Reliability table: samples binned by calibrated probability, mean predicted vs observed acceptance.

    Returns:
        one ``{"lo", "hi", "predicted", "observed", "count"}`` per non-empty bin.
    """
    a = calibration.predict(torch.as_tensor(np.asarray(p, dtype=np.float64)), torch.as_tensor(np.asarray(column)))
    y = np.asarray(accepted, dtype=np.float64)
    a = a.numpy()
    edges = np.linspace(0, 1, bins + 1)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (a >= lo) & ((a < hi) | (hi == 1.0))
        if inside.any():
            out.append({"lo": float(lo), "hi": float(hi), "predicted": float(a[inside].mean()),
                        "observed": float(y[inside].mean()), "count": int(inside.sum())})
    return out


def calibration_samples(labels, ids: set[str] | None = None, block_sizes: Sequence[int] | None = None,
                        exclude_sets: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The ``conf_*`` samples of label rows (optionally only ``ids``, some block sizes, not some source sets).

    Args:
        labels: a label DataFrame (``pipeline.labeling.store.read_labels``).
    Returns:
        ``{"block", "column", "p", "accepted"}`` arrays of equal length (empty when the rows hold none).
    """
    rows = labels
    if ids is not None:
        rows = rows[rows["id"].astype(str).isin(ids)]
    if exclude_sets:
        rows = rows[~rows["source_set"].isin(list(exclude_sets))]
    parts = {k: [] for k in ("block", "column", "p", "accepted")}
    for col, key in (("conf_block", "block"), ("conf_column", "column"), ("conf_p", "p"), ("conf_ok", "accepted")):
        if col not in rows:
            return {k: np.zeros(0) for k in parts}
        for value in rows[col]:
            if value is not None:
                parts[key].append(np.asarray(value))
    out = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in parts.items()}
    if block_sizes is not None and len(out["block"]):
        keep = np.isin(out["block"], list(block_sizes))
        out = {k: v[keep] for k, v in out.items()}
    return out


def fit_from_labels(labels, train_ids: set[str] | None, test_ids: set[str] | None = None,
                    exclude_sets: Sequence[str] = (), max_column: int = 16, info: dict | None = None) -> dict:
    """Fit the calibration on the train split's samples; the reliability table on the test split (or train).

    Returns:
        ``{"calibration": AcceptanceCalibration, "reliability": [...], "reliability_split": "test" | "train"}``.
    Raises:
        ValueError: when the rows hold no samples (labels made without ``label.record_confidence``).
    """
    train = calibration_samples(labels, train_ids, exclude_sets=exclude_sets)
    if not len(train["p"]):
        raise ValueError("the label rows hold no verify-width samples (conf_* columns): relabel with label.mode=replay "
                         "label.record_confidence=true (a fresh run_name or label.out_dir)")
    calibration = AcceptanceCalibration.fit(train["p"], train["column"], train["accepted"], max_column, info=info)
    test = calibration_samples(labels, test_ids, exclude_sets=exclude_sets) if test_ids else {"p": np.zeros(0)}
    split = "test" if len(test["p"]) else "train"
    held = test if split == "test" else train
    table = reliability(calibration, held["p"], held["column"], held["accepted"])
    if split == "test":
        a = calibration.predict(torch.as_tensor(held["p"]), torch.as_tensor(held["column"]))
        y = torch.as_tensor(held["accepted"].astype(np.float64))
        calibration.info.update({"test_samples": int(len(y)), "test_brier": float(((a - y) ** 2).mean()),
                                 "test_log_loss": float(torch.nn.functional.binary_cross_entropy(a, y))})
    return {"calibration": calibration, "reliability": table, "reliability_split": split}


def export_calibration(out_dir: str | Path, fitted: dict) -> Path:
    """Write ``calibration.json`` (calibration + reliability table) atomically into ``out_dir``; returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {**fitted["calibration"].to_dict(), "reliability": fitted["reliability"],
               "reliability_split": fitted["reliability_split"]}
    path = out_dir / CALIBRATION_NAME
    return write_json_atomic(path, payload)


def find_calibration(explicit: str | None, run_dir: str | Path | None, drafter: str | None) -> Path:
    """Where a run's calibration is read: ``explicit`` when set, else ``run_dir/calibration.json`` (the train stage's
    export, ``data/predictors/<run>/verify_width``; None: no run) when present, else the drafter folder's shipped
    ``calibration.json``.

    Raises:
        FileNotFoundError: when none exists (names the train stage and the override).
    """
    from pipeline.models.loading import resolve_path

    if explicit:
        return Path(resolve_path(str(explicit)))
    tried = [Path(run_dir) / CALIBRATION_NAME] if run_dir is not None else []
    if drafter:
        tried.append(Path(resolve_path(str(drafter))) / CALIBRATION_NAME)
    for path in tried:
        if path.is_file():
            return path
    raise FileNotFoundError(f"the verify-width policy needs an acceptance calibration; none at {[str(p) for p in tried]}. "
                            "Fit one: make label/dataset/train for this run (the train stage writes it to train.calibration.out), "
                            "or point policy.verify_width.calibration at one (eval and serve)")


def load_calibration(path: str | Path) -> AcceptanceCalibration:
    """A calibration from ``calibration.json`` or a folder holding one.

    Raises:
        FileNotFoundError: when there is none (names the train stage); ValueError: for a file of another kind.
    """
    path = Path(path)
    file = path / CALIBRATION_NAME if path.is_dir() or not path.suffix else path
    if not file.is_file():
        raise FileNotFoundError(f"no verify-width calibration at {file}; fit one in the train stage (make train, after "
                                "make label/dataset), or point policy.verify_width.calibration at one")
    return AcceptanceCalibration.from_dict(json.loads(file.read_text()))
