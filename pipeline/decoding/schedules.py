"""Block-size schedules: how the decoder picks B for each draft-verify step.

A schedule (``Schedule``) sees the target's last-token logits once after prefill (``first``) and the acceptance
length of every step (``next``); one whose ``static`` attribute is true keeps ``first``'s B for the whole request; one
whose ``chooses_widths`` is true also picks each step's verify width (``choose_width``). ``FixedSchedule`` is the usual single-B decoder, the BlockPilot
predictor wraps a policy in ``first`` (see ``pipeline.policy``), and ``EMASchedule`` is the per-round
adaptive baseline of the SGLang DFlash work.
A ``BatchPolicy`` decides how the requests of a batched step (``pipeline.decoding.batched``) share it: which requests
may draft at all (``admit``), which draft this step (``plan``) and their verify widths together (``allocate``).

The decoder records the B that ``first`` picked in ``RequestStats.first_block_size`` (the eval stage and the server
report it).
"""

from __future__ import annotations

from typing import Sequence

import torch


class Schedule:
    """How one request picks its block size B each step and, optionally, how many drafts each step verifies.

    The decoder (``SpeculativeDecoder.decode``, ``BatchedDecoder``), the eval stage and the server call exactly this
    interface; every schedule of the project subclasses it.

    Attributes:
        max_block_size: the largest B it may pick (the decoder checks it against the drafter's limit; 1: no drafter).
        static: True when B never changes after ``first`` (the eval stage may then share the decode of one B).
        chooses_widths: True when ``choose_width`` picks each step's verify width k (the decoder then computes the
            drafter's confidences for it); False: every step verifies all its B-1 drafts.
        chooses_trees: True when ``choose_tree`` picks each drafted step's draft tree (``pipeline.decoding.trees``)
            from the drafter's top candidates at every position (the decoder then verifies the tree, not a chain).
        proposes: True when it has draft sources of its own besides the drafter (``pipeline.policy.mixed``): the step
            calls ``prepare`` before the drafter, ``choose_tree`` every step (without the drafter's candidates on a
            step that does not draft) and ``verified`` after the verify.
        load: the requests in the step being planned (``pipeline.decoding.step.advance`` sets it before ``prepare``;
            1 alone): a schedule that sizes its drafts on a batched cost model reads it.
    """

    max_block_size: int = 1
    load: int = 1
    static: bool = False
    chooses_widths: bool = False
    chooses_trees: bool = False
    proposes: bool = False

    def first(self, last_logits: torch.Tensor) -> int:
        """B for the first step, from the target's prefill logits at the last prompt token ([V])."""
        raise NotImplementedError

    def next(self, tau: int, block_size: int) -> int:
        """B for the next step, given the last step's acceptance length tau (tokens) and its B."""
        return block_size

    def choose_width(self, confidence: torch.Tensor, start: int) -> int:
        """The verify width k (0..len(confidence)) of a step whose drafts have the drafter's probabilities
        ``confidence`` [B-1], at cache position ``start`` (only called when ``chooses_widths``)."""
        return len(confidence)

    def choose_tree(self, tokens: torch.Tensor | None, probs: torch.Tensor | None, start: int):
        """The ``DraftTree`` to verify from the drafter's candidates ``tokens`` [B-1, k] (best first at each position)
        and its probabilities of them ``probs`` [B-1, k], at cache position ``start`` (only called when
        ``chooses_trees``, and, with None for both, on a step that did not draft when ``proposes``; its ``top_k``
        attribute is the k the decoder drafts)."""
        raise NotImplementedError

    def prepare(self, request, block_size: int) -> int:
        """Before a step's drafter forward (``proposes`` only): read ``request``'s tokens for the schedule's own
        sources and return the block size to draft at (1: skip the drafter this step)."""
        return block_size

    def verified(self, tree, path: list[int], tokens: list[int], logits: torch.Tensor) -> None:
        """After a step's verify (``proposes`` only): the tree verified, its accepted nodes, and the target's logits
        [len(path) + 1, V] at the rows of the accepted path, whose input tokens are ``tokens``."""

    def timed_verify(self, rows: int, ms: float, start: int, requests: int = 1) -> None:
        """After a step's verify: ``rows`` rows verified in ``ms`` of wall time, by a request decoded alone (``requests``
        1, its cache at ``start`` tokens) or by the ``requests`` requests of a batched step (told to the first one's
        schedule). A schedule that corrects its costs by observed times reads it (``pipeline.costs.ObservedCosts``,
        ``ObservedRowCost``)."""


class ExternalDecode:
    """A method that decodes a request itself instead of scheduling the project's decoder (transformers' ``generate``,
    ``pipeline.policy.baselines``; vLLM, ``pipeline.integrations.vllm``): the eval stage calls ``run_request``."""

    max_block_size: int = 1
    static: bool = False

    def run_request(self, decoder, input_ids: torch.Tensor, config) -> "RequestStats":  # noqa: F821
        """Decode one request ([1, n] prompt ids) under ``config`` (``DecodeConfig``); its ``RequestStats``."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what it started (a server process); the eval stage calls it after its last request."""


class FixedSchedule(Schedule):
    """One block size for the whole request."""

    static = True  # B never changes after ``first`` (the eval stage may share such decodes)

    def __init__(self, block_size: int):
        self.block_size = self.max_block_size = int(block_size)

    def first(self, last_logits: torch.Tensor) -> int:
        return self.block_size

    def next(self, tau: int, block_size: int) -> int:
        return self.block_size


class EMASchedule(Schedule):
    """Per-step adaptive B from a moving average of recent acceptance lengths.

    After each step, ``ema = alpha * tau + (1 - alpha) * ema``; the next B is the smallest candidate
    at least ``ema + margin`` (the largest candidate when none is), so blocks grow while drafts are
    accepted and shrink after rejections. Starts at ``start`` (default: the middle candidate).
    """

    def __init__(self, candidates: Sequence[int], alpha: float = 0.5, margin: float = 1.0, start: int | None = None):
        self.candidates = sorted(int(c) for c in candidates)
        if not self.candidates:
            raise ValueError("EMASchedule needs at least one candidate block size")
        self.alpha, self.margin = float(alpha), float(margin)
        self.start = int(start) if start is not None else self.candidates[len(self.candidates) // 2]
        self.max_block_size = self.candidates[-1]
        self.ema = float(self.start)

    def first(self, last_logits: torch.Tensor) -> int:
        self.ema = float(self.start)
        return self.start

    def next(self, tau: int, block_size: int) -> int:
        self.ema = self.alpha * tau + (1 - self.alpha) * self.ema
        goal = self.ema + self.margin
        return next((c for c in self.candidates if c >= goal), self.candidates[-1])


class BatchPolicy:
    """How the requests of a batched step share it. This base leaves every choice to each request's own schedule;
    a joint policy (``pipeline.policy.budget.BudgetPolicy``) overrides the three hooks.

    Attributes:
        joint_widths: True when ``allocate`` chooses the verify widths of the step's drafting requests together (the
            decoder then computes every drafting request's confidences); False: each request's schedule chooses its own
            (``Schedule.choose_width``), or verifies all its drafts.
    """

    joint_widths: bool = False

    def admit(self, schedule: Schedule, load: int) -> Schedule:
        """The schedule a request joins with, given ``load``: the requests in the system as it joins (itself, the
        ones decoding and the ones waiting). The base keeps the request's own."""
        return schedule

    def plan(self, requests: Sequence, sizes: Sequence[int]) -> list[int]:
        """The block size of each request this step (1: no draft), from the B its schedule chose (``sizes``)."""
        return list(sizes)

    def allocate(self, requests: Sequence, confidences: Sequence[torch.Tensor]) -> list[int]:
        """The verify width k_i of each drafting request, from its drafts' probabilities [b_i - 1] (``joint_widths``
        only)."""
        raise NotImplementedError

    def finished(self, request) -> None:
        """A request left the batch (done or cancelled): drop what the policy keeps of it. The base keeps nothing."""
