"""The one drafting-policy core: what every adaptive drafting policy keeps and decides, whichever decoder it runs in.

* the request priors (``DraftingCore.prior`` / ``learn`` / ``forget`` / ``keep``): each request's prior of its drafts'
  calibrated acceptance (per column), keyed by the request's id, moved halfway to every drafted step's acceptances;
* the population average (``DraftingCore.population``): a moving average (``POPULATION_WEIGHT`` per drafting
  request-step) of every drafted request-step's acceptances, the prior of a request without one of its own;
* the gate (``DraftingCore.pays`` / ``discount``): drafting only where the modelled step with the drafts yields
  ``1 + margin`` times the tokens per ms of the step without them (``GATE_MARGIN``, ``pipeline.costs.margin``);
* the back-off (``BackOff``): runs of 1, 2, 4 ... ``max_skip`` steps without the drafter, each twice the last, from 1
  again once drafting paid.

Who calls it, and how the methods of one name relate (the one place this is written down):

==========================  ======================================================================================
registry ``verify_width``   ``VerifyWidthSchedule`` (``pipeline.policy.verify_width``), one request: each step
                            verifies the k drafts with the most expected tokens per ms (``widths.best_count``);
                            after a step whose best k did not beat a plain step its ``BackOff`` skips the drafter
registry ``budget``         ``BudgetPolicy`` (``pipeline.policy.budget``), a batched step: ``admit`` (may a request
                            draft at its load), the gate per request on its prior, the widths chosen jointly
                            (``widths.allocate``), and a ``BackOff`` per request after a step that gave it k = 0
plugin ``per_request``      ``StepPolicy`` (``pipeline.integrations.vllm.policy``) in vLLM: vLLM's drafter drafts K
                            for every request of a step or for none, so the gate and the back-off are the step's
                            (one decision on the requests' priors, one ``BackOff`` whose runs end in a probe); each
                            request's k alone (``widths.best_width``, priced at its 1/n share of the step)
plugin ``joint``            the same gate and back-off; the step's verify rows shared (``widths.allocate``)
==========================  ======================================================================================

The plugin's two were named ``verify_width`` and ``budget`` before issue 41. They share the width rules and this core
with the registry's methods of those names, but not their per-request gate and skips (vLLM cannot leave one request
out of a drafter forward), so they are named apart; the old names are refused with an error naming the new ones
(``pipeline.peers.vllm_settings.RENAMED``). Every decision is the one the three copies this core replaced made, but
one where they had drifted: where a drafted step has another number of columns than the population average, the plugin
restarted the average from that step; it now keeps the registry's rule (``moving``: the common columns averaged, the
others kept). In vLLM every drafting step has K columns unless its scheduler lowers K for a step, so the plugin decides as before.

Imports only torch (no transformers, no model code): the vLLM plugin keeps its priors here in vLLM's own process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable

import torch

from pipeline.costs.margin import GATE_MARGIN

POPULATION_WEIGHT = 0.1  # the population average's weight of each drafting request-step's acceptances


class BackOff:
    """Runs of steps without the drafter: 1, 2, 4 ... ``max_skip`` steps (each twice the last), from 1 again once
    drafting paid.

    Args:
        max_skip: the longest run (steps); 0: no runs (``missed`` starts an empty one).
    Attributes:
        run: the length of the last run started (0: none since drafting last paid); left: its steps still to skip.
    """

    def __init__(self, max_skip: int):
        self.max_skip, self.run, self.left = int(max_skip), 0, 0

    @property
    def next_run(self) -> int:
        """The length of the next run: twice the last, at least 1, at most ``max_skip``."""
        return min(max(1, 2 * self.run), self.max_skip)

    def missed(self) -> None:
        """Drafting did not pay: the next run starts now."""
        self.run = self.left = self.next_run

    def paid(self) -> None:
        """Drafting paid: the next run is 1 step again."""
        self.run = 0

    def skipping(self) -> bool:
        """Whether this step is one of the current run's (it spends one of its steps)."""
        if self.left > 0:
            self.left -= 1
            return True
        return False


@dataclass
class RequestState:
    """What the core keeps of one request.

    Attributes:
        prior: [b-1] its drafts' calibrated acceptance per column (None before it drafted, or once it was dropped);
        backoff: its own runs without the drafter (policies that skip per request); left_out: consecutive steps a
            gate left it out of drafting.
    """

    backoff: BackOff
    prior: torch.Tensor | None = None
    left_out: int = 0


def moving(old: torch.Tensor | None, new: torch.Tensor, weight: float) -> torch.Tensor:
    """``old`` moved by ``weight`` toward ``new`` on their common columns; ``new``'s further columns are taken as they
    are and ``old``'s kept (``new`` itself where ``old`` has none)."""
    if old is None or len(old) == 0:
        return new.clone()
    out = old.clone() if len(old) >= len(new) else torch.cat([old, new[len(old):]])
    m = min(len(old), len(new))
    out[:m] = (1 - weight) * old[:m] + weight * new[:m]
    return out


class DraftingCore:
    """The request priors, the population average, the gate and the per-request back-off (see the module docstring).

    A request is named by its id (the batched decoder's ``rid``, vLLM's request id). A policy drops what it keeps of a
    request that finished with ``forget``, or, given every live request, with ``keep``: the core holds no more requests
    than the policy last saw live.

    Args:
        max_skip: the longest back-off run (steps); margin: the gate's margin (``GATE_MARGIN`` by default).
    Attributes:
        requests: {request id: ``RequestState``}; population: [b-1] the population average, or None before any request
            drafted.
    Raises:
        ValueError: for max_skip < 0 or margin < 0.
    """

    def __init__(self, max_skip: int = 8, margin: float = GATE_MARGIN):
        if int(max_skip) < 0:
            raise ValueError(f"max_skip must be >= 0, got {max_skip}")
        if float(margin) < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        self.max_skip, self.margin = int(max_skip), float(margin)
        self.requests: dict[Hashable, RequestState] = {}
        self.population: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------------
    def state(self, rid: Hashable) -> RequestState:
        """What the core keeps of request ``rid`` (made on first use)."""
        state = self.requests.get(rid)
        if state is None:
            state = self.requests[rid] = RequestState(BackOff(self.max_skip))
        return state

    def prior(self, rid: Hashable) -> torch.Tensor | None:
        """Request ``rid``'s own prior, else the population's (None before any request drafted)."""
        state = self.requests.get(rid)
        own = state.prior if state is not None else None
        return own if own is not None else self.population

    def learn(self, rid: Hashable, acceptance: torch.Tensor) -> None:
        """One drafted step of request ``rid`` with calibrated acceptances ``acceptance`` [b-1]: the population
        average moves toward them by ``POPULATION_WEIGHT`` (``moving``), the request's prior halfway (they replace a
        prior of another number of columns)."""
        a = torch.as_tensor(acceptance, dtype=torch.float64).reshape(-1)
        if len(a):
            self.population = moving(self.population, a, POPULATION_WEIGHT)
        state = self.state(rid)
        old = state.prior
        state.prior = 0.5 * old + 0.5 * a if old is not None and len(old) == len(a) else a.clone()

    def forget(self, rid: Hashable) -> None:
        """Drop what the core keeps of request ``rid`` (it finished); a no-op for an unknown id."""
        self.requests.pop(rid, None)

    def keep(self, live: Iterable[Hashable]) -> None:
        """Drop every request not in ``live`` (the policy's view of the requests still decoding)."""
        live = set(live)
        for gone in [r for r in self.requests if r not in live]:
            del self.requests[gone]

    # ------------------------------------------------------------------------------------------------
    def pays(self, rate: float, plain: float) -> bool:
        """The gate: whether a modelled step with drafts at ``rate`` tokens per ms beats the step without them
        (``plain`` tokens per ms) by the margin."""
        return rate > plain * (1.0 + self.margin)

    def discount(self, rate: float) -> float:
        """A drafting step's modelled rate as the gate weighs it against steps without the drafter (by the margin)."""
        return rate / (1.0 + self.margin)
