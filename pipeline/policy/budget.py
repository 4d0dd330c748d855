"""A verify budget for a batched step: every request's verify width k_i chosen jointly.

In a batched step (``pipeline.decoding.batched``) N requests share one target forward over R = sum_i (k_i + 1) rows and
one drafter forward over the drafting requests' blocks. With a_ij the calibrated acceptance of request i's draft j
(``AcceptanceCalibration``, as the single-request ``VerifyWidthSchedule`` uses it), the step yields on average

    E = sum_i E_i(k_i),   E_i(k) = 1 + sum_{m<=k} prod_{j<=m} a_ij   tokens,

and costs ``BatchCostModel.step_ms(R, D, N, N_d)`` (ms; D drafted rows over N_d drafting requests, already spent when
the widths are chosen). ``allocate`` picks the k_i that maximise E / cost. Each E_i's increments g_im = prod_{j<=m} a_ij
never grow with m (products of probabilities), so for every total width r = sum k_i the best E is the sum of the r
largest increments over all requests (taken in each request's order: a greedy exchange argument); the allocation is
the best of those N_d * (b-1) + 1 prefixes, exactly the optimum (``tests/test_budget.py`` brute-forces small cases).

A request whose drafts do not pay gets k_i = 0 (a plain step) and, through ``BudgetPolicy.plan``, skips the drafter for
the next 1, 2, 4, ... ``max_skip`` steps before it looks again (the back-off ``VerifyWidthSchedule`` uses alone: both
are ``pipeline.policy.core``'s, with the requests' priors, the population average and the gate's margin). Before the
drafter runs, ``plan`` also gates drafting on each request's prior acceptance: a request drafts only when the modelled
step with its draft (drafter rows and per-request cost included) yields more tokens per ms than without it.

Before all that, ``BudgetPolicy.admit`` decides at a request's admission whether it may draft at all: at a load where
the modelled step with drafting requests does not beat the plain step (the drafter forward over their blocks, their
verify rows and their per-request cost, against one row each), it joins as autoregressive decoding (B = 1: no drafter,
and no drafter features in its verifies), so that under load the policy decodes as batched ``ar`` does, at its cost. A
request admitted to draft keeps that right (its drafter context is kept up to date).

The batched methods come from the one method table (``pipeline.policy.registry``): ``ar``, ``fixed``,
``verify_width`` and ``budget`` (this module) are built there for the server and ``pipeline.bench_batch`` alike.
``batched_foresight_bound`` models how much any width choice could gain at a given concurrency.
"""

from __future__ import annotations

import collections
import math
from typing import Hashable, Sequence

import torch

from pipeline.costs.batched import BatchCostModel
from pipeline.decoding.schedules import BatchPolicy, FixedSchedule, Schedule
from pipeline.policy.calibration import AcceptanceCalibration
from pipeline.policy.core import GATE_MARGIN, POPULATION_WEIGHT, DraftingCore
from pipeline.policy.widths import allocate, expected_tokens

WIDTHS_KEPT = 100_000  # BudgetPolicy.widths: the most recent choices kept
# BudgetPolicy.admit, before any request has drafted: the drafts' acceptance taken as that of drafts the drafter is this
# sure of (an optimistic prior, so that drafting is tried wherever it could pay; afterwards the observed drafted steps')
CONFIDENT = 0.9


# ---------------------------------------------------------------------------------------------------
# the joint allocation
# ---------------------------------------------------------------------------------------------------
def request_id(request) -> Hashable:
    """The id the policy keeps a request's state under: its ``rid`` (the batched decoder's), else the object itself
    (a request added without an id)."""
    rid = getattr(request, "rid", None)
    return rid if rid is not None else ("object", id(request))


class BudgetPolicy(BatchPolicy):
    """The ``budget`` method for ``BatchedDecoder``: ``admit`` (whether a request may draft at all, at its admission
    load), ``plan`` (which requests draft this step) and ``allocate`` (the joint widths).

    ``allocate`` chooses the widths after the step's drafter forward, whose cost is then spent. ``plan`` decides before
    it which requests draft at all, so that a draft that would not repay its drafter cost is not made: each request
    keeps a prior of its drafts' acceptance (the mean of its last drafted steps' calibrated acceptances, per column),
    and the step drafts the requests, best prior first, up to the count whose modelled step (``allocate`` on the priors
    over the drafting requests, ``BatchCostModel.step_ms`` with their drafted rows) yields the most tokens per ms. A
    request without a prior of its own takes the population's (``population``: a moving average over every drafted
    request-step's acceptances), so where drafting does not pay at the step's concurrency a new request does not
    draft at all; only before any request has drafted does it draft to learn (a probe). A request left out
    ``max_skip`` steps in a row drops its own prior (it may be stale) for the population's. After a step that gave a
    request k = 0 it also skips the drafter for the next 1, 2, 4, ... ``max_skip`` steps (the rule
    ``VerifyWidthSchedule`` uses alone).

    The priors, the population, the gate's margin and the skips are the drafting-policy core's (``core``,
    ``pipeline.policy.core``), each request's under its ``rid`` (``request_id``); ``plan`` drops the requests it is no
    longer given (every active request is, each step), ``finished`` drops one at once.

    Args:
        calibration: the drafts' acceptance calibration; costs: this machine's ``BatchCostModel``.
        skip_drafts: skip the drafter after a step that gave a request k = 0; max_skip: the longest skip run (steps).
        gate: decide before drafting which requests draft (False: every request not skipping drafts).
        margin: the gate drafts only where the modelled step with the drafts yields ``1 + margin`` times the tokens per
            ms of the step without them.
    Attributes:
        core: the ``DraftingCore`` (request priors, population, margin, back-off).
        widths: the last ``WIDTHS_KEPT`` k it chose, in order (bounded: a server runs one policy for days);
        population: [B-1] the moving average (weight ``POPULATION_WEIGHT`` per request-step) of every drafting
            request's calibrated acceptance per column, or None before any request drafted (the core's).
        drafted_yield: the moving average of (expected tokens, verified rows) of a drafting request's step at the
            widths ``allocate`` chose (k = 0 steps included), or None before any request drafted: what ``admit``
            expects a drafting request to add.
        admitted: {load: whether requests admitted at that load may draft} (the decisions so far).
    Raises:
        ValueError: for max_skip < 0 or margin < 0.
    """

    joint_widths = True

    def __init__(self, calibration: AcceptanceCalibration, costs: BatchCostModel, skip_drafts: bool = True,
                 max_skip: int = 8, gate: bool = True, margin: float = GATE_MARGIN):
        self.core = DraftingCore(max_skip, margin)
        self.calibration, self.costs = calibration, costs
        self.skip_drafts, self.max_skip, self.gate = bool(skip_drafts), int(max_skip), bool(gate)
        self._plain = 0
        self.drafted_yield: tuple[float, float] | None = None
        self.admitted: dict[int, bool] = {}
        self.widths: collections.deque[int] = collections.deque(maxlen=WIDTHS_KEPT)

    @property
    def margin(self) -> float:
        return self.core.margin

    @property
    def population(self) -> torch.Tensor | None:
        return self.core.population

    @population.setter
    def population(self, value: torch.Tensor | None) -> None:
        self.core.population = value

    def admit(self, schedule: Schedule, load: int) -> Schedule:
        """``schedule`` when drafting can pay at ``load`` requests (``drafting_pays``), else autoregressive decoding
        (``FixedSchedule(1)``: no drafter, no drafter features)."""
        if schedule.max_block_size <= 1:
            return schedule
        pays = self.drafting_pays(max(1, int(load)), schedule.max_block_size)
        self.admitted[int(load)] = pays
        return schedule if pays else FixedSchedule(1)

    def drafting_pays(self, load: int, block_size: int) -> bool:
        """Whether a step of ``load`` requests in which d of them draft blocks of ``block_size`` (d = 1 or all) yields
        ``1 + margin`` times the tokens per ms of the plain step, on the batched cost model: each drafting request
        adds the drafter's rows and its per-request cost and verifies what drafting requests verified so far
        (``drafted_yield``), or, before any did, a block whose drafts the drafter is ``CONFIDENT`` of."""
        plain = load / self.costs.step_ms(load, 0, load, 0)
        if self.drafted_yield is not None:
            tokens, rows = self.drafted_yield
        else:
            a = self.calibration.predict(torch.full((block_size - 1,), CONFIDENT))
            expected = expected_tokens(a)
            verify = [self.costs.verify(load + k) for k in range(block_size)]
            k = max(range(block_size), key=lambda j: float(expected[j]) / verify[j])
            tokens, rows = float(expected[k]), float(k + 1)
        best = 0.0
        for d in sorted({1, load}):
            ms = self.costs.step_ms(round(load - d + d * rows), d * block_size, load, d)
            best = max(best, (load - d + d * tokens) / ms)
        return self.core.pays(best, plain)

    def plan(self, requests: Sequence, sizes: Sequence[int]) -> list[int]:
        """The block size of each request this step: its own, or 1 (no drafter) while it skips or the gate leaves it
        out (see the class doc). ``requests`` are every request still decoding: the core drops the others."""
        self.core.keep(request_id(r) for r in requests)
        out = []
        for r, b in zip(requests, sizes):
            if self.skip_drafts and b > 1 and self.core.state(request_id(r)).backoff.skipping():
                out.append(1)
            else:
                out.append(int(b))
        if self.gate:
            out = self._gate(requests, out)
        self._plain = sum(1 for b in out if b <= 1)
        return out

    def finished(self, request) -> None:
        """Drop what the policy keeps of a request that finished (``plan`` drops it at the next step otherwise)."""
        self.core.forget(request_id(request))

    def _gate(self, requests: Sequence, sizes: list[int]) -> list[int]:
        """Leave out of drafting the requests whose drafts, by their priors, do not repay the drafter's cost."""
        n = len(requests)
        probes, ranked = [], []
        for i, (r, b) in enumerate(zip(requests, sizes)):
            if b <= 1:
                continue
            state = self.core.state(request_id(r))
            if state.left_out >= self.max_skip:
                state.prior = None  # left out long enough for its prior to be stale: the population's
            prior = self.core.prior(request_id(r))
            if prior is None:
                probes.append(i)
            else:
                ranked.append((float(prior[0]) if len(prior) else 0.0, i, prior[: b - 1]))
        if not ranked:
            return sizes
        ranked.sort(key=lambda t: (-t[0], t[1]))
        fill = [torch.full((sizes[i] - 1,), 0.5, dtype=torch.float64) for i in probes]  # no prior yet: a coin
        best_m, best = 0, -1.0
        for m in range(len(ranked) + 1):
            drafting = probes + [i for _, i, _ in ranked[:m]]
            if not drafting:
                rate = n / self.costs.step_ms(n, 0, n, 0)
            else:
                acceptance = fill + [p for _, _, p in ranked[:m]]
                _, rate = allocate(acceptance, self.costs, n - len(drafting), sum(sizes[i] for i in drafting))
                rate = self.core.discount(rate)  # a draft must beat the step without it by the margin
            if rate > best + 1e-12:
                best_m, best = m, rate
        out = list(sizes)
        for rank, (_, i, _) in enumerate(ranked):
            state = self.core.state(request_id(requests[i]))
            if rank < best_m:
                state.left_out = 0
            else:
                out[i] = 1
                state.left_out += 1
        for i in probes:
            self.core.state(request_id(requests[i])).left_out = 0
        return out

    def allocate(self, requests: Sequence, confidences: Sequence[torch.Tensor]) -> list[int]:
        """The joint widths of the step's drafting requests (``allocate`` on the calibrated acceptances); updates each
        request's prior of its drafts' acceptance, the population's and each request's back-off."""
        acceptance = [self.calibration.predict(c) if c is not None and len(c) else torch.zeros(0) for c in confidences]
        drafted = sum(len(a) + 1 for a in acceptance)
        widths, _ = allocate(acceptance, self.costs, self._plain, drafted)
        for k, a in zip(widths, acceptance):
            step = (float(expected_tokens(a)[k]), float(k + 1))
            self.drafted_yield = step if self.drafted_yield is None else tuple(
                (1 - POPULATION_WEIGHT) * old + POPULATION_WEIGHT * new for old, new in zip(self.drafted_yield, step))
        for r, k, a in zip(requests, widths, acceptance):
            backoff = self.core.state(request_id(r)).backoff
            if k > 0:
                backoff.paid()
            elif self.skip_drafts:
                backoff.missed()
            self.core.learn(request_id(r), a)
        self.widths.extend(widths)
        return widths


# ---------------------------------------------------------------------------------------------------
# the batched foresight bound (modelled)
# ---------------------------------------------------------------------------------------------------
def simulate_batched(requests: Sequence[tuple[int, list[int]]], costs: BatchCostModel, block_size: int,
                     concurrency: int, policy: str) -> dict:
    """Modelled tokens per ms of a workload decoded in batched steps at ``concurrency`` slots (requests join as slots
    free, all ready at the start).

    Args:
        requests: per request (new tokens n, accepted drafts of each step of its replay at ``block_size``).
        policy: ``ar`` (1 row each), ``fixed`` (B rows each, the replay's acceptances), ``foresight`` (a request
            verifies exactly its step's accepted drafts, and skips the drafter when that is 0), ``foresight_drafting``
            (the same, but every request drafts every step).
    Returns:
        {"tokens", "ms", "tokens_per_ms", "steps"}.
    """
    b = int(block_size)
    queue = [(int(n), list(steps)) for n, steps in requests]
    active: list[list] = []  # [emitted, n, step index, steps]
    tokens = ms = 0.0
    n_steps = 0
    while queue or active:
        while queue and len(active) < concurrency:
            n, steps = queue.pop(0)
            active.append([1, n, 0, steps])  # the prefill's token
            tokens += 1
        active = [a for a in active if a[0] < a[1]]
        if not active:
            continue
        rows = drafted = drafting = 0
        for a in active:
            emitted, n, s, steps = a
            width = min(b, n - emitted)
            if policy == "ar" or width < 2:
                acc, q, d = 0, 1, 0
            else:
                acc = min(steps[s] if s < len(steps) else 0, width - 1)
                if policy == "fixed":
                    q, d = width, width
                elif policy == "foresight":
                    q, d = acc + 1, (width if acc > 0 else 0)
                else:
                    q, d = acc + 1, width
                a[2] += 1
            rows += q
            drafted += d
            drafting += int(d > 0)
            gained = min(acc + 1, n - emitted)
            a[0] += gained
            tokens += gained
        ms += costs.step_ms(rows, drafted, len(active), drafting)
        n_steps += 1
    return {"tokens": tokens, "ms": ms, "tokens_per_ms": tokens / ms if ms else math.nan, "steps": n_steps}


def batched_foresight_bound(labels, costs: BatchCostModel, block_size: int, concurrency: Sequence[int],
                            ids: set[str] | None = None) -> dict:
    """Modelled speedups over batched ``ar`` of batched ``fixed`` and of foresight widths, per concurrency.

    The batched form of ``pipeline.policy.verify_width.foresight_bound``: every labelled request's replay at
    ``block_size`` is decoded (in the model) with ``concurrency`` requests sharing each step, costs from ``costs``.
    No width policy (``verify_width`` or ``budget``) can beat ``foresight`` with this drafter on this cost curve.

    Args:
        labels: label rows with ``conf_block``/``conf_column``/``conf_ok``, ``candidates``, ``new_tokens``.
    Returns:
        {"block_size", "by_concurrency": {"<c>": {"requests", "fixed", "foresight", "foresight_drafting"}}} (x ar).
    Raises:
        ValueError: when no request has replay samples at ``block_size``.
    """
    from pipeline.policy.verify_width import labelled_steps

    b = int(block_size)
    work = [(n, steps) for _, n, steps in labelled_steps(labels, b, ids)]
    if not work:
        raise ValueError(f"no labelled request has verify-width samples at B={b}: label with B={b} among the candidates "
                         "and label.record_confidence=true")
    out = {}
    for c in concurrency:
        ar = simulate_batched(work, costs, b, int(c), "ar")["tokens_per_ms"]
        out[str(c)] = {"requests": len(work), **{p: simulate_batched(work, costs, b, int(c), p)["tokens_per_ms"] / ar
                                                 for p in ("fixed", "foresight", "foresight_drafting")}}
    return {"block_size": b, "by_concurrency": out}
