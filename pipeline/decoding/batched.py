"""Many requests, one step: N active requests advance together, each exactly as ``SpeculativeDecoder.step`` would.

A batched step (``BatchedDecoder.step``) takes every active request's next block size b_i (from its schedule, capped by
its remaining token budget; the ``BatchPolicy``'s ``plan`` may make it 1 = skip the drafter), runs ONE drafter forward
over all drafting requests' blocks, chooses each request's verify width k_i (its own verify-width policy, the
``BatchPolicy``'s joint allocation such as ``pipeline.policy.budget.BudgetPolicy``'s, or b_i - 1), runs ONE target
forward over all verified rows (request i contributes k_i + 1), then per request keeps the longest matching prefix plus
the bonus token, rolls its caches back and samples with its own position-keyed sampler. The forwards are
``pipeline.models.batched_forward.BatchedForward``:
linears once over the concatenated rows, attention per request over its own cache, so each request's logits are bit
for bit those of its decode alone at the same widths (on the smallm backend; off it, each request's forward runs
alone). Every k is lossless, so each request's text at T=0 is its autoregressive text whatever the batch's
composition, arrival order and widths, and at T>0 the same sampled text (position-keyed noise).

Requests join at a step boundary after their own prefill (``BatchedDecoder.add``) and leave when they stop, reach
``max_new_tokens`` or their ``on_tokens`` callback returns true; each request's life (start, per-step record, end) is
``pipeline.decoding.requests.Request``'s, as a request decoded alone. Which requests wait, prefill and join is the one
scheduler's (``pipeline.decoding.scheduler``: the server's engine and ``pipeline.bench_batch`` both run it).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from pipeline.decoding.requests import DecodeConfig, PrefillResult, Request, as_schedule
from pipeline.decoding.sampling import draft_confidence
from pipeline.decoding.schedules import BatchPolicy, Schedule
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.models.batched_forward import BatchedForward
from pipeline.models.cache import crop_to
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
        self.forward = BatchedForward(decoder)
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
        for r in reqs:
            dec.check_block_size(r.block_size)
        sizes = [r.next_block() for r in reqs]
        planned = [int(b) for b in self.policy.plan(reqs, sizes)]
        sizes = [max(1, min(p, b)) for p, b in zip(planned, sizes)]
        mask_id = dec.drafter.mask_token_id if dec.drafter is not None else 0
        blocks = []
        for r, b in zip(reqs, sizes):
            block = torch.full((1, b), mask_id, dtype=torch.long, device=dec.device)
            block[0, 0] = r.state.pending
            blocks.append(block)

        # one drafter forward over every drafting request's block
        drafting = [i for i, b in enumerate(sizes) if b > 1]
        confidences: list[torch.Tensor | None] = [None] * len(reqs)
        want_conf = self.policy.joint_widths
        if drafting:
            states = [reqs[i].state for i in drafting]
            hidden = self.forward.draft_hidden([blocks[i] for i in drafting], [s.features for s in states],
                                               [s.start for s in states], [s.draft_cache for s in states])
            for s in states:
                crop_to(s.draft_cache, s.start)
                s.features = s.features[:, :0]
            logits = self.forward.draft_logits([h[0, 1:] for h in hidden])
            for j, i in enumerate(drafting):
                r = reqs[i]
                columns = r.sampler.pick_columns(logits[j], r.state.start + 1, dec.draft_vocab)
                blocks[i][0, 1:] = columns if dec.draft_vocab is None else dec.draft_vocab[columns]
                if want_conf or r.schedule.chooses_widths:
                    confidences[i] = draft_confidence(logits[j], columns, r.sampler.temperature)

        # every request's verify width
        widths = [0] * len(reqs)
        if self.policy.joint_widths and drafting:
            chosen = self.policy.allocate([reqs[i] for i in drafting], [confidences[i] for i in drafting])
            for i, k in zip(drafting, chosen):
                widths[i] = int(k)
        else:
            for i in drafting:
                schedule = reqs[i].schedule
                widths[i] = (int(schedule.choose_width(confidences[i], reqs[i].state.start)) if schedule.chooses_widths
                             else sizes[i] - 1)
        widths = [max(0, min(k, b - 1)) for k, b in zip(widths, sizes)]

        # one target forward over every request's k_i + 1 rows
        verified = [blocks[i][:, : widths[i] + 1] for i in range(len(reqs))]
        outs = self.forward.target(verified, [r.state.cache for r in reqs], [r.state.start for r in reqs],
                                   [r.state.draft_cache is not None for r in reqs])
        self.steps += 1
        self.rows.append((sum(k + 1 for k in widths), sum(sizes[i] for i in drafting), len(reqs), len(drafting)))
        t_end = now(dec.device)
        finished = []
        emitted = 0
        for i, r in enumerate(reqs):
            before = r.stats.new_tokens
            r.state.last_width, r.state.last_confidence = widths[i], confidences[i]
            new, _ = dec.accept(r.state, verified[i], *outs[i], r.sampler)
            r.record(new, sizes[i], t_end)
            emitted += r.stats.new_tokens - before
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
