"""The plugin's decisions for one vLLM step, pure (no vLLM): whether the drafter drafts for the next step (``plan``)
and how many of each request's drafts the next step verifies (``widths``).

vLLM's DFlash drafter runs once per step for the whole batch, K drafts per request, inside the step (after the
target's forward and sampling); the next step verifies each request's draft list. The policy therefore decides twice:

``plan`` (before the drafter forward): draft at all (K) or not (0, no drafts for anyone next step). Each request
keeps a prior of its drafts' calibrated acceptance (the mean of its last drafted steps'; new requests take the
population's moving average), and the drafter runs only when the modelled step with the drafts (``allocate`` on the
priors, the machine's ``StepCosts``) yields ``1 + margin`` times the tokens per ms of a step without them. A policy
that stops drafting drafts once (a probe) after 1, 2, 4, ... ``max_skip`` skipped steps (its priors would otherwise
never change); the run lengths start again from 1 only after a drafting step whose verified drafts paid. The priors
(keyed by vLLM's request ids), the population average, the gate's margin and the run lengths are the drafting-policy
core's (``pipeline.policy.core``, shared with the registry's ``verify_width`` and ``budget``); its docstring holds the
table of how the plugin's policies and the registry's methods differ.

``widths`` (after it, on the drafter's probabilities of its drafts, calibrated by ``AcceptanceCalibration``):

* ``fixed``: every draft (K), as vLLM does without the plugin;
* ``per_request``: each request alone (``best_width``: the k with the most expected tokens per ms, priced at its
  1/n share of a step where every request verifies k);
* ``joint``: the step's verify rows shared across requests (``allocate``: the widths that maximise the whole step's
  expected tokens per ms).

(``per_request`` and ``joint`` were named ``verify_width`` and ``budget`` before issue 41: the registry's methods of
those names gate and skip per request, which vLLM's one drafter forward per step cannot; the old names are refused.)

Both decisions read the calibrated acceptance scaled by the **drafted yield**: the drafts vLLM actually accepted
over the ones the calibration expected at the widths chosen (``observe``, a moving ratio over the recent drafting
steps). A calibration fitted on another decoder's drafts, or on other prompts, that promises more than vLLM's steps
deliver would otherwise keep the drafter running where it loses (measured: with 16 requests the gate kept drafting at
0.93x vLLM's own ``ar``); the yield scales each request's first-draft acceptance, so every expected-token increment
of its drafts scales with it.

A request that opted out (``extra_args`` ``blockpilot_speculate: false``) always gets k = 0. While the step-cost
table lacks samples for the current concurrency (``StepCosts.missing``), the policy explores: the step drafts or not
and every request verifies the same width, chosen to fill the emptiest bucket (every choice is lossless; only speed
is at stake).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pipeline.integrations.vllm.costs import StepCosts
from pipeline.peers.vllm_settings import POLICIES, check_policy
from pipeline.policy.calibration import AcceptanceCalibration
from pipeline.policy.core import GATE_MARGIN, BackOff, DraftingCore
from pipeline.policy.widths import allocate, best_width

KINDS = tuple(p for p in POLICIES if p != "off")  # fixed, per_request, joint
REUSE_STEPS = 8  # steps a gate decision is reused while the requests and their priors stay the same
YIELD_DECAY = 0.9  # the drafted yield's weight on the past, per verifying step observed
YIELD_MIN_EXPECTED = 4.0  # expected accepted drafts (decayed) before the yield is trusted (1 until then)
YIELD_RANGE = (0.0, 1.5)  # the yield is clamped to this range


class StepPolicy:
    """``plan`` and ``widths`` of one vLLM server (see the module docstring).

    Args:
        kind: ``fixed``, ``per_request`` or ``joint``.
        calibration: the drafter's acceptance calibration (unused by ``fixed``).
        costs: the machine's learned ``StepCosts`` (shared with the code that measures the steps).
        num_spec: K, the drafts per request of a drafting step (vLLM's ``num_speculative_tokens``).
        margin: the gate's margin (``pipeline.costs.margin.GATE_MARGIN`` by default, through the settings).
        max_skip: the longest run of gated-off steps before a step drafts again to refresh the priors (0: never).
        explore: the samples each step-cost bucket needs before the policy trusts it.
    Attributes:
        core: the ``DraftingCore``: each request's prior under its vLLM request id, the population average, the margin.
        backoff: the step's ``BackOff``: a probe after each run of ``backoff.next_run`` gated-off steps.
        drafted_yield: accepted drafts / the calibration's expected ones at the verified widths (``observe``).
        decisions: counts of its choices: ``{"steps", "drafted", "explored", "probes"}``, and ``"verified"`` of
            ``"drafts"`` (kept by the caller, which sees every step's widths).
    Raises:
        ValueError: for an unknown kind (naming the new name of a renamed one), K < 1, or a missing calibration.
    """

    def __init__(self, kind: str, calibration: AcceptanceCalibration | None, costs: StepCosts, num_spec: int,
                 margin: float = GATE_MARGIN, max_skip: int = 32, explore: int = 3):
        check_policy(kind, "StepPolicy's kind")
        if kind not in KINDS:
            raise ValueError(f"policy must be one of {KINDS}, got {kind!r}")
        if int(num_spec) < 1:
            raise ValueError(f"the policy needs K >= 1 drafts per step (num_speculative_tokens), got {num_spec}")
        if kind != "fixed" and calibration is None:
            raise ValueError(f"policy {kind} needs an acceptance calibration (BLOCKPILOT_VLLM_CALIBRATION or the "
                             "drafter folder's calibration.json)")
        self.kind, self.calibration, self.costs = kind, calibration, costs
        self.num_spec, self.max_skip, self.explore = int(num_spec), int(max_skip), int(explore)
        self.core = DraftingCore(self.max_skip, margin)
        self.backoff = BackOff(self.max_skip)
        self._gated = 0  # consecutive gated-off steps
        self._explore_width: int | None = None  # the uniform width of an exploring step
        self._learned = 0  # drafting steps learned from (the priors' version)
        self._gate: tuple | None = None  # (requests and priors, step, decision) of the last gate
        self._expected: dict[str, float] = {}  # each request's expected accepted drafts at its width this step
        self._yield = (0.0, 0.0)  # decayed sums of (accepted, expected) drafts
        self.decisions = {"steps": 0, "drafted": 0, "explored": 0, "probes": 0, "verified": 0, "drafts": 0}

    # ------------------------------------------------------------------------------------------------
    def plan(self, req_ids: Sequence[str], speculate: Sequence[bool]) -> int:
        """The drafts per request the drafter makes this step: K, or 0 (no drafter forward's drafts, no verify
        rows next step)."""
        self.decisions["steps"] += 1
        self._explore_width = None
        self._expected = {}  # ``observe`` read last step's already; a step whose widths are not chosen here leaves none
        self.core.keep(req_ids)
        n = len(req_ids)
        if n == 0 or not any(speculate):
            return 0
        if self.kind == "fixed":
            return self._drafts()
        missing = self.costs.missing(n, range(self.num_spec + 1), self.explore)
        if any(missing.values()):
            self.decisions["explored"] += 1
            if missing["idle"] or 0 in missing["verify"]:
                self._explore_width = 0
                return 0  # a plain step: its verify(n) and idle(n)
            short = [k for k in missing["verify"] if k > 0]
            self._explore_width = short[0] if short else self.num_spec
            return self._drafts()
        if self._worth(req_ids, speculate):
            self._gated = 0
            return self._drafts()
        if self.max_skip and self._gated >= self.backoff.next_run:  # skipped long enough: draft once to look again
            self._gated = 0
            self.backoff.missed()  # the run just ended did not pay: the next one is twice as long
            self.decisions["probes"] += 1
            return self._drafts()
        self._gated += 1
        return 0

    def _drafts(self) -> int:
        self.decisions["drafted"] += 1
        return self.num_spec

    def _worth(self, req_ids: Sequence[str], speculate: Sequence[bool]) -> bool:
        """``_worth_drafting``, reused for up to ``REUSE_STEPS`` steps while the requests and priors stay the same
        (between drafting steps only the cost samples change, and slowly: the gate costs ~0.5 ms at 16 requests)."""
        key = (tuple(req_ids), tuple(speculate), self._learned, round(self.drafted_yield, 3))
        if self._gate is not None and self._gate[0] == key and self.decisions["steps"] - self._gate[1] < REUSE_STEPS:
            return self._gate[2]
        worth = self._worth_drafting(req_ids, speculate)
        self._gate = (key, self.decisions["steps"], worth)
        return worth

    def _worth_drafting(self, req_ids: Sequence[str], speculate: Sequence[bool]) -> bool:
        """Whether the modelled step with drafts beats the plain step by the margin, on the requests' priors."""
        n = len(req_ids)
        acceptance = []
        for r, s in zip(req_ids, speculate):
            if s:
                prior = self.core.prior(r)
                if prior is None:
                    return True  # nothing known yet: draft to learn
                acceptance.append(self._scaled(prior[: self.num_spec]))
        plain = n / self.costs.step_ms(n, n, drafted=False)
        _, rate = allocate(acceptance, lambda rows: self.costs.step_ms(rows, n, drafted=True), n - len(acceptance))
        return self.core.pays(rate, plain)

    # ------------------------------------------------------------------------------------------------
    def widths(self, req_ids: Sequence[str], speculate: Sequence[bool], confidence: torch.Tensor | None) -> list[int]:
        """Each request's verify width k (0..K) for the next step.

        Args:
            req_ids, speculate: the step's requests (vLLM's batch order) and whether each may speculate.
            confidence: [n, K] the drafter's probability of each draft (rows in ``req_ids`` order), or None when the
                drafter did not draft (then every k is 0).
        Raises:
            ValueError: when ``confidence`` does not have one row per request.
        """
        n = len(req_ids)
        self._expected = {}
        if confidence is None or n == 0:
            return [0] * n
        if confidence.shape[0] != n:
            raise ValueError(f"confidence has {confidence.shape[0]} rows for {n} requests")
        k_max = int(confidence.shape[1])
        if self.kind == "fixed":
            out = [k_max if s else 0 for s in speculate]
        elif self._explore_width is not None:
            out = [min(self._explore_width, k_max) if s else 0 for s in speculate]
        else:
            calibrated = {i: self.calibration.predict(confidence[i].double()) for i, s in enumerate(speculate) if s}
            self._learn(req_ids, calibrated)
            acceptance = {i: self._scaled(a) for i, a in calibrated.items()}
            if self.kind == "per_request":
                draft_ms = self.costs.at("draft", n) / n
                fixed = self.costs.at("overhead", n) / n
                verify_ms = [fixed + self.costs.at("verify", n * (1 + k)) / n for k in range(k_max + 1)]
                out = [best_width(acceptance[i], draft_ms, verify_ms)[0] if i in acceptance else 0 for i in range(n)]
            else:
                order = sorted(acceptance)
                chosen, _ = allocate([acceptance[i] for i in order],
                                     lambda rows: self.costs.step_ms(rows, n, drafted=True), n - len(order))
                out = [0] * n
                for i, k in zip(order, chosen):
                    out[i] = int(k)
            self._backoff(acceptance, out)
            self._expected = {req_ids[i]: float(torch.cumprod(a[: out[i]], 0).sum()) for i, a in calibrated.items()}
        return out

    # ------------------------------------------------------------------------------------------------
    @property
    def drafted_yield(self) -> float:
        """Accepted / expected drafts over the recent verifying steps (1 before ``YIELD_MIN_EXPECTED``)."""
        accepted, expected = self._yield
        if expected < YIELD_MIN_EXPECTED:
            return 1.0
        return min(max(accepted / expected, YIELD_RANGE[0]), YIELD_RANGE[1])

    def observe(self, req_ids: Sequence[str], accepted: Sequence[int | None]) -> None:
        """The drafts each request's last verify accepted (None: it verified none), for the drafted yield: held
        against what the calibration expected of them when ``widths`` chose them."""
        got = want = 0.0
        for r, a in zip(req_ids, accepted):
            if r in self._expected and a is not None:
                got, want = got + float(a), want + self._expected[r]
        self._expected = {}
        if want > 0:
            old_got, old_want = self._yield
            self._yield = (YIELD_DECAY * old_got + got, YIELD_DECAY * old_want + want)

    def _scaled(self, acceptance: torch.Tensor) -> torch.Tensor:
        """``acceptance`` with its first draft's probability times the drafted yield (capped at 1), so each
        expected-token increment scales by it."""
        y = self.drafted_yield
        if y == 1.0 or not len(acceptance):
            return acceptance
        out = acceptance.clone()
        out[0] = min(1.0, float(out[0]) * y)
        return out

    def _backoff(self, acceptance: dict[int, torch.Tensor], widths: list[int]) -> None:
        """After a drafting step: when its drafts, as verified, beat a plain step by the margin (drafting pays here),
        a later gated-off run probes again after 1 step; otherwise the runs keep doubling (1, 2, 4 ... max_skip)."""
        n = len(widths)
        expected = n + sum(float(torch.cumprod(a[:k], 0).sum()) for i, a in acceptance.items() for k in [widths[i]] if k)
        rate = expected / self.costs.step_ms(n + sum(widths), n, drafted=True)
        if self.core.pays(rate, n / self.costs.step_ms(n, n, drafted=False)):
            self.backoff.paid()

    @property
    def margin(self) -> float:
        return self.core.margin

    def _learn(self, req_ids: Sequence[str], acceptance: dict[int, torch.Tensor]) -> None:
        """Each drafting request's prior and the population average (``DraftingCore.learn``)."""
        self._learned += 1
        for i, a in acceptance.items():
            self.core.learn(req_ids[i], a)
