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
steps skip the drafter (1, 2, 4, ... up to ``max_skip`` steps, then it drafts again to look: the drafting-policy
core's ``BackOff``, ``pipeline.policy.core``, the one ``BudgetPolicy`` and the vLLM plugin use too); the
target's features keep flowing to the drafter, so drafting resumes where it left off. Every choice is
lossless: the target still decides every token.

The calibration (``AcceptanceCalibration``) is a logistic regression fitted in the train stage on the
label stage's replay samples (``conf_*`` label columns: for every step of every candidate B, the
columns 1..first rejection), exported as ``calibration.json`` beside the predictors
(``train.calibration``: ``make train`` writes ``data/predictors/<run>/verify_width/calibration.json``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from pipeline.costs import CostModel, ObservedCosts
from pipeline.decoding.schedules import Schedule
from pipeline.policy.calibration import AcceptanceCalibration
from pipeline.policy.core import BackOff
from pipeline.policy.widths import best_count

class VerifyWidthSchedule(Schedule):
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

    chooses_widths = True
    observed: ObservedCosts | None = None
    """The method's ``ObservedCosts`` (one per method, shared by its requests; the registry sets it), or None: the
    cost model as measured."""

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
        self.backoff = BackOff(self.max_skip)  # the request's runs without the drafter
        self._tokens = self._ms = 0.0  # the request's emitted tokens and predicted step costs (marginal objective)
        self._step_ms = self._plain_ms = 0.0  # the last drafted step's cost, and a plain step's at its context

    def costs(self, b: int, context: int) -> tuple[float, list[float]]:
        """(draft_ms of a block of b, [verify_ms of k+1 tokens for k = 0..b-1]) at a context length (ms); the verify
        curve corrected by the verifies' observed times where the method keeps them (``observed``)."""
        key = (int(b), int(context) // 16)
        if key not in self._costs:
            length = key[1] * 16 + 8
            self._costs[key] = (self.cost_model.draft_ms(b, length),
                                [self.cost_model.verify_ms(q, length) for q in range(1, b + 1)])
        draft_ms, verify_ms = self._costs[key]
        return (draft_ms, verify_ms) if self.observed is None else (draft_ms, self.observed.correct(verify_ms))

    def timed_verify(self, rows: int, ms: float, start: int, requests: int = 1) -> None:
        if self.observed is not None and requests == 1:
            self.observed.observe(rows, self.cost_model.verify_ms(rows, int(start) // 16 * 16 + 8), ms)

    def first(self, last_logits: torch.Tensor) -> int:
        self._reset()
        self._chosen = self.predictor.predict(last_logits) if self.predictor is not None else self.block_size
        return self._chosen

    def choose_width(self, confidence: torch.Tensor, start: int) -> int:
        """k for a step whose drafts have probabilities ``confidence`` [b-1], the target cache at ``start`` tokens."""
        b = len(confidence) + 1
        draft_ms, verify_ms = self.costs(b, start)
        return self.choose_count(torch.cumprod(self.calibration.predict(confidence), 0), draft_ms, verify_ms)

    def choose_count(self, gains: torch.Tensor, draft_ms: float, verify_ms: list[float]) -> int:
        """How many of a step's ordered drafts to verify (``widths.best_count``: drafts whose expected tokens are
        ``gains``, costs ``draft_ms`` + ``verify_ms[n]``) under this schedule's objective; notes for the skip rule whether
        drafting paid and the step's cost. A chain's gains are its running acceptance products, a tree's its nodes' path
        acceptances (``pipeline.policy.trees``)."""
        plain = 1.0 / max(verify_ms[0], 1e-9)  # a plain step without the drafter, tokens per ms
        running = None
        if self.objective == "marginal":  # the request's rate so far, a plain step's two steps' worth as the prior
            running = (self._tokens + 2.0) / (self._ms + 2.0 * verify_ms[0])
        n, per_ms = best_count(gains, draft_ms, verify_ms, running)
        self._paid = per_ms > plain
        self._step_ms, self._plain_ms = draft_ms + verify_ms[n], verify_ms[0]
        return n

    def next(self, tau: int, block_size: int) -> int:
        self._tokens += tau
        self._ms += self._step_ms if block_size > 1 else self._plain_ms
        if self._chosen < 2:
            return self._chosen  # the predictor chose B=1: no drafting for this request
        if not self.skip_drafts:
            return self._chosen
        if block_size == 1:  # a skipped draft
            return 1 if self.backoff.skipping() else self._chosen
        if self._paid:
            self.backoff.paid()
            return self._chosen
        self.backoff.missed()
        return 1 if self.backoff.skipping() else self._chosen


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
