"""Verify width per step: after the drafter drafts a block, verify only the first k drafts that pay.

The drafter drafts B-1 tokens in one forward (as in every DFlash step) and reports its probability
p_j of each draft (``pipeline.decoding.sampling.draft_confidence``). A calibration maps (p_j, j) to
a_j, the probability that draft j is accepted given that drafts 1..j-1 were; then a step that verifies
the first k drafts yields on average

    E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j  tokens  (the bonus token included)

and costs ``draft_ms(B, L) + verify_ms(k+1, L)`` on this machine (``pipeline.costs.CostModel``: the measured
step costs by width and context length L, one monotone curve shared with the label stage). ``VerifyWidthSchedule`` picks the k
in 0..B-1 with the most expected tokens per ms (k = 0 is a plain target step). When even the best k
was not worth the draft (fewer expected tokens per ms than a plain step without drafting), the next
steps skip the drafter (1, 2, 4, ... up to ``max_skip`` steps, then it drafts again to look); the
target's features keep flowing to the drafter, so drafting resumes where it left off. Every choice is
lossless: the target still decides every token.

The calibration (``AcceptanceCalibration``) is a logistic regression fitted in the train stage on the
label stage's replay samples (``conf_*`` label columns: for every step of every candidate B, the
columns 1..first rejection), exported as ``calibration.json`` beside the predictors
(``train.calibration``: ``make train`` writes ``data/predictors/<run>/verify_width/calibration.json``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from pipeline.costs import CostModel

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
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def find_calibration(explicit: str | None, run_dir: str | Path, drafter: str | None) -> Path:
    """Where a run's calibration is read: ``explicit`` when set, else ``run_dir/calibration.json`` (the train stage's
    export, ``data/predictors/<run>/verify_width``) when present, else the drafter folder's shipped ``calibration.json``.

    Raises:
        FileNotFoundError: when none exists (names the train stage and the override).
    """
    from pipeline.models.loading import resolve_path

    if explicit:
        return Path(resolve_path(str(explicit)))
    tried = [Path(run_dir) / CALIBRATION_NAME]
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


# ---------------------------------------------------------------------------------------------------
# the per-step choice
# ---------------------------------------------------------------------------------------------------
def expected_tokens(a: torch.Tensor) -> torch.Tensor:
    """E(k) for k = 0..R from per-draft acceptance probabilities a [R]: [R+1] tokens (E(0) = 1)."""
    a = torch.as_tensor(a, dtype=torch.float64).reshape(-1)
    return torch.cat([torch.ones(1, dtype=torch.float64), 1 + torch.cumsum(torch.cumprod(a, 0), 0)])


def best_width(a: torch.Tensor, draft_ms: float, verify_ms: Sequence[float], rate: float | None = None) -> tuple[int, float]:
    """The k in 0..len(a) that maximises the step's expected tokens per ms, or, given the decode's long-run ``rate``
    (tokens per ms), its expected tokens minus ``rate`` x its cost (the renewal-reward rule: a draft is verified when
    its chance of acceptance pays for its share of the verify at the rate the decode already runs).

    Args:
        a: [R] calibrated acceptance probabilities of drafts 1..R.
        draft_ms: cost of the drafter forward already run (ms).
        verify_ms: cost of a target verify over k+1 tokens for k = 0..R (R+1 values, ms).
        rate: None (maximise tokens per ms) or the long-run tokens per ms.
    Returns:
        (k, the step's expected tokens per ms at k).
    Raises:
        ValueError: when ``verify_ms`` does not have len(a)+1 values.
    """
    expected = expected_tokens(a)
    if len(verify_ms) != len(expected):
        raise ValueError(f"need {len(expected)} verify costs (k = 0..{len(expected) - 1}), got {len(verify_ms)}")
    cost = float(draft_ms) + torch.as_tensor(verify_ms, dtype=torch.float64)
    per_ms = expected / cost
    objective = per_ms if rate is None else expected - float(rate) * cost
    k = int(torch.argmax(objective))  # first maximum: the narrower verify on ties
    return k, float(per_ms[k])


class VerifyWidthSchedule:
    """Drafts at block size B, verifies the k drafts that maximise expected tokens per ms (see module docstring).

    Args:
        calibration: the drafts' acceptance calibration.
        costs: the machine's ``pipeline.costs.CostModel`` (step costs by width and context length, ms).
        block_size: B drafted each step (the drafter's training block size by default in the eval stage).
        predictor: a BlockPilot ``Predictor``; when given, B is its choice after prefill (method ``hybrid``).
        skip_drafts: skip the drafter for a while after a step whose draft did not pay.
        max_skip: the longest run of skipped drafts before the drafter looks again (steps).
        objective: ``rate`` (each step's expected tokens per ms) or ``marginal`` (expected tokens minus the request's
            running tokens-per-ms x cost, ``best_width``'s renewal-reward rule).
    Attributes:
        max_block_size: the largest B it may pick; widths: k of every ``choose_width`` call.
    Raises:
        ValueError: for B < 2 or max_skip < 0.
    """

    def __init__(self, calibration: AcceptanceCalibration, costs: CostModel, block_size: int, predictor=None,
                 skip_drafts: bool = True, max_skip: int = 8, objective: str = "rate"):
        if int(block_size) < 2 and predictor is None:
            raise ValueError(f"the verify-width policy drafts blocks of B >= 2, got B={block_size}")
        if int(max_skip) < 0:
            raise ValueError(f"max_skip must be >= 0, got {max_skip}")
        if objective not in ("rate", "marginal"):
            raise ValueError(f"objective must be 'rate' or 'marginal', got {objective!r}")
        self.objective = objective
        self.calibration, self.cost_model, self.predictor = calibration, costs, predictor
        self.block_size = int(block_size)
        self.max_block_size = max(predictor.candidates) if predictor is not None else self.block_size
        self.skip_drafts, self.max_skip = bool(skip_drafts), int(max_skip)
        self._costs: dict[tuple[int, int], tuple[float, list[float]]] = {}
        self._chosen = self.block_size
        self._reset()

    def _reset(self) -> None:
        self._paid = True
        self._skip_len = self._remaining = 0
        self._tokens = self._ms = 0.0  # the request's emitted tokens and predicted step costs (marginal objective)
        self._step_ms = self._plain_ms = 0.0  # the last drafted step's cost, and a plain step's at its context

    def costs(self, b: int, context: int) -> tuple[float, list[float]]:
        """(draft_ms of a block of b, [verify_ms of k+1 tokens for k = 0..b-1]) at a context length (ms)."""
        key = (int(b), int(context) // 16)
        if key not in self._costs:
            length = key[1] * 16 + 8
            self._costs[key] = (self.cost_model.draft_ms(b, length),
                                [self.cost_model.verify_ms(q, length) for q in range(1, b + 1)])
        return self._costs[key]

    def first(self, last_logits: torch.Tensor) -> int:
        self._reset()
        self._chosen = self.predictor.predict(last_logits) if self.predictor is not None else self.block_size
        return self._chosen

    def choose_width(self, confidence: torch.Tensor, start: int) -> int:
        """k for a step whose drafts have probabilities ``confidence`` [b-1], the target cache at ``start`` tokens."""
        b = len(confidence) + 1
        draft_ms, verify_ms = self.costs(b, start)
        plain = 1.0 / max(verify_ms[0], 1e-9)  # a plain step without the drafter, tokens per ms
        running = None
        if self.objective == "marginal":  # the request's rate so far, a plain step's two steps' worth as the prior
            running = (self._tokens + 2.0) / (self._ms + 2.0 * verify_ms[0])
        k, per_ms = best_width(self.calibration.predict(confidence), draft_ms, verify_ms, running)
        self._paid = per_ms > plain
        self._step_ms, self._plain_ms = draft_ms + verify_ms[k], verify_ms[0]
        return k

    def next(self, tau: int, block_size: int) -> int:
        self._tokens += tau
        self._ms += self._step_ms if block_size > 1 else self._plain_ms
        if self._chosen < 2:
            return self._chosen  # the predictor chose B=1: no drafting for this request
        if not self.skip_drafts:
            return self._chosen
        if block_size == 1:  # a skipped draft
            self._remaining -= 1
            return 1 if self._remaining > 0 else self._chosen
        if self._paid:
            self._skip_len = 0
            return self._chosen
        self._skip_len = min(max(1, 2 * self._skip_len), self.max_skip)
        self._remaining = self._skip_len
        return 1 if self._remaining > 0 else self._chosen


# ---------------------------------------------------------------------------------------------------
# how much any per-step verify width could gain: the foresight bound
# ---------------------------------------------------------------------------------------------------
def step_acceptances(columns: Sequence[int], accepted: Sequence[bool]) -> list[int]:
    """Accepted drafts of each step of one replayed decode, from its ``conf_*`` samples at one B.

    The replay records, for every step, the columns 1..first rejection (or 1..b-1 when all were accepted), so a
    step starts at each column 1 and its acceptance is its count of accepted samples.

    Args:
        columns: [S] draft columns (1-based) in replay order; accepted: [S] whether each was accepted.
    Returns:
        one accepted-draft count (tokens, 0..b-1) per step.
    Raises:
        ValueError: when the samples do not start at column 1 or their lengths differ.
    """
    if len(columns) != len(accepted):
        raise ValueError(f"{len(columns)} columns but {len(accepted)} outcomes")
    steps: list[int] = []
    for column, ok in zip(columns, accepted):
        if int(column) == 1:
            steps.append(0)
        elif not steps:
            raise ValueError("replay samples must start at column 1 (a step's first draft)")
        steps[-1] += int(bool(ok))
    return steps


def labelled_steps(labels, block_size: int, ids: set[str] | None = None):
    """Yield ``(row, new tokens, steps)`` for every label row (of ``ids``, when given) with replay samples at
    ``block_size``: ``steps`` are its B steps' acceptances as ``step_acceptances`` reads them back."""
    b = int(block_size)
    for _, row in labels.iterrows():
        if ids is not None and str(row["id"]) not in ids:
            continue
        candidates = [int(c) for c in row["candidates"]]
        if b not in candidates or row.get("conf_block") is None:
            continue
        keep = np.asarray(row["conf_block"]) == b
        if not keep.any():
            continue
        steps = step_acceptances(np.asarray(row["conf_column"])[keep], np.asarray(row["conf_ok"])[keep])
        yield row, int(row["new_tokens"][candidates.index(b)]), steps


def foresight_bound(labels, costs: CostModel, block_size: int, ids: set[str] | None = None) -> dict:
    """Modelled speedups over ``ar`` of ``fixed`` and of a verify width chosen with foresight, per set and overall.

    For every labelled request (``ids`` when given) and every step of its replay at ``block_size``, a policy that
    knew the step's acceptance a in advance would verify exactly a drafts (cost ``draft_ms(B) + verify_ms(a+1)``)
    and, when a = 0, not even draft (cost ``verify_ms(1)``): no verify-width policy can do better with this drafter
    on this machine's cost curve. ``foresight_drafting`` is the same policy made to draft every step (the best a
    policy without a skip rule can do). Times come from ``costs`` (the machine's ``CostModel``; ms), with each request's
    prefill (and, at T>0, its sampling noise), so the figures compare with measured end-to-end tokens/s.

    Args:
        labels: label rows with ``conf_block``/``conf_column``/``conf_ok``, ``candidates``, ``new_tokens``,
            ``prompt_tokens``, ``source_set`` (``pipeline.labeling.store.read_label_table``).
        block_size: B drafted (one of the label candidates).
    Returns:
        ``{"block_size", "all": {...}, "per_set": {set: {...}}}``, each ``{"requests", "fixed", "foresight",
        "foresight_drafting"}`` (speedups over ``ar``, x).
    Raises:
        ValueError: when no request has replay samples at ``block_size``.
    """
    b = int(block_size)
    totals: dict[str, np.ndarray] = {}
    for row, n, steps in labelled_steps(labels, b, ids):
        start = int(row["prompt_tokens"])
        prefill = costs.prefill_ms(start) + costs.noise_ms * n  # sampling noise per token (0 when timed at T=0)
        ar = prefill + sum(costs.verify_ms(1, start + i) for i in range(n - 1))
        fixed = foresight = drafting = prefill
        position, emitted = start, 1  # the prefill's token
        for a in steps:
            if emitted >= n:
                break
            width = min(b, n - emitted)  # the replay clips the last block to the token budget
            draft, verify = costs.draft_ms(width, position), costs.verify_ms(a + 1, position)
            fixed += draft + costs.verify_ms(width, position)
            foresight += costs.verify_ms(1, position) if a == 0 else draft + verify
            drafting += draft + verify
            position, emitted = position + a + 1, emitted + a + 1
        while emitted < n:  # steps of b = 1 (one token left in the budget) draft nothing and record no samples
            plain = costs.verify_ms(1, position)
            fixed, foresight, drafting = fixed + plain, foresight + plain, drafting + plain
            position, emitted = position + 1, emitted + 1
        for key in ("all", str(row["source_set"])):
            totals[key] = totals.get(key, np.zeros(5)) + np.array([1, ar, fixed, foresight, drafting])
    if "all" not in totals:
        raise ValueError(f"no labelled request has verify-width samples at B={b}: label with B={b} among the candidates "
                         "and label.record_confidence=true")

    def speedups(t: np.ndarray) -> dict:
        return {"requests": int(t[0]), "fixed": float(t[1] / t[2]), "foresight": float(t[1] / t[3]),
                "foresight_drafting": float(t[1] / t[4])}

    return {"block_size": b, "all": speedups(totals["all"]),
            "per_set": {s: speedups(t) for s, t in sorted(totals.items()) if s != "all"}}
