"""The drafts' acceptance calibration: the probability that each draft is accepted, from the drafter's confidence.

A calibration maps (p_j, j), the drafter's probability of its draft j and the draft's column, to a_j, the probability
that draft j is accepted given that drafts 1..j-1 were (``AcceptanceCalibration``: a logistic regression per column,
fitted in the train stage on the label stage's replay samples and exported as ``calibration.json``). A step that
verifies the first k drafts then yields on average ``1 + sum_{i<=k} prod_{j<=i} a_j`` tokens (``pipeline.policy.widths``
chooses k from that and the step's costs).

A draft tree also verifies the drafter's lower-ranked candidates (``pipeline.policy.trees``). Their acceptance is not
the first choice's at the same probability (a second choice at p = 0.2 is taken more often than a first choice at
0.2: the first choice's own miss makes room for it), so the calibration carries one logistic regression per rank
r >= 1 as well (``rank_bias``/``rank_slope``/``rank_first``: P(the target's token is candidate r | the path to its
parent accepted) from the candidate's probability and the first choice's at the same position), fitted on the label
stage's candidate records (``conf_top_p``/``conf_rank``). A calibration without them (fitted before they existed, or
by the vLLM plugin's refit) reads every rank with the per-column model.

This module imports only numpy and torch (no transformers, no model code), so a process that is not ours (the vLLM
plugin, ``pipeline.integrations.vllm``) can read a calibration.
"""

from __future__ import annotations

import functools
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
    ones), fitted by L2-regularised logistic regression; for a tree's candidate of rank r >= 1 with probability p_r at a
    position whose first choice has p_0: ``sigmoid(rank_bias[r-1] + rank_slope[r-1] * logit(p_r) + rank_first[r-1] *
    logit(p_0))`` (later ranks share the last; none: the column's model on p_r).

    Attributes:
        bias, slope: per column (``max_column`` floats each).
        rank_bias, rank_slope, rank_first: per rank 1..``max_rank`` (empty: ranks read the per-column model).
        info: how it was fitted (samples, log-loss, Brier score, where from).
    """

    bias: list[float]
    slope: list[float]
    info: dict = field(default_factory=dict)
    rank_bias: list[float] = field(default_factory=list)
    rank_slope: list[float] = field(default_factory=list)
    rank_first: list[float] = field(default_factory=list)

    @property
    def max_column(self) -> int:
        return len(self.bias)

    def _design(self, p: torch.Tensor, column: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        index = (column.long().clamp(1, self.max_column) - 1)
        return index, _logit(p)

    @functools.cached_property
    def _tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(bias, slope, [rank_bias, rank_slope, rank_first]) as float64 tensors, made once (``predict`` runs every
        drafted step; the coefficients do not change after a fit or a load)."""
        return (torch.tensor(self.bias, dtype=torch.float64), torch.tensor(self.slope, dtype=torch.float64),
                torch.tensor([self.rank_bias, self.rank_slope, self.rank_first], dtype=torch.float64))

    @property
    def max_rank(self) -> int:
        """The ranks >= 1 with a model of their own (0: none)."""
        return len(self.rank_bias)

    def predict(self, p: torch.Tensor, column: torch.Tensor | None = None, rank: torch.Tensor | None = None,
                first: torch.Tensor | None = None) -> torch.Tensor:
        """Calibrated acceptance probabilities.

        Args:
            p: [R] the drafter's probabilities of its drafts (in (0, 1]).
            column: [R] draft columns j >= 1 (default 1..R: one block's drafts in order).
            rank: [R] each candidate's rank at its column (0: the drafter's first choice; default all 0).
            first: [R] the drafter's probability of the first choice at each candidate's column (needed with ranks >= 1
                when the calibration has rank models).
        Returns:
            [R] float64 probabilities a_j.
        """
        p = torch.as_tensor(p).reshape(-1).cpu()
        column = torch.arange(1, len(p) + 1) if column is None else torch.as_tensor(column).reshape(-1).cpu()
        index, x = self._design(p, column)
        bias, slope, ranks = self._tables
        z = bias[index] + slope[index] * x
        if rank is not None and self.max_rank:
            rank = torch.as_tensor(rank).reshape(-1).cpu().long()
            if first is None:
                raise ValueError("a rank model reads the first choice's probability at each column: pass first=")
            r = rank.clamp(1, self.max_rank) - 1
            w = ranks[:, r]
            lower = w[0] + w[1] * x + w[2] * _logit(torch.as_tensor(first).reshape(-1).cpu())
            z = torch.where(rank > 0, lower, z)
        return torch.sigmoid(z)

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
        x = _logit(p_t)
        bias, slope = _logistic(torch.stack([torch.ones_like(x), x], dim=1), col.clamp(1, used) - 1, y, used, l2)
        out = cls(bias, slope, dict(info or {}))
        a = out.predict(p_t, col)
        out.info.update({"samples": int(len(y)), "accept_rate": float(y.mean()), "l2": l2,
                         "log_loss": float(torch.nn.functional.binary_cross_entropy(a, y)),
                         "brier": float(((a - y) ** 2).mean())})
        return out

    def with_ranks(self, top_p: np.ndarray, rank: np.ndarray, l2: float = 1e-4) -> "AcceptanceCalibration":
        """This calibration with a model per candidate rank 1..k-1, fitted on candidate records.

        Args:
            top_p: [N, k] the drafter's probabilities of its k best candidates at each sample's column (best first).
            rank: [N] the rank among them of the target's token (-1: none of them).
        Raises:
            ValueError: for k < 2, no samples, or no lower-ranked candidate ever taken (a rank never taken gets a
                strongly negative intercept under the L2 penalty).
        """
        top_p, rank = np.asarray(top_p, dtype=np.float64), np.asarray(rank, dtype=np.int64)
        if top_p.ndim != 2 or top_p.shape[1] < 2 or len(top_p) == 0 or len(top_p) != len(rank):
            raise ValueError("a rank-aware calibration needs candidate records of k >= 2 candidates per sample "
                             "(label.record_confidence=true, label.tree_top_k >= 2)")
        k = top_p.shape[1]
        p = torch.as_tensor(top_p[:, 1:].reshape(-1))
        first = torch.as_tensor(top_p[:, :1]).expand(-1, k - 1).reshape(-1)
        x = _logit(p)
        index = torch.arange(k - 1).repeat(len(rank))
        y = torch.as_tensor((rank[:, None] == np.arange(1, k)[None, :]).reshape(-1).astype(np.float64))
        if not float(y.max()):
            raise ValueError(f"no candidate of rank >= 1 was taken in {len(rank)} samples; label more prompts")
        weights = _logistic(torch.stack([torch.ones_like(x), x, _logit(first)], dim=1), index, y, k - 1, l2)
        out = AcceptanceCalibration(list(self.bias), list(self.slope), dict(self.info), *weights)
        a = out.predict(p, torch.ones(len(x), dtype=torch.long), index + 1, first)
        out.info["ranks"] = [{"rank": r + 1, "samples": int((index == r).sum()), "taken": float(y[index == r].mean()),
                              "predicted": float(a[index == r].mean())} for r in range(k - 1)]
        return out

    def to_dict(self) -> dict:
        out = {"kind": "logistic_per_column", "bias": list(self.bias), "slope": list(self.slope), "info": self.info}
        if self.max_rank:
            out.update(rank_bias=list(self.rank_bias), rank_slope=list(self.rank_slope), rank_first=list(self.rank_first))
        return out

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
        ranks = [[float(v) for v in data.get(key, [])] for key in ("rank_bias", "rank_slope", "rank_first")]
        if len({len(r) for r in ranks}) != 1:
            raise ValueError("a calibration's rank_bias, rank_slope and rank_first must have equal lengths; refit it with "
                             "the train stage (make train, train.calibration)")
        return cls([float(b) for b in data["bias"]], [float(s) for s in data["slope"]], dict(data.get("info", {})), *ranks)


def _logistic(x: torch.Tensor, index: torch.Tensor, y: torch.Tensor, groups: int, l2: float) -> list[list[float]]:
    """L2-regularised logistic regression with one weight vector per group over the design ``x`` [N, F]:
    ``sigmoid(x[i] . w[index[i]])``. Returns the F lists of ``groups`` weights (feature by feature)."""
    params = torch.zeros(x.shape[1], groups, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([params], lr=1.0, max_iter=200, line_search_fn="strong_wolfe")

    def loss_fn():
        optimizer.zero_grad()
        z = (x * params[:, index].T).sum(dim=1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y) + l2 * (params ** 2).sum()
        loss.backward()
        return loss

    optimizer.step(loss_fn)
    return params.detach().tolist()


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
        ``{"block", "column", "p", "accepted"}`` arrays of equal length (empty when the rows hold none) and, from the
        rows that hold candidate records (``conf_top_p``/``conf_rank``), ``"candidates"``: the same keys for those
        samples plus ``"top_p"`` [N, k] and ``"rank"`` [N] (empty arrays when no row holds them).
    """
    rows = labels
    if ids is not None:
        rows = rows[rows["id"].astype(str).isin(ids)]
    if exclude_sets:
        rows = rows[~rows["source_set"].isin(list(exclude_sets))]
    columns = (("conf_block", "block"), ("conf_column", "column"), ("conf_p", "p"), ("conf_ok", "accepted"))
    extra = (("conf_top_p", "top_p"), ("conf_rank", "rank"))
    parts = {k: [] for _, k in columns}
    ranked = {k: [] for _, k in columns + extra}
    if all(col in rows for col, _ in columns):
        with_ranks = all(col in rows for col, _ in extra)
        for _, row in rows.iterrows():
            if row["conf_p"] is None:
                continue
            for col, key in columns:
                parts[key].append(np.asarray(row[col]))
            if with_ranks and row["conf_top_p"] is not None and len(row["conf_top_p"]):
                for col, key in columns + extra:
                    ranked[key].append(np.stack(list(row[col])) if key == "top_p" else np.asarray(row[col]))

    def join(group: dict) -> dict[str, np.ndarray]:
        out = {k: (np.concatenate(v) if v else np.zeros((0, 0) if k == "top_p" else 0)) for k, v in group.items()}
        if block_sizes is not None and len(out["block"]):
            keep = np.isin(out["block"], list(block_sizes))
            out = {k: v[keep] for k, v in out.items()}
        return out

    out = join(parts)
    out["candidates"] = join(ranked)
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
    if len(train["candidates"]["rank"]) and train["candidates"]["top_p"].shape[1] > 1:
        calibration = calibration.with_ranks(train["candidates"]["top_p"], train["candidates"]["rank"])
    test = calibration_samples(labels, test_ids, exclude_sets=exclude_sets) if test_ids else {"p": np.zeros(0)}
    split = "test" if len(test["p"]) else "train"
    held = test if split == "test" else train
    table = reliability(calibration, held["p"], held["column"], held["accepted"])
    if split == "test":
        a = calibration.predict(torch.as_tensor(held["p"]), torch.as_tensor(held["column"]))
        y = torch.as_tensor(held["accepted"].astype(np.float64))
        calibration.info.update({"test_samples": int(len(y)), "test_brier": float(((a - y) ** 2).mean()),
                                 "test_log_loss": float(torch.nn.functional.binary_cross_entropy(a, y))})
    if calibration.max_rank:
        calibration.info["rank_table"] = rank_table(calibration, held["candidates"])
        calibration.info["rank_table_split"] = split
    return {"calibration": calibration, "reliability": table, "reliability_split": split}


def rank_table(calibration: AcceptanceCalibration, candidates: dict[str, np.ndarray], max_column: int = 4) -> list[dict]:
    """Per (column, rank), of the candidates offered (their column reached): how many, the share the target took and
    the calibration's mean estimate (columns beyond ``max_column`` pooled into it).

    Args:
        candidates: ``calibration_samples(...)["candidates"]``.
    Returns:
        one ``{"column", "rank", "offered", "taken", "estimated"}`` per (column, rank) with samples.
    """
    top_p, rank = candidates["top_p"], candidates["rank"]
    if not len(rank):
        return []
    column = np.minimum(candidates["column"], max_column)
    out = []
    for j in range(1, max_column + 1):
        at = column == j
        if not at.any():
            continue
        for r in range(top_p.shape[1]):
            p = torch.as_tensor(top_p[at, r])
            a = calibration.predict(p, torch.full((len(p),), j), torch.full((len(p),), r), torch.as_tensor(top_p[at, 0]))
            out.append({"column": j, "rank": r, "offered": int(at.sum()), "taken": float((rank[at] == r).mean()),
                        "estimated": float(a.mean())})
    return out


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
