"""One request's life, the same in every decoder: its data (settings, prefill, state between steps, outcome) and its
lifecycle (``Request``: ``begin`` after its prefill, ``record`` after each step, ``finish`` / ``cancel``).

``SpeculativeDecoder.decode`` (one request) and ``pipeline.decoding.batched.BatchedDecoder`` (many requests, one step)
both start, record and finish their requests here, so a request decoded alone and one decoded in a batch keep the same
books: output ids cut at the first stop token, per-step tau, B, k and first-draft confidence, the token times, the
``on_tokens`` hand-off (streaming, stop strings, a client that went away) and when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import DynamicCache

from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.schedules import FixedSchedule, Schedule
from pipeline.decoding.trees import DraftTree
from pipeline.models.clock import now


@dataclass
class DecodeConfig:
    """Decoding settings of one request.

    Attributes:
        max_new_tokens: cap on generated tokens (the bonus token of the prefill included).
        temperature: 0 = greedy; > 0 = position-keyed Gumbel-max sampling.
        seed: sampling seed (ignored at T=0).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0


@dataclass
class PrefillResult:
    """What one prefill leaves behind: caches, the first new token, the last-token logits.

    Attributes:
        input_ids: [1, n] prompt ids.
        cache: the target's ``DynamicCache`` over the n prompt tokens.
        last_logits: [V] target logits at the last prompt token (float32) — the policy's input.
        features: [1, n, n_taps*H] context features for the drafter, or None without drafter.
        first_token: the token sampled from ``last_logits`` (position n).
        prefill_ms: wall time of the target forward and the first sample (ms).
        cached_tokens: prompt tokens whose keys and values (and features) came from the decoder's prefix cache instead
            of a forward (``pipeline.decoding.prefix_cache``; 0: prefilled whole).
    """

    input_ids: torch.Tensor
    cache: DynamicCache
    last_logits: torch.Tensor
    features: torch.Tensor | None
    first_token: int
    prefill_ms: float
    cached_tokens: int = 0


@dataclass
class RequestStats:
    """Per-request outcome.

    Attributes:
        output_ids: generated token ids (the stop token included when one ended the output).
        taus: acceptance length of each draft-verify step (accepted drafts + 1 bonus, tokens).
        block_sizes: B used at each step.
        verify_widths: drafts verified at each step (k; B-1 unless a verify-width policy chose fewer).
        confidences: the drafter's probability of its first draft at each step (None for a step without one).
        prefill_ms: prefill time (ms); decode_ms: time of all steps after prefill (ms);
        schedule_ms: time spent choosing B after prefill (the policy's overhead, ms).
        first_block_size: the B the schedule's ``first`` picked (None before it ran).
        trees: each tree step's (tree verified, its accepted nodes) (a tree policy's decode; ``pipeline.decoding.trees``).
        cached_tokens: prompt tokens its prefill took from the prefix cache (``PrefillResult.cached_tokens``).
        sources: {draft source: [its drafts verified, its drafts accepted]} over the steps (a chain's drafts and a
            drafter-only tree are the drafter's; ``DraftTree.source_counts``).
    """

    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    taus: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    verify_widths: list[int] = field(default_factory=list)
    confidences: list[float | None] = field(default_factory=list)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    schedule_ms: float = 0.0
    stopped: bool = False
    first_block_size: int | None = None
    trees: list[tuple[DraftTree, list[int]]] = field(default_factory=list)
    cached_tokens: int = 0
    sources: dict[str, list[int]] = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tau(self) -> float:
        """Mean acceptance length over steps (tokens per target verify)."""
        return sum(self.taus) / len(self.taus) if self.taus else 0.0

    @property
    def tpot_ms(self) -> float:
        """Decode time per output token after the first (ms)."""
        return self.decode_ms / max(1, self.new_tokens - 1)

    def as_row(self) -> dict:
        """A JSON-ready summary row."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "tau": self.tau,
            "steps": len(self.taus),
            "block_sizes": sorted(set(self.block_sizes)),
            "prefill_ms": self.prefill_ms,
            "decode_ms": self.decode_ms,
            "schedule_ms": self.schedule_ms,
            "tpot_ms": self.tpot_ms,
            "stopped": self.stopped,
        }


@dataclass
class DecodeState:
    """Where a request stands between two draft-verify steps.

    Attributes:
        cache: the target's cache over positions 0..start-1.
        draft_cache: the drafter's cache of projected context keys/values (None without drafter).
        features: [1, c, n_taps*H] target features of the last c accepted positions, not yet in
            ``draft_cache`` (None without drafter); with ``feature_parts``, later ones not yet joined
            (``pending_features``).
        pending: the last sampled token, at position ``start``, not yet fed to the target.
        start: position of ``pending`` (tokens before it are in ``cache``).
        last_width: drafts verified by the last step (k).
        last_confidence: [b-1] the drafter's probability of each draft of the last step (None when it drafted nothing).
        last_tree / last_path: the last tree step's tree and its accepted nodes (None after a chain step).
    """

    cache: DynamicCache
    draft_cache: DynamicCache | None
    features: torch.Tensor | None
    pending: int
    start: int
    last_width: int = 0
    last_confidence: torch.Tensor | None = None
    last_tree: DraftTree | None = None
    last_path: list[int] | None = None
    feature_parts: list = field(default_factory=list)

    def add_features(self, part: torch.Tensor) -> None:
        """Keep the features [1, r, n_taps*H] of r more accepted positions (joined once, when the drafter next runs:
        a request that skips the drafter for many steps does not copy its growing features every step)."""
        self.feature_parts.append(part)

    def pending_features(self) -> torch.Tensor:
        """``features`` with every part kept since (one concatenation), stored back."""
        if self.feature_parts:
            self.features = torch.cat([self.features, *self.feature_parts], dim=1)
            self.feature_parts = []
        return self.features


def cut_at_stop(new: list[int], stop_ids) -> tuple[list[int], bool]:
    """``new`` up to and including its first stop token, and whether it had one."""
    for i, token in enumerate(new):
        if token in stop_ids:
            return new[: i + 1], True
    return new, False


def as_schedule(decoder, schedule: Schedule | int) -> Schedule:
    """``schedule``, or a fixed B for an int (checked against ``decoder``'s drafter: ``ValueError`` when out of range)."""
    if isinstance(schedule, int):
        decoder.check_block_size(schedule)
        return FixedSchedule(schedule)
    return schedule


@dataclass
class Request:
    """One request being decoded, alone or in a batch (``begin`` makes one).

    Attributes:
        rid: the caller's id of the request.
        config: its decoding settings; schedule: its block-size schedule (B per step; ``choose_width`` when it has one).
        state: its ``DecodeState`` (caches, pending token, position); sampler: its position-keyed sampler.
        stats: its ``RequestStats`` (output ids, per-step tau, B, k, confidences, times).
        block_size: the B its schedule chose for the next step.
        stop_ids: the decoder's stop tokens.
        on_tokens: called with each step's new tokens (the prefill's first token first); a true return ends it.
        done: finished (stop token, max_new_tokens or halted); halted: ended by ``on_tokens`` or ``cancel``.
        arrived_s / first_token_s / finished_s: clock times (s) of its arrival, its first token, its end.
        token_times: clock time (s) at which each output token was emitted.
        prompt_ids: its prompt's token ids (the draft sources that read the request's own tokens).
        prefixes: the decoder's prefix cache where a hit gives a full prefill's bits (``decoder.prefix_cache`` and
            ``prefill_invariant``), or None: when the request ends, its prompt and output's full blocks are stored
            there (no drafter features), so a chat's next turn, which repeats them, prefills only what is new.
    """

    rid: Any
    config: DecodeConfig
    schedule: Schedule
    state: DecodeState
    sampler: PositionKeyedSampler
    stats: RequestStats
    block_size: int
    stop_ids: frozenset = frozenset()
    on_tokens: Callable[[list[int]], bool | None] | None = None
    done: bool = False
    halted: bool = False
    arrived_s: float = 0.0
    first_token_s: float = 0.0
    finished_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    prefixes: Any = None

    @classmethod
    def begin(cls, decoder, prefill: PrefillResult, schedule: Schedule | int, config: DecodeConfig, rid: Any = None,
              on_tokens: Callable[[list[int]], bool | None] | None = None, arrived_s: float | None = None) -> "Request":
        """Start a request after its prefill: its sampler, stats, the schedule's first B (timed as ``schedule_ms``), its
        state and its first token (recorded and handed to ``on_tokens``).

        Args:
            decoder: the ``SpeculativeDecoder`` that decodes it (its checks, stop tokens, vocabulary and clock).
            prefill: the request's prefill (with drafter features when its schedule drafts).
            arrived_s: its arrival time on the decoder's clock (None: now).
        Returns:
            the ``Request``, already ``done`` when its first token is a stop token, max_new_tokens is 1 or
            ``on_tokens`` ended it.
        Raises:
            ValueError: for a block size the decoder cannot run, a prompt that leaves no room for max_new_tokens, or a
                drafting schedule over a prefill without drafter features.
        """
        schedule = as_schedule(decoder, schedule)
        decoder.check_block_size(schedule.max_block_size)
        decoder.check_prompt(prefill.input_ids, config.max_new_tokens)
        use_drafter = schedule.max_block_size > 1
        if use_drafter and prefill.features is None:
            raise ValueError("prefill ran without drafter features; call prefill(want_features=True)")
        arrived = now(decoder.device) if arrived_s is None else arrived_s
        sampler = PositionKeyedSampler(config.temperature, config.seed, decoder.lm_head.shape[0])
        stats = RequestStats(prompt_tokens=prefill.input_ids.shape[1], prefill_ms=prefill.prefill_ms,
                             cached_tokens=prefill.cached_tokens)
        t0 = now(decoder.device)
        block_size = stats.first_block_size = int(schedule.first(prefill.last_logits))
        stats.schedule_ms = (now(decoder.device) - t0) * 1e3
        state = decoder.new_state(prefill, use_drafter)
        prefixes = getattr(decoder, "prefix_cache", None)
        req = cls(rid, config, schedule, state, sampler, stats, block_size, frozenset(decoder.stop_ids), on_tokens,
                  arrived_s=arrived, prompt_ids=prefill.input_ids[0].tolist(),
                  prefixes=prefixes if prefixes is not None and decoder.prefill_invariant else None)
        t = now(decoder.device)
        req.first_token_s = t
        stats.output_ids.append(state.pending)
        req.token_times.append(t)
        stats.stopped = state.pending in req.stop_ids
        req.halted = on_tokens is not None and bool(on_tokens([state.pending]))
        req.finish_if_done(t)
        return req

    @property
    def remaining(self) -> int:
        """Tokens left in its budget (``max_new_tokens`` minus the output so far)."""
        return self.config.max_new_tokens - self.stats.new_tokens

    def next_block(self) -> int:
        """The next step's B: the schedule's, capped by the tokens left in the budget."""
        return min(self.block_size, self.remaining)

    def record(self, new: list[int], block_size: int, t: float) -> list[int]:
        """One step's outcome: ``new`` (accepted drafts + bonus) cut at a stop token, the step's tau, B, k and first-draft
        confidence (from ``state``), the schedule's next B, the ``on_tokens`` hand-off, and whether it is done (at clock
        time ``t``). Returns the tokens kept."""
        stats, state = self.stats, self.state
        new, stats.stopped = cut_at_stop(new, self.stop_ids)
        stats.output_ids.extend(new)
        self.token_times.extend([t] * len(new))
        stats.taus.append(len(new))
        stats.block_sizes.append(block_size)
        stats.verify_widths.append(state.last_width)
        conf = state.last_confidence
        stats.confidences.append(float(conf.reshape(-1)[0]) if conf is not None and conf.numel() else None)
        if state.last_tree is not None:
            stats.trees.append((state.last_tree, state.last_path))
            counts = state.last_tree.source_counts(state.last_path)
        else:
            counts = {"drafter": [state.last_width, max(0, min(state.last_width, len(new) - 1))]} if state.last_width else {}
        for source, (verified, accepted) in counts.items():
            row = stats.sources.setdefault(source, [0, 0])
            row[0] += verified
            row[1] += accepted
        self.block_size = self.schedule.next(len(new), block_size)
        self.halted = self.on_tokens is not None and bool(self.on_tokens(new))
        self.finish_if_done(t)
        return new

    def finish_if_done(self, t: float) -> bool:
        """Mark it done at clock time ``t`` when it stopped, ran out of budget or was halted; returns ``done``."""
        if not self.done and (self.halted or self.stats.stopped or self.remaining <= 0):
            self.done = True
            self.finished_s = t
            self.stats.decode_ms = (t - self.first_token_s) * 1e3
            # no hand-off after the end; the hook's owner (a scheduler Entry) holds this request: no cycle to keep its
            # caches alive until a full garbage collection (a server's memory grew by every batch's KV caches)
            self.on_tokens = None
            if self.prefixes is not None:  # positions 0..start-1 hold the prompt and the output but its last token
                done = self.stats.output_ids[: max(0, self.state.start - len(self.prompt_ids))]
                self.prefixes.store(self.prompt_ids + done, self.state.cache)
                self.prefixes = None
        return self.done

    def cancel(self, t: float) -> None:
        """End it now (a client that went away), at clock time ``t``."""
        if not self.done:
            self.halted = True
            self.finish_if_done(t)
