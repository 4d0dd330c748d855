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
``max_new_tokens`` or their ``on_tokens`` callback returns true. ``decode_all`` runs a whole workload with arrivals at
given step indices (the tests' and ``pipeline.bench_batch``'s driver).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from pipeline.decoding.sampling import PositionKeyedSampler, draft_confidence
from pipeline.decoding.schedules import BatchPolicy, FixedSchedule, Schedule
from pipeline.decoding.speculative import DecodeConfig, DecodeState, PrefillResult, RequestStats, SpeculativeDecoder
from pipeline.models.batched_forward import BatchedForward
from pipeline.models.cache import crop_to
from pipeline.models.clock import now


@dataclass
class BatchRequest:
    """One request in a batch.

    Attributes:
        rid: the caller's id of the request.
        config: its decoding settings; schedule: its block-size schedule (B per step; ``choose_width`` when it has one).
        state: its ``DecodeState`` (caches, pending token, position); sampler: its position-keyed sampler.
        stats: its ``RequestStats`` (output ids, per-step tau, B, k, confidences, times).
        block_size: the B its schedule chose for the next step.
        on_tokens: called with each step's new tokens (the prefill's first token first); a true return ends it.
        done: finished (stop token, max_new_tokens or halted); halted: ended by ``on_tokens``.
        arrived_s / first_token_s / finished_s: perf_counter times (s) of its arrival, its first token, its end.
        token_times: perf_counter time (s) at which each output token was emitted.
    """

    rid: Any
    config: DecodeConfig
    schedule: Schedule
    state: DecodeState
    sampler: PositionKeyedSampler
    stats: RequestStats
    block_size: int
    on_tokens: Callable[[list[int]], bool | None] | None = None
    done: bool = False
    halted: bool = False
    arrived_s: float = 0.0
    first_token_s: float = 0.0
    finished_s: float = 0.0
    token_times: list[float] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        """Tokens left in its budget (``max_new_tokens`` minus the output so far)."""
        return self.config.max_new_tokens - self.stats.new_tokens


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
        self.active: list[BatchRequest] = []
        self.steps = 0
        self.rows: list[tuple[int, int, int, int]] = []
        self.step_log: list[tuple[float, int]] = []

    # -------------------------------------------------------------------------------------------
    def add(self, input_ids: torch.Tensor | PrefillResult, schedule: Schedule | int, config: DecodeConfig,
            rid: Any = None, on_tokens: Callable[[list[int]], bool | None] | None = None,
            arrived_s: float | None = None, load: int | None = None) -> BatchRequest:
        """Prefill a request alone (or take its ``PrefillResult``) and make it join the batch at the next step.

        Args:
            input_ids: [1, n] or [n] prompt ids, or a prefill already run (with drafter features when B > 1).
            schedule: its block-size schedule, or an int (a fixed B; 1 = autoregressive, no drafter); the policy's
                ``admit`` may replace it, given ``load`` (None: the active requests + this one).
        Returns:
            the ``BatchRequest`` (already ``done`` when its first token is a stop token or max_new_tokens is 1).
        Raises:
            ValueError: for an empty or too-long prompt, or a block size this decoder cannot run.
        """
        dec = self.decoder
        if isinstance(schedule, int):
            dec.check_block_size(schedule)
            schedule = FixedSchedule(schedule)
        schedule = self.policy.admit(schedule, len(self.active) + 1 if load is None else int(load))
        dec.check_block_size(schedule.max_block_size)
        use_drafter = schedule.max_block_size > 1
        arrived = now(dec.device) if arrived_s is None else arrived_s
        if isinstance(input_ids, PrefillResult):
            prefill = input_ids
            dec.check_prompt(prefill.input_ids, config.max_new_tokens)
            if use_drafter and prefill.features is None:
                raise ValueError("prefill ran without drafter features; call prefill(want_features=True)")
        else:
            prefill = dec.prefill(input_ids, config, want_features=use_drafter)
        sampler = PositionKeyedSampler(config.temperature, config.seed, dec.lm_head.shape[0])
        stats = RequestStats(prompt_tokens=prefill.input_ids.shape[1], prefill_ms=prefill.prefill_ms)
        t0 = now(dec.device)
        block_size = stats.first_block_size = int(schedule.first(prefill.last_logits))
        stats.schedule_ms = (now(dec.device) - t0) * 1e3
        state = dec.new_state(prefill, use_drafter)
        req = BatchRequest(rid, config, schedule, state, sampler, stats, block_size, on_tokens, arrived_s=arrived)
        t = now(dec.device)
        req.first_token_s = t
        stats.output_ids.append(state.pending)
        req.token_times.append(t)
        stats.stopped = state.pending in dec.stop_ids
        req.halted = on_tokens is not None and bool(on_tokens([state.pending]))
        self._finish_if_done(req, t)
        if not req.done:
            self.active.append(req)
        return req

    def _finish_if_done(self, req: BatchRequest, now: float) -> None:
        if req.halted or req.stats.stopped or req.remaining <= 0:
            req.done = True
            req.finished_s = now
            req.stats.decode_ms = (now - req.first_token_s) * 1e3

    def cancel(self, req: BatchRequest) -> None:
        """End ``req`` now (a client that went away): it leaves the batch and frees its slot."""
        if not req.done:
            req.halted = True
            self._finish_if_done(req, now(self.decoder.device))
        if req in self.active:
            self.active.remove(req)

    # -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[BatchRequest]:
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
        sizes = [min(r.block_size, r.remaining) for r in reqs]
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
            self._record(r, new, sizes[i], t_end)
            emitted += r.stats.new_tokens - before
            if r.done:
                finished.append(r)
                self.active.remove(r)
        self.step_log.append(((t_end - t_step) * 1e3, emitted))
        return finished

    def _record(self, r: BatchRequest, new: list[int], b: int, now: float) -> None:
        """``SpeculativeDecoder.decode``'s per-step bookkeeping for one request (stop tokens, stats, schedule)."""
        stats = r.stats
        new, stats.stopped = self.decoder.cut_at_stop(new)
        stats.output_ids.extend(new)
        r.token_times.extend([now] * len(new))
        stats.taus.append(len(new))
        stats.block_sizes.append(b)
        stats.verify_widths.append(r.state.last_width)
        conf = r.state.last_confidence
        stats.confidences.append(float(conf[0]) if conf is not None and len(conf) else None)
        r.block_size = r.schedule.next(len(new), b)
        r.halted = r.on_tokens is not None and bool(r.on_tokens(new))
        self._finish_if_done(r, now)

    def run(self) -> None:
        """Step until no request is active."""
        while self.active:
            self.step()


def decode_all(decoder: SpeculativeDecoder, prompts: Sequence[torch.Tensor], schedules: Sequence[Schedule | int],
               configs: Sequence[DecodeConfig], arrivals: Sequence[int] | None = None, max_batch: int | None = None,
               policy: BatchPolicy | None = None, arrival_times_s: Sequence[float] | None = None,
               batch: BatchedDecoder | None = None) -> list[BatchRequest]:
    """Decode a workload of requests in batched steps.

    Request i becomes ready at batched step ``arrivals[i]`` (default: all at step 0), or, with ``arrival_times_s``, at
    that many seconds after the start (wall clock; steps wait for the next arrival when nothing is active). Ready
    requests join in order at the next step boundary while fewer than ``max_batch`` are active (None: no limit), each
    after its own prefill.

    Args:
        prompts: [1, n_i] or [n_i] prompt ids; schedules: per request a schedule or a fixed B; configs: per request.
        batch: the ``BatchedDecoder`` to run on (its ``step_log`` and ``rows`` then describe the run); None: a new one
            with ``policy``. A request's load at admission is the active requests, itself and the ready ones waiting.
    Returns:
        the ``BatchRequest`` of each prompt, in the order given (all done).
    Raises:
        ValueError: when the lists' lengths differ or max_batch < 1.
    """
    n = len(prompts)
    if len(schedules) != n or len(configs) != n or (arrivals is not None and len(arrivals) != n):
        raise ValueError(f"need one schedule, config (and arrival) per prompt: {n} prompts, {len(schedules)} schedules, "
                         f"{len(configs)} configs")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    import time

    batch = batch if batch is not None else BatchedDecoder(decoder, policy)
    order = list(range(n))
    if arrival_times_s is not None:
        order.sort(key=lambda i: arrival_times_s[i])
    elif arrivals is not None:
        order.sort(key=lambda i: arrivals[i])
    out: list[BatchRequest | None] = [None] * n
    t0 = time.perf_counter()
    waiting = list(order)
    while waiting or batch.active:
        now_s = time.perf_counter() - t0
        while waiting and (max_batch is None or len(batch.active) < max_batch):
            i = waiting[0]
            if arrival_times_s is not None:
                if arrival_times_s[i] > now_s:
                    if not batch.active:
                        time.sleep(arrival_times_s[i] - now_s)
                        now_s = time.perf_counter() - t0
                        continue
                    break
                arrived = t0 + arrival_times_s[i]
            else:
                if arrivals is not None and arrivals[i] > batch.steps:
                    if not batch.active:  # nothing to step: the clock jumps to the next arrival
                        batch.steps = arrivals[i]
                        continue
                    break
                arrived = t0 if arrivals is None else None  # all at once: queueing counts from the start
            waiting.pop(0)
            if arrival_times_s is not None:
                ready = sum(1 for j in waiting if arrival_times_s[j] <= now_s)
            else:
                ready = sum(1 for j in waiting if arrivals is None or arrivals[j] <= batch.steps)
            load = min(len(batch.active) + 1 + ready, max_batch or n)
            out[i] = batch.add(prompts[i], schedules[i], configs[i], rid=i, arrived_s=arrived, load=load)
        batch.step()
    return out  # type: ignore[return-value]
