"""Many requests, one step: the request loop of a batch. N active requests advance together through the one decode
step (``pipeline.decoding.step.advance``: one drafter forward, one target forward over every request's draft tree,
each request's rows bit for bit those of its decode alone), so each request's text at T=0 is its autoregressive text
whatever the batch's composition, arrival order and trees, and at T>0 the same sampled text (position-keyed noise).

Requests join at a step boundary after their own prefill (``BatchedDecoder.add``) and leave when they stop, reach
``max_new_tokens`` or their ``on_tokens`` callback returns true; each request's life (start, per-step record, end) is
``pipeline.decoding.requests.Request``'s, as a request decoded alone. Which requests wait, prefill and join is the one
scheduler's (``pipeline.decoding.scheduler``: the server's engine and ``pipeline.bench_batch`` both run it).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pipeline.decoding.requests import DecodeConfig, PrefillResult, Request, as_schedule
from pipeline.decoding.schedules import BatchPolicy, Schedule
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.decoding.step import advance
from pipeline.models.clock import now


class BatchedDecoder:
    """Advances many requests of one ``SpeculativeDecoder`` together (see the module doc).

    Args:
        decoder: the loaded decoder (target, drafter, backend); its prefill runs per request.
        policy: how the step is shared (``BatchPolicy``: admission, each step's block sizes and verify widths); None:
            the base policy (each request's own schedule decides).
    Attributes:
        active: the requests not yet done, in arrival order; steps: batched steps run; rows: per step, the
            (verified rows, drafted rows, requests, drafting requests) it ran; step_log: per step (wall ms, tokens
            emitted).
    """

    def __init__(self, decoder: SpeculativeDecoder, policy: BatchPolicy | None = None):
        self.decoder = decoder
        self.forward = decoder.forward
        self.policy = policy if policy is not None else BatchPolicy()
        self.active: list[Request] = []
        self.steps = 0
        self.rows: list[tuple[int, int, int, int]] = []
        self.step_log: list[tuple[float, int]] = []

    # -------------------------------------------------------------------------------------------
    def add(self, input_ids: torch.Tensor | PrefillResult, schedule: Schedule | int, config: DecodeConfig,
            rid: Any = None, on_tokens: Callable[[list[int]], bool | None] | None = None,
            arrived_s: float | None = None, load: int | None = None) -> Request:
        """Prefill a request alone (or take its ``PrefillResult``) and make it join the batch at the next step.

        Args:
            input_ids: [1, n] or [n] prompt ids, or a prefill already run (with drafter features when B > 1).
            schedule: its block-size schedule, or an int (a fixed B; 1 = autoregressive, no drafter); the policy's
                ``admit`` may replace it, given ``load`` (None: the active requests + this one).
        Returns:
            the ``Request`` (already ``done`` when its first token is a stop token or max_new_tokens is 1).
        Raises:
            ValueError: for an empty or too-long prompt, or a block size this decoder cannot run.
        """
        dec = self.decoder
        schedule = self.policy.admit(as_schedule(dec, schedule), len(self.active) + 1 if load is None else int(load))
        if not isinstance(input_ids, PrefillResult):
            dec.check_block_size(schedule.max_block_size)
            input_ids = dec.prefill(input_ids, config, want_features=schedule.max_block_size > 1)
        req = Request.begin(dec, input_ids, schedule, config, rid, on_tokens, arrived_s)
        if not req.done:
            self.active.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """End ``req`` now (a client that went away): it leaves the batch and frees its slot."""
        req.cancel(now(self.decoder.device))
        if req in self.active:
            self.active.remove(req)
            self.policy.finished(req)

    # -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One batched draft-verify step of every active request; the finished ones leave the batch.

        Returns:
            the requests that finished in this step.
        Raises:
            ValueError: for a block size out of range (checked for every request).
        """
        dec = self.decoder
        reqs = list(self.active)
        if not reqs:
            return []
        t_step = now(dec.device)
        news, sizes, shape = advance(self.forward, self.policy, reqs)
        self.steps += 1
        self.rows.append(shape.as_tuple())
        t_end = now(dec.device)
        finished = []
        emitted = 0
        for r, new, b in zip(reqs, news, sizes):
            emitted += len(r.record(new, b, t_end))
            if r.done:
                finished.append(r)
                self.active.remove(r)
                self.policy.finished(r)
        self.step_log.append(((t_end - t_step) * 1e3, emitted))
        return finished

    def run(self) -> None:
        """Step until no request is active."""
        while self.active:
            self.step()
