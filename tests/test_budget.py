"""The verify budget (``pipeline.policy.budget``): the joint allocation is the optimum (brute-forced on small cases,
and known answers on constructed ones), the budget policy skips drafting after a step that did not pay, the
drafting-policy core it shares with ``verify_width`` and the vLLM plugin (``pipeline.policy.core``), the cost
model interpolates and round-trips, the batched foresight bound orders the policies as it must, and the measured cost
model (``pipeline.costs.batched``) has the right shape and is cached."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.costs import BatchCostModel, monotone
from pipeline.decoding.schedules import FixedSchedule
from pipeline.policy.budget import BudgetPolicy, batched_foresight_bound, simulate_batched
from pipeline.policy.calibration import AcceptanceCalibration
from pipeline.policy.core import GATE_MARGIN, BackOff, DraftingCore
from pipeline.policy.widths import allocate, brute_force_allocate
from pipeline.timing.batched import batch_costs_of


def _linear_costs(base: float = 10.0, per_row: float = 1.0, per_request: float = 0.0, draft: float = 0.0):
    return BatchCostModel([1, 64], [base + per_row, base + 64 * per_row], [1, 64], [draft, draft],
                          verify_per_request_ms=per_request)


def test_allocation_known_answers():
    # free rows (a flat cost curve): verify every draft with any chance of acceptance
    flat = BatchCostModel([1, 64], [10.0, 10.0], [1, 64], [0.0, 0.0])
    widths, rate = allocate([torch.tensor([0.9, 0.5, 0.1]), torch.tensor([0.2, 0.2])], flat)
    assert widths == [3, 2]
    assert rate == pytest.approx((2 + 0.9 + 0.45 + 0.045 + 0.2 + 0.04) / 10.0)
    # rows as dear as a whole step: nothing pays, every request takes a plain step
    dear = _linear_costs(base=0.0, per_row=10.0)
    assert allocate([torch.tensor([0.9, 0.9]), torch.tensor([0.5])], dear)[0] == [0, 0]
    # base 10 ms + 1 ms per row, two requests: the sure drafts pay, the doubtful ones do not
    widths, _ = allocate([torch.tensor([1.0, 1.0, 0.01]), torch.tensor([0.01, 0.9])], _linear_costs())
    assert widths == [2, 0]
    # plain requests in the step share its cost: (1 + 1 + 0.5) / 13 beats (1 + 1) / 12
    assert allocate([torch.tensor([0.5])], lambda rows: 10.0 + rows, plain_requests=1)[0] == [1]
    assert allocate([], _linear_costs(), plain_requests=3) == ([], pytest.approx(3 / 13))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(probs=st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4), min_size=1, max_size=3),
       plain=st.integers(0, 2), base=st.floats(0.5, 30.0), per_row=st.floats(0.0, 5.0),
       knee=st.integers(1, 8), steep=st.floats(0.0, 10.0))
def test_allocation_is_the_brute_force_optimum(probs, plain, base, per_row, knee, steep):
    """On any non-decreasing cost curve (here piecewise linear with a knee), the greedy prefix equals the best of all
    width combinations."""
    acceptance = [torch.tensor(p, dtype=torch.float64) for p in probs]

    def step_ms(rows: int) -> float:
        return base + per_row * rows + steep * max(0, rows - knee)

    widths, rate = allocate(acceptance, step_ms, plain)
    best_widths, best = brute_force_allocate(acceptance, step_ms, plain)
    assert rate == pytest.approx(best, rel=1e-9)
    expected = [1.0 + sum(float(torch.prod(a[:m])) for m in range(1, k + 1)) for a, k in zip(acceptance, widths)]
    assert (plain + sum(expected)) / step_ms(plain + len(probs) + sum(widths)) == pytest.approx(best, rel=1e-9)


def test_cost_model_interpolates_and_round_trips():
    costs = BatchCostModel([1, 4, 16], [10.0, 12.0, 30.0], [8, 16], [5.0, 7.0], verify_per_request_ms=0.5,
                           draft_per_request_ms=0.25)
    assert costs.verify(2) == pytest.approx(10 + 2 / 3 * 1)
    assert costs.verify(32) == pytest.approx(30 + 16 * 1.5)  # linear beyond the table
    assert costs.step_ms(4, 0, 3) == pytest.approx(12 + 1.0)
    assert costs.step_ms(4, 16, 3, 2) == pytest.approx(12 + 1.0 + 7 + 0.25)
    assert BatchCostModel.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    with pytest.raises(ValueError, match="ascending"):
        BatchCostModel([4, 1], [1.0, 2.0], [1], [1.0])
    assert monotone([3.0, 1.0, 2.0, 5.0, 4.0]) == [2.0, 2.0, 2.0, 4.5, 4.5]


class _Req:
    """A batched request as the policy sees it: its id."""

    count = 0

    def __init__(self):
        _Req.count += 1
        self.rid = f"r{_Req.count}"


def test_budget_policy_skips_the_drafter_after_an_unpaid_step():
    calibration = AcceptanceCalibration([0.0] * 4, [1.0] * 4)  # a_j = p_j
    policy = BudgetPolicy(calibration, _linear_costs(base=10.0, per_row=4.0), max_skip=4, gate=False)
    good, bad = _Req(), _Req()
    assert policy.plan([good, bad], [4, 4]) == [4, 4]
    widths = policy.allocate([good, bad], [torch.tensor([0.999, 0.999, 0.999]), torch.tensor([0.01, 0.01, 0.01])])
    assert widths[0] == 3 and widths[1] == 0
    # the bad request skips 1 step, then drafts again; after a second miss it skips 2
    assert policy.plan([good, bad], [4, 4]) == [4, 1]
    assert policy.plan([good, bad], [4, 4]) == [4, 4]
    policy.allocate([good, bad], [torch.tensor([0.999] * 3), torch.tensor([0.01] * 3)])
    assert [policy.plan([good, bad], [4, 4])[1] for _ in range(3)] == [1, 1, 4]
    with pytest.raises(ValueError, match="max_skip"):
        BudgetPolicy(calibration, _linear_costs(), max_skip=-1)


def test_budget_gate_drafts_only_where_drafting_pays():
    """Before drafting, the gate leaves out a request whose prior acceptance does not repay the drafter's cost (here
    1 ms per drafted row over a verify of 10 + 1 ms per row), keeps one whose does; a request without a prior takes the
    population's (it probes only before anyone drafted), and one left out max_skip steps drops its prior for the
    population's."""
    calibration = AcceptanceCalibration([0.0] * 4, [1.0] * 4)  # a_j = p_j
    costs = BatchCostModel([1, 64], [11.0, 74.0], [1, 64], [1.0, 64.0])  # verify 10 + 1/row; draft 1/row
    policy = BudgetPolicy(calibration, costs, max_skip=3)
    good, bad, new = _Req(), _Req(), _Req()
    assert policy.plan([good, bad], [4, 4]) == [4, 4]  # nobody has drafted yet: both probe
    policy.allocate([good, bad], [torch.tensor([0.999] * 3), torch.tensor([0.05] * 3)])
    assert policy.core.requests[good.rid].prior.tolist() == pytest.approx([0.999] * 3)
    assert policy.population.tolist() == pytest.approx([0.9 * 0.999 + 0.1 * 0.05] * 3)  # both drafts moved it
    policy.core.state(bad.rid).backoff.left = 0  # only the gate decides below
    assert policy.plan([good, bad, new], [4, 4, 4]) == [4, 1, 4]  # the new request drafts on the population's prior
    assert [policy.plan([good, bad], [4, 4])[1] for _ in range(3)] == [1, 1, 4]  # left out 3 steps: the population's
    # where the requests seen so far accepted little, a new request takes their prior and does not draft at all
    poor = BudgetPolicy(calibration, costs, max_skip=3)
    first, second, late = _Req(), _Req(), _Req()
    assert poor.plan([first, second], [4, 4]) == [4, 4]
    poor.allocate([first, second], [torch.tensor([0.05] * 3), torch.tensor([0.1] * 3)])
    poor.core.state(first.rid).backoff.left = poor.core.state(second.rid).backoff.left = 0
    assert [poor.plan([first, second, late], [4, 4, 4]) for _ in range(5)] == [[1, 1, 1]] * 5  # nor after max_skip
    # where drafting costs 4 ms a row, not even the best request's drafts repay it
    dear = BudgetPolicy(calibration, BatchCostModel([1, 64], [11.0, 74.0], [1, 64], [4.0, 256.0]), max_skip=3)
    dear.population = torch.tensor([0.999] * 3, dtype=torch.float64)
    assert dear.plan([_Req(), _Req()], [4, 4]) == [1, 1]
    # where drafting is free, every request with any chance drafts
    free = BudgetPolicy(calibration, BatchCostModel([1, 64], [10.0, 10.0], [1, 64], [0.0, 0.0]), max_skip=3)
    assert free.plan([good, bad], [4, 4]) == [4, 4]
    # the policy keeps a request's state under its rid, only while it decodes: plan drops the requests it no longer
    # gets, finished at once
    assert set(policy.core.requests) == {good.rid, bad.rid}
    policy.finished(bad)
    assert set(policy.core.requests) == {good.rid}
    policy.plan([new], [4])
    assert set(policy.core.requests) == {new.rid}


def test_the_drafting_policy_core():
    """``pipeline.policy.core``: the back-off's runs 1, 2, 4 ... max_skip (1 again once drafting paid), each request's
    prior halfway to each drafted step's acceptances under its id until forgotten, the population average on the
    columns in common (a longer step's further columns added, a shorter one's missing ones kept), the gate's margin."""
    off = BackOff(max_skip=4)
    runs = []
    for _ in range(4):
        off.missed()
        runs.append(sum(off.skipping() for _ in range(6)))  # a run's steps are skipped, then the drafter looks
    assert runs == [1, 2, 4, 4] and off.next_run == 4
    off.paid()
    assert off.next_run == 1 and not off.skipping()
    never = BackOff(max_skip=0)
    never.missed()
    assert not never.skipping()
    core = DraftingCore(max_skip=3)
    assert core.margin == GATE_MARGIN == 0.1 and core.prior("a") is None  # nobody drafted: no prior at all
    core.learn("a", torch.tensor([0.8, 0.6]))
    assert core.prior("b").tolist() == pytest.approx([0.8, 0.6])  # a request without its own: the population's
    core.learn("a", torch.tensor([0.4, 0.2]))
    assert core.prior("a").tolist() == pytest.approx([0.6, 0.4])  # halfway
    assert core.population.tolist() == pytest.approx([0.9 * 0.8 + 0.1 * 0.4, 0.9 * 0.6 + 0.1 * 0.2])
    core.learn("b", torch.tensor([1.0, 1.0, 1.0]))
    assert core.population.tolist() == pytest.approx([0.9 * 0.76 + 0.1, 0.9 * 0.56 + 0.1, 1.0])
    core.learn("c", torch.tensor([0.0]))
    assert core.population.tolist() == pytest.approx([0.9 * (0.9 * 0.76 + 0.1), 0.9 * 0.56 + 0.1, 1.0])
    core.learn("a", torch.tensor([0.5]))
    assert core.prior("a").tolist() == [0.5]  # another number of columns: replaced
    core.forget("a")
    core.forget("unknown")
    assert set(core.requests) == {"b", "c"} and core.prior("a") is core.population
    core.keep(["c", "d"])
    assert set(core.requests) == {"c"}
    assert core.pays(1.11, 1.0) and not core.pays(1.1, 1.0) and core.discount(1.1) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="margin"):
        DraftingCore(margin=-0.1)
    with pytest.raises(ValueError, match="max_skip"):
        DraftingCore(max_skip=-1)


def test_budget_admits_a_request_to_draft_only_at_a_load_where_drafting_pays():
    """At admission, a request may draft only where the modelled step with drafting requests beats the plain step:
    here a verify costs 10 ms + 2 ms per row and the drafter 2 ms per row. Alone, a confident draft of 3 pays (3.4
    tokens for 26 ms against 1 for 12); among 16, neither one drafting request (18.4 tokens for 56 ms) nor all of them
    (55 for 266 ms) beat the plain step (16 for 42 ms). Once requests have drafted, what they yielded replaces the
    confident prior."""
    calibration = AcceptanceCalibration([0.0] * 4, [1.0] * 4)  # a_j = p_j
    costs = BatchCostModel([1, 64], [12.0, 138.0], [4, 64], [8.0, 128.0])
    policy = BudgetPolicy(calibration, costs)
    schedule = FixedSchedule(4)
    assert policy.admit(schedule, 1) is schedule and policy.admitted == {1: True}
    assert policy.admit(schedule, 16).block_size == 1 and policy.admitted[16] is False
    assert policy.admit(FixedSchedule(1), 1).block_size == 1  # nothing to draft
    policy.drafted_yield = (1.05, 1.0)  # drafting requests have yielded next to nothing: not even alone
    assert policy.admit(schedule, 1).block_size == 1
    policy.allocate([_Req()], [torch.tensor([0.999] * 3)])  # a confident draft moves the yield up
    assert policy.drafted_yield[0] > 1.05


def test_batched_foresight_bound_orders_the_policies():
    # two requests of 9 tokens, B = 4: one accepts every draft, one none
    work = [(9, [3, 3, 3]), (9, [0] * 8)]
    costs = _linear_costs(base=10.0, per_row=1.0, draft=2.0)
    ar = simulate_batched(work, costs, 4, 2, "ar")
    assert ar == {"tokens": 18.0, "ms": 8 * 12.0, "tokens_per_ms": 18 / 96.0, "steps": 8}
    sight = simulate_batched(work, costs, 4, 2, "foresight")
    # the good request finishes in 2 steps (1 + 4 + 4 tokens): steps 1-2 cost 10 + 5 rows + 2 (draft), then 6 plain
    assert sight["ms"] == pytest.approx(2 * (10 + 5 + 2) + 6 * 11) and sight["tokens"] == 18
    fixed = simulate_batched(work, costs, 4, 2, "fixed")
    drafting = simulate_batched(work, costs, 4, 2, "foresight_drafting")
    assert sight["tokens_per_ms"] >= drafting["tokens_per_ms"] >= fixed["tokens_per_ms"]
    # one slot: requests run one after the other
    assert simulate_batched(work, costs, 4, 1, "ar")["steps"] == 16
    labels = pd.DataFrame([{"id": "a", "candidates": [1, 4], "new_tokens": [9, 9], "prompt_tokens": 5, "source_set": "x",
                            "conf_block": [4] * 9, "conf_column": [1, 2, 3] * 3, "conf_ok": [True] * 9},
                           {"id": "b", "candidates": [1, 4], "new_tokens": [9, 9], "prompt_tokens": 5, "source_set": "x",
                            "conf_block": [4] * 8, "conf_column": [1] * 8, "conf_ok": [False] * 8}])
    bound = batched_foresight_bound(labels, costs, 4, [1, 2])
    assert bound["by_concurrency"]["2"]["foresight"] == pytest.approx(sight["tokens_per_ms"] / ar["tokens_per_ms"])
    assert bound["by_concurrency"]["1"]["requests"] == 2
    with pytest.raises(ValueError, match="B=8"):
        batched_foresight_bound(labels, costs, 8, [1])


def test_measured_costs_are_cached(tiny, tmp_path, steady_clock):
    decoder = tiny.decoder("llama", "random")
    settings_ = {"context": 16, "rows": [1, 2, 4, 8], "repeats": 1, "cache": str(tmp_path), "spot_check": False}
    model = {"target": "tiny", "drafter": "tiny"}
    costs = batch_costs_of(decoder, settings_, model, block_size=4, max_requests=2)
    assert costs.verify_rows == [1, 2, 4, 8] and costs.draft_rows == [4, 8]
    assert costs.verify_ms == sorted(costs.verify_ms) and all(v > 0 for v in costs.verify_ms)
    assert costs.info["exact_batching"] is False  # eager: each request's forward alone
    assert set(costs.spread) == {"verify", "draft"} and "check" in costs.info
    files = list(tmp_path.glob("batch-costs-*.json"))
    assert len(files) == 1
    assert batch_costs_of(decoder, settings_, model, block_size=4, max_requests=2) == costs  # read back, not remeasured
    fresh = batch_costs_of(decoder, settings_, model, block_size=4, max_requests=2, fresh=True)
    assert fresh != costs and json.loads(files[0].read_text())["batch_costs"] == fresh.to_dict()
    with pytest.raises(ValueError, match="repeats"):
        batch_costs_of(decoder, {**settings_, "repeats": 0, "cache": None}, model, block_size=4, max_requests=2)
    # B = 2: two blocks of 2 rows do not fit in one block of B, so no per-request drafter share is timed (0), and the
    # draft table is the drafter's whole cost
    small = batch_costs_of(decoder, {**settings_, "cache": None}, model, block_size=2, max_requests=2)
    assert small.draft_per_request_ms == 0.0 and small.draft_rows == [2, 4] and all(v > 0 for v in small.draft_ms)
