"""The verify width of a step: how many drafts to verify, from their calibrated acceptance and the step's costs.

With a_j the calibrated acceptance of draft j (``pipeline.policy.calibration``), a step that verifies the first k
drafts yields on average ``expected_tokens(a)[k] = 1 + sum_{i<=k} prod_{j<=i} a_j`` tokens (the bonus token included):

* ``best_width``: one request's k against the step's measured costs (``verify_width``, ``pipeline.policy.verify_width``);
* ``allocate``: the k_i of every drafting request of a batched step chosen together (``budget``,
  ``pipeline.policy.budget``), exactly the optimum (``brute_force_allocate`` is the tests' reference).

Imports only torch (no transformers, no model code): the vLLM plugin (``pipeline.integrations.vllm``) chooses widths
with it in vLLM's own process.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from pipeline.costs.batched import BatchCostModel

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
    a = torch.as_tensor(a, dtype=torch.float64).reshape(-1)
    return best_count(torch.cumprod(a, 0), draft_ms, verify_ms, rate)


def best_count(gains: torch.Tensor, draft_ms: float, verify_ms: Sequence[float], rate: float | None = None
               ) -> tuple[int, float]:
    """``best_width`` over any ordered drafts: verifying the first n of them yields ``1 + sum(gains[:n])`` tokens on
    average (a chain's gains are the running products of its acceptances; a draft tree's, its nodes' path acceptances in
    best-first order, ``pipeline.policy.trees``) and costs ``draft_ms + verify_ms[n]``.

    Returns:
        (n in 0..len(gains), the step's expected tokens per ms at n).
    Raises:
        ValueError: when ``verify_ms`` does not have len(gains)+1 values.
    """
    # a step's few drafts: Python floats (a list is taken as it is: a tensor round trip costs more than the loop)
    gains = [float(g) for g in gains] if isinstance(gains, (list, tuple)) else \
        torch.as_tensor(gains, dtype=torch.float64).reshape(-1).tolist()
    if len(verify_ms) != len(gains) + 1:
        raise ValueError(f"need {len(gains) + 1} verify costs (k = 0..{len(gains)}), got {len(verify_ms)}")
    best_k, best, best_rate, expected = 0, None, 0.0, 1.0
    for k, ms in enumerate(verify_ms):
        if k:
            expected += gains[k - 1]
        cost = float(draft_ms) + float(ms)
        per_ms = expected / cost
        objective = per_ms if rate is None else expected - float(rate) * cost
        if best is None or objective > best:  # first maximum: the narrower verify on ties
            best_k, best, best_rate = k, objective, per_ms
    return best_k, best_rate


def allocate(acceptance: Sequence[torch.Tensor], costs: BatchCostModel | Callable[[int], float], plain_requests: int = 0,
             drafted_rows: int = 0) -> tuple[list[int], float]:
    """The verify widths k_i (0..len(a_i)) of the drafting requests that maximise the step's expected tokens per ms.

    Args:
        acceptance: per drafting request, [b_i - 1] calibrated acceptance probabilities of its drafts (in order).
        costs: a ``BatchCostModel`` (step_ms over all N = drafting + ``plain_requests`` requests, with
            ``drafted_rows`` drafted), or a callable ``total verified rows -> ms`` of the whole step.
        plain_requests: requests in the same step that verify one row without drafting (1 token each).
        drafted_rows: block rows the step's drafter forward ran (its cost is the same for every k).
    Returns:
        ([k_i] per drafting request, the step's expected tokens per ms at that choice). Ties go to the narrower step.
    """
    n_d = len(acceptance)
    n = n_d + int(plain_requests)
    if callable(costs) and not isinstance(costs, BatchCostModel):
        step_ms = costs
    else:
        step_ms = lambda rows: costs.step_ms(rows, drafted_rows, n, n_d)  # noqa: E731
    gains = []  # (increment, request, column) for every draft
    for i, a in enumerate(acceptance):
        a = torch.as_tensor(a, dtype=torch.float64).reshape(-1)
        inc = torch.cumprod(a, 0) if len(a) else a
        gains.extend((float(g), i, m) for m, g in enumerate(inc.tolist(), start=1))
    gains.sort(key=lambda t: (-t[0], t[1], t[2]))  # per request increments never grow, so its columns stay in order
    best_r, best = 0, n / step_ms(n)
    total = float(n)
    for r, (g, _, _) in enumerate(gains, start=1):
        total += g
        rate = total / step_ms(n + r)
        if rate > best + 1e-12:
            best_r, best = r, rate
    widths = [0] * n_d
    for g, i, m in gains[:best_r]:
        widths[i] = max(widths[i], m)
    return widths, best


def brute_force_allocate(acceptance: Sequence[torch.Tensor], step_ms: Callable[[int], float], plain_requests: int = 0
                         ) -> tuple[list[int], float]:
    """``allocate`` by trying every combination of widths (small cases only; the tests' reference)."""
    import itertools

    n = len(acceptance) + plain_requests
    expected = [expected_tokens(a).tolist() for a in acceptance]
    best, best_k = -1.0, None
    for ks in itertools.product(*[range(len(e)) for e in expected]):
        rate = (plain_requests + sum(e[k] for e, k in zip(expected, ks))) / step_ms(n + sum(ks))
        if rate > best + 1e-12:
            best, best_k = rate, list(ks)
    return best_k or [], best
