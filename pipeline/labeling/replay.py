"""Replay labelling: tau(B) for every candidate B from ONE target decode plus drafter forwards.

The decoder is lossless and T>0 sampling is keyed by position, so the target's continuation
``y`` (positions n, n+1, ...) is the same for every block size B. Hence:

1. ``target_trace`` decodes once autoregressively (B=1, the decoder's own loop) and keeps the drafter's
   context features of every token fed to the target (prompt + ``y[:-1]``).
2. ``replay`` walks the block boundaries of every candidate B exactly as ``SpeculativeDecoder.decode``
   would (first token from prefill; a block ``min(B, max_new_tokens - produced)`` wide; accepted drafts
   + 1 bonus per step; a stop token ends the output), but needs only drafter forwards: a draft token
   is accepted iff it equals ``y`` at its position.

The drafts are the decoder's own, on every draft precision and forward path: each candidate B keeps a drafter
cache of its own, advanced as its decode would advance it (at each step the features of the positions it has not
seen yet, then the block, then a crop back to the block's start), and the K candidates' blocks of a step run in ONE
call of the decoder's batched draft forward (``decoder.forward.draft_hidden``: each request's rows bit for bit its
forward alone, e.g. one ``DraftStack`` call with the int8 / bf16 / exact products of ``model.draft_precision``), their
drafts scored by the decoder's draft head (``decoder.forward.draft_logits``: ``Int8Head`` / ``Bf16Head`` / ``LMHead``).
Nothing of the draft path is re-implemented here, so the replay cannot drift from it. It is cheap because a step's
drafts of all candidates are one native call, and on the native draft stack (where a context position's keys/values
do not depend on the rows beside it) the prompt's context is projected once and copied to every candidate.

The head is the other cost (a [V, H] product per draft row). With ``lm_head="lazy"`` (CPU default) the draft
columns are walked in growing chunks (1, 2, 4, ...), only for blocks not yet decided, and each chunk is decided by
the head right away: a block's columns after its first rejection never reach it. Where the head is an exact float32
product over the full vocabulary (``_screens``), a rejection is first proven more cheaply: the draft at position p is
rejected as soon as some token v of a shortlist (the target's own top-k scores at p, kept by the trace) provably
scores higher than y_p under that head (beyond a bound on float32 rounding; argmax picks the first maximum, so a tie
with a smaller id also rejects); only the columns before each block's first proven rejection go through the head,
where acceptance is decided exactly as the decoder does. ``lm_head="full"`` (GPU default) pushes every draft column
through the head in one call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from pipeline.decoding.sampling import PositionKeyedSampler, draft_confidence, top_indices
from pipeline.decoding.requests import DecodeConfig, PrefillResult
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.decoding.trees import TOP_K as TREE_CANDIDATES
from pipeline.labeling.checks import LM_HEAD_MODES
from pipeline.models.backend import LMHead
from pipeline.models.cache import crop_to
from pipeline.models.clock import now



def _sample(column: int, confidence: tuple[float, list[float], int], ok) -> tuple[int, float, bool, list[float], int]:
    """One calibration sample: ``(column, p, accepted, top_p, rank)`` (``ReplayResult.confidence``)."""
    p, top_p, rank = confidence
    return column, p, bool(ok), top_p, rank


def top2_gap(scores: torch.Tensor) -> list[float]:
    """Per row, best minus second-best score ([R, V] -> R floats); how close an argmax was to flipping."""
    top = scores.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@dataclass
class Trace:
    """One autoregressive target decode with the drafter's context features.

    Attributes:
        tokens: the continuation y (token ids at positions n, n+1, ...), identical to
            ``decoder.decode(prefill, 1, config).output_ids``; ends at a stop token or after max_new_tokens.
        features: [1, n + len(tokens) - 1, F] context features of the prompt and of every fed token.
        prompt_tokens: n.
        stopped: whether ``tokens`` ends with a stop token.
        decode_ms: wall time of the decode (ms, excluding prefill).
        sampler: the sampler of the request (its Gumbel noise is reused by ``replay``).
        shortlist: [len(tokens), k] the target's k best-scoring token ids at each position of y (the
            rejection shortlist of ``replay``'s lazy LM head), or None.
        gaps: per token of y, the target's top-2 score gap (only with ``record_gaps``).
    """

    tokens: list[int]
    features: torch.Tensor
    prompt_tokens: int
    stopped: bool
    decode_ms: float
    sampler: PositionKeyedSampler
    shortlist: torch.Tensor | None = None
    gaps: list[float] | None = None


@torch.inference_mode()
def target_trace(decoder: SpeculativeDecoder, prefill: PrefillResult, config: DecodeConfig,
                 record_gaps: bool = False, shortlist: int = 32) -> Trace:
    """Decode with B=1 exactly as ``decoder.decode(prefill, 1, config)`` does, keeping features.

    Consumes ``prefill.cache`` (pass a ``copy.deepcopy`` to keep it). ``prefill.first_token`` must be the
    token sampled with ``config``'s temperature and seed.

    Args:
        record_gaps: keep the target's top-2 score gap at every position.
        shortlist: keep the target's ``shortlist`` best-scoring ids per position (0: none).

    Raises:
        ValueError: when the decoder has no drafter or the prefill kept no features.
    """
    if decoder.drafter is None or prefill.features is None:
        raise ValueError("replay needs a drafter and a prefill with features (prefill(want_features=True))")
    sampler = PositionKeyedSampler(config.temperature, config.seed, decoder.lm_head.shape[0])
    n = prefill.input_ids.shape[1]
    tokens = [prefill.first_token]
    features = [prefill.features]
    first_scores = sampler.scores(prefill.last_logits[None], [n])
    gaps = top2_gap(first_scores) if record_gaps else None
    k = min(shortlist, first_scores.shape[-1])
    short = [top_indices(first_scores, k)] if k > 0 else None
    stopped = tokens[0] in decoder.stop_ids
    start = n
    t0 = now(decoder.device)
    while not stopped and len(tokens) < config.max_new_tokens:
        block = torch.tensor([[tokens[-1]]], dtype=torch.long, device=decoder.device)
        logits, new_features = decoder.target_forward(block, prefill.cache, start, want_features=True)
        scores = sampler.scores(logits, [start + 1])
        token = int(scores.argmax(dim=-1)[0])
        if record_gaps:
            gaps += top2_gap(scores)
        if short is not None:
            short.append(top_indices(scores, k))
        tokens.append(token)
        features.append(new_features)
        stopped = token in decoder.stop_ids
        start += 1
    decode_ms = (now(decoder.device) - t0) * 1e3
    shortlist_ids = torch.cat(short) if short is not None else None
    return Trace(tokens, torch.cat(features, dim=1), n, stopped, decode_ms, sampler, shortlist_ids, gaps)


@torch.inference_mode()
def trace_from_output(decoder: SpeculativeDecoder, prefill: PrefillResult, tokens: list[int], config: DecodeConfig,
                      decode_ms: float = 0.0, shortlist: int = 32) -> Trace:
    """The ``Trace`` of an output that was already decoded (e.g. a served request), by ONE teacher-forced target pass.

    ``target_trace`` feeds the target one token at a time; when the continuation is known, one forward
    over ``tokens[:-1]`` at positions n..n+m-2 gives the same context features and target scores (up to
    floating-point ties between batched and one-row products), so ``replay`` can label it.

    Args:
        prefill: the request's prefill, its cache over the n prompt tokens unconsumed (pass a
            ``copy.deepcopy`` of the cache taken before decoding) and its drafter ``features`` kept.
        tokens: the m >= 1 output token ids (positions n..n+m-1), the stop token included when one ended it.
        config: the request's decode settings (temperature and seed key the scores at T>0).
        decode_ms: the decode's wall time, kept in ``Trace.decode_ms``.
        shortlist: the target's best-scoring ids kept per position (0: none).
    Returns:
        a ``Trace`` with ``features`` [1, n + m - 1, F] and ``shortlist`` [m, k].
    Raises:
        ValueError: without a drafter, prefill features or tokens.
    """
    if decoder.drafter is None or prefill.features is None:
        raise ValueError("a trace needs a drafter and a prefill with features (prefill(want_features=True))")
    if not tokens:
        raise ValueError("a trace needs at least one output token")
    sampler = PositionKeyedSampler(config.temperature, config.seed, decoder.lm_head.shape[0])
    n, m = prefill.input_ids.shape[1], len(tokens)
    logits = prefill.last_logits[None]
    features = [prefill.features]
    if m > 1:
        fed = torch.tensor([tokens[:-1]], dtype=torch.long, device=decoder.device)
        rest, new_features = decoder.target_forward(fed, prefill.cache, n, want_features=True)
        logits = torch.cat([logits, rest])
        features.append(new_features)
    k = min(shortlist, logits.shape[-1])
    short = top_indices(sampler.scores(logits, list(range(n, n + m))), k) if k > 0 else None
    return Trace(list(tokens), torch.cat(features, dim=1), n, tokens[-1] in decoder.stop_ids, decode_ms, sampler, short)


@dataclass
class ReplayResult:
    """What ``SpeculativeDecoder.decode`` with a fixed B would record, without running it.

    Attributes:
        block_size: the candidate B.
        taus: acceptance length of each step (tokens); equals ``RequestStats.taus``.
        block_sizes: b of each step (B clipped to the remaining budget); equals ``RequestStats.block_sizes``.
        starts: position of the step's first block token = the target cache length at its verify.
        new_tokens: tokens emitted (equals the trace's length).
        gaps: per step, {draft column: the drafter's top-2 score gap} for the columns computed
            (only with ``record_gaps``).
        confidence: per step, ``(column j, the drafter's probability of its draft there, accepted, the probabilities
            of its top_k candidates there (best first), the rank among them of the target's token or -1)`` for the
            columns 1..first rejection (the draws of ``P(draft j accepted | drafts < j accepted)`` and, per rank, of
            ``P(candidate r is the target's token | drafts < j accepted)``: the verify-width calibration's and the
            draft tree's samples; only with ``record_confidence``).
    """

    block_size: int
    taus: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    new_tokens: int = 0
    gaps: list[dict[int, float]] = field(default_factory=list)
    confidence: list[list[tuple[int, float, bool, list[float], int]]] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean acceptance length over steps (tokens per target verify); 0 without steps."""
        return sum(self.taus) / len(self.taus) if self.taus else 0.0


@dataclass
class _State:
    result: ReplayResult
    start: int
    produced: int
    stopped: bool
    width: int = 0  # b of the current step
    columns: int = 0  # draft columns comparable with y this step
    accepted: int = 0
    step_gaps: dict = field(default_factory=dict)
    step_conf: list = field(default_factory=list)
    cache: object = None  # this candidate's drafter cache (the decoder's kind), None before its first draft
    cached: int = 0  # positions whose context keys/values the cache holds (0..cached-1)


def _shares_context(decoder: SpeculativeDecoder) -> bool:
    """Whether one projection of the prompt's context may serve every candidate: the decoder drafts on the native
    ``DraftStack``, where a context position's keys/values are a fixed computation of its own features and position,
    whatever the rows of the call (elsewhere a product over many rows may round differently with their number, so
    every candidate projects its context exactly as its own decode does)."""
    return decoder.native_draft is not None and decoder.native_draft.native_stack() is not None


def _draft(decoder: SpeculativeDecoder, trace: Trace, states: list[_State]) -> list[torch.Tensor]:
    """The decoder's drafts of one step of every state in ``states``: ONE ``decoder.forward.draft_hidden`` call over
    their blocks (request i: the pending token y at ``start`` then ``width - 1`` mask tokens, with the trace's features
    of the positions its cache has not seen yet, over its own drafter cache), each block's states bit for bit those
    of the decoder's draft at that step (the same call it makes, on its draft precision and forward path); each cache
    is then cropped back to ``start``, as the decoder's is.

    Returns:
        per state the drafter's final states [width, H] (row j proposes position start + j).
    """
    n = trace.prompt_tokens
    fresh = [s for s in states if s.cache is None]
    if len(fresh) > 1 and _shares_context(decoder):  # the prompt's context once, copied to every candidate
        start = min(s.start for s in fresh)
        shared = decoder.new_draft_cache()
        block = torch.full((1, 1), trace.tokens[start - n], dtype=torch.long, device=decoder.device)
        decoder.forward.draft_hidden([block], [trace.features[:, :start]], [start], [shared])
        crop_to(shared, start)
        for k, s in enumerate(fresh):
            s.cache, s.cached = (shared if k == len(fresh) - 1 else copy.deepcopy(shared)), start
    for s in fresh:
        if s.cache is None:
            s.cache, s.cached = decoder.new_draft_cache(), 0
    blocks = []
    for s in states:
        block = torch.full((1, s.width), decoder.drafter.mask_token_id, dtype=torch.long, device=decoder.device)
        block[0, 0] = trace.tokens[s.start - n]
        blocks.append(block)
    hidden = decoder.forward.draft_hidden(blocks, [trace.features[:, s.cached: s.start] for s in states],
                                          [s.start for s in states], [s.cache for s in states])
    for s in states:
        crop_to(s.cache, s.start)
        s.cached = s.start
    return [h[0] for h in hidden]


def _screens(decoder: SpeculativeDecoder) -> bool:
    """Whether the shortlist may prove rejections (``_shortlist_rejects``): the decoder's draft head is the float32
    product of its full-vocabulary rows (``LMHead`` on float32 weights: ``draft_precision=exact``), whose scores the
    screen's own float32 products bound. A bf16 / int8 head (or any other) rounds its inputs: every draft is then
    decided by that head itself."""
    return (decoder.draft_vocab is None and isinstance(decoder.drafter_head, LMHead)
            and decoder.draft_head.dtype == torch.float32)


def _shortlist_rejects(h: torch.Tensor, y_index: list[int], trace: Trace, y: torch.Tensor,
                       head: torch.Tensor) -> list[bool]:
    """Whether the drafts of rows ``h`` [R, H] (at y-indices ``y_index``) are proven rejected by the shortlist.

    A draft is rejected when a shortlist token v (the target's best-scoring ids at that position) beats ``y`` under
    the decoder's draft head: ``score_v > score_y``, or equal with ``v < y`` (argmax returns the first maximum).
    Costs (1 + k) dot products per row instead of V. The head (``_screens``: float32 rows ``head`` [V, H]) sums the
    products in its own order, so its score and this one each lie within (H + 2) u sum_k |w_k h_k| of the exact dot
    product (u = 2^-24, any summation order, fused or not); a rejection is proven only beyond twice that on both
    sides (then the head's own scores order v before y for certain), and a near tie is left to the head.
    """
    n = trace.prompt_tokens
    index = torch.tensor(y_index, device=y.device)
    ids = torch.cat([y[index][:, None], trace.shortlist[index]], dim=1)  # [R, 1 + k], y first
    w, x = head[ids].float(), h.float()[:, :, None]
    scores = torch.bmm(w, x)[..., 0]
    slack = torch.bmm(w.abs(), x.abs())[..., 0] * (4 * (h.shape[-1] + 2) * 2.0 ** -24)
    low, high = scores - slack, scores + slack  # the head's score of each token lies within
    if trace.sampler.temperature > 0:  # x / T + noise is monotone in x: the bounds carry over
        noise = trace.sampler.noise([i + n for i in y_index], scores.device).gather(1, ids)
        low, high = low / trace.sampler.temperature + noise, high / trace.sampler.temperature + noise
    low_v, high_y = low[:, 1:], high[:, :1]
    beats = (low_v > high_y) | ((low_v == high_y) & (ids[:, 1:] < ids[:, :1]))
    return beats.any(dim=1).tolist()


def _drafts_match(logits: torch.Tensor, positions: list[int], trace: Trace, y: torch.Tensor,
                  draft_vocab: torch.Tensor | None, record_gaps: bool, record_confidence: bool = False,
                  top_k: int = TREE_CANDIDATES) -> tuple[list[bool], list[float], list[tuple]]:
    """Whether the drafter's token (the pick over its whole head, as in the decoder) equals y, per row.

    Args:
        logits: [R, V | N] the decoder's draft-head logits (``decoder.forward.draft_logits``) of draft rows at absolute
            ``positions``; over ``draft_vocab`` [N] when the drafter has a draft vocabulary.
        top_k: candidates per row kept with ``record_confidence`` (a draft tree's, ``SpeculativeDecoder.draft_candidates``).
    Returns:
        (matches, top-2 score gaps or [] without ``record_gaps``, per row ``(p, top_p, rank)`` or [] without
        ``record_confidence``: the drafter's probability of its draft (``draft_confidence``), of its ``top_k`` best
        candidates (best first, by the score the pick maximises), and the rank among them of the target's token
        (-1: none of them)).
    """
    scores = trace.sampler.scores(logits, positions, draft_vocab)
    columns = scores.argmax(dim=-1)
    proposed = draft_vocab[columns] if draft_vocab is not None else columns
    targets = y[torch.tensor(positions, device=y.device) - trace.prompt_tokens]
    confidence = []
    if record_confidence:
        top = scores.topk(max(1, min(int(top_k), scores.shape[-1])), dim=-1).indices  # as sampler.top_columns
        probs = draft_confidence(logits, torch.cat([columns[:, None], top], dim=1), trace.sampler.temperature)
        hit = (draft_vocab[top] if draft_vocab is not None else top) == targets[:, None]
        rank = torch.where(hit.any(dim=1), hit.long().argmax(dim=1), torch.full_like(hit[:, 0], -1, dtype=torch.long))
        confidence = list(zip(probs[:, 0].tolist(), probs[:, 1:].tolist(), rank.tolist()))
    return (proposed == targets).tolist(), (top2_gap(scores) if record_gaps else []), confidence


def _spans(hidden: list[torch.Tensor], states: list[_State], spans: list[tuple[int, int, int]]
           ) -> tuple[list[torch.Tensor], list[int]]:
    """The final drafter states of columns lo..hi of each (state index, lo, hi) span (one tensor per span), and their
    absolute positions."""
    parts = [hidden[i][lo: hi + 1] for i, lo, hi in spans]
    positions = [states[i].start + j for i, lo, hi in spans for j in range(lo, hi + 1)]
    return parts, positions


def _head(decoder: SpeculativeDecoder, parts: list[torch.Tensor]) -> torch.Tensor:
    """The decoder's draft-head logits of every span's rows, joined: [sum of rows, V | N] float32. Each span is one
    segment of ``decoder.forward.draft_logits``, whose rows are each the bits of the decoder's own head call."""
    return torch.cat(decoder.forward.draft_logits(parts))


def _accept(states: list[_State], hidden: list[torch.Tensor], decoder: SpeculativeDecoder, trace: Trace,
            y: torch.Tensor, lazy: bool, record_gaps: bool, record_confidence: bool = False,
            top_k: int = TREE_CANDIDATES) -> None:
    """Set ``state.accepted`` (leading draft tokens equal to y) for every drafting state.

    Draft column j (1..b-1) of the block of ``states[i]`` (row j of ``hidden[i]``, the decoder's draft states)
    proposes position ``start + j``; it is accepted iff the decoder's draft there, the pick over its draft head's
    logits (``decoder.drafter_head``, through ``decoder.forward.draft_logits``: full vocabulary, or
    ``decoder.draft_vocab``), equals ``y[start + j - n]`` and every earlier column was accepted.

    Full mode (and ``record_gaps``): every comparable column through the head at once. Lazy mode: columns in growing
    chunks (1, 2, 4, ...), only for blocks not yet decided, each chunk decided by the head right away; where the head
    is an exact float32 product over the full vocabulary (``_screens``), each chunk is screened by the shortlist
    instead (proven rejections end a block) and the surviving columns go through the head once at the end.
    ``record_confidence`` keeps ``(column, probability, accepted, top_k candidates' probabilities, the target token's
    rank among them)`` of the columns up to each block's first rejection in ``state.step_conf`` (a screening head then
    takes the full path: the shortlist proves rejections without the probabilities).
    """
    for s in states:
        s.accepted = 0
        s.step_conf = []
    vocab = decoder.draft_vocab
    screen = trace.shortlist is not None and _screens(decoder)
    if not lazy or record_gaps or (record_confidence and screen):
        spans = [(i, 1, s.columns) for i, s in enumerate(states) if s.columns > 0]
        if not spans:
            return
        parts, positions = _spans(hidden, states, spans)
        matches, gaps, confidence = _drafts_match(_head(decoder, parts), positions, trace, y, vocab, record_gaps,
                                                  record_confidence, top_k)
        offset = 0
        for i, lo, hi in spans:
            for j in range(hi):
                if record_gaps:
                    states[i].step_gaps[j + 1] = gaps[offset + j]
                if record_confidence:
                    states[i].step_conf.append(_sample(j + 1, confidence[offset + j], matches[offset + j]))
                if not matches[offset + j]:
                    break
                states[i].accepted += 1
            offset += hi
        return
    done = [0] * len(states)  # columns 1..done[i] passed (screen: not proven rejected; else accepted)
    open_states = [i for i, s in enumerate(states) if s.columns > 0]
    chunk = 1
    while open_states:
        spans = [(i, done[i] + 1, min(done[i] + chunk, states[i].columns)) for i in open_states]
        parts, positions = _spans(hidden, states, spans)
        if screen:
            y_index = [p - trace.prompt_tokens for p in positions]
            passed = [not r for r in _shortlist_rejects(torch.cat(parts), y_index, trace, y, decoder.draft_head)]
        else:
            passed, _, confidence = _drafts_match(_head(decoder, parts), positions, trace, y, vocab, False,
                                                  record_confidence, top_k)
        offset, still_open = 0, []
        for i, lo, hi in spans:
            width = hi - lo + 1
            ok = 0
            while ok < width and passed[offset + ok]:
                ok += 1
            if record_confidence:  # not screen: the columns lo..first rejection
                states[i].step_conf += [_sample(lo + c, confidence[offset + c], passed[offset + c])
                                        for c in range(min(ok + 1, width))]
            if not screen:
                states[i].accepted += ok
            done[i] = lo - 1 + ok
            if ok == width and hi < states[i].columns:
                still_open.append(i)
            offset += width
        open_states, chunk = still_open, chunk * 2
    if screen:  # the columns no shortlist token beat: decided by the head
        spans = [(i, 1, done[i]) for i in range(len(states)) if done[i] > 0]
        if spans:
            parts, positions = _spans(hidden, states, spans)
            matches, _, _ = _drafts_match(_head(decoder, parts), positions, trace, y, vocab, False)
            offset = 0
            for i, lo, hi in spans:
                s = states[i]
                while s.accepted < hi and matches[offset + s.accepted]:
                    s.accepted += 1
                offset += hi


@torch.inference_mode()
def replay(decoder: SpeculativeDecoder, trace: Trace, candidates: list[int], config: DecodeConfig,
           lm_head: str = "auto", record_gaps: bool = False, record_confidence: bool = False,
           top_k: int = TREE_CANDIDATES) -> dict[int, ReplayResult]:
    """tau(B) of every candidate B from one trace, all candidates' drafts of a step in one draft forward.

    Args:
        decoder: the decoder that made ``trace`` (its draft forward and head, embeddings and stop ids are used).
        trace: from ``target_trace`` with the same ``config``.
        candidates: block sizes (1 = autoregressive; each at most the drafter's limit).
        config: the request's ``DecodeConfig`` (max_new_tokens, temperature, seed).
        lm_head: ``lazy`` (fewest draft-head rows: best on CPU), ``full`` (all draft columns in one
            product: best on GPU), ``auto`` (lazy on CPU, full elsewhere).
        record_gaps: keep the drafter's top-2 score gap of every computed draft column.
        record_confidence: keep the verify-width calibration's samples (``ReplayResult.confidence``).
        top_k: with ``record_confidence``, the drafter's candidates kept per sample (a draft tree's top_k).
    Returns:
        {B: ReplayResult}; ``taus`` and ``block_sizes`` equal those of ``decoder.decode(prefill, B, config)``: the
        drafts are the decoder's own (its draft forward and head, on its draft precision), and the trace's features
        are its verifies' where its target forward is batch-invariant (``forward_path()["batch_invariant"]``; elsewhere
        up to floating-point ties between one-token and block forwards).
    Raises:
        ValueError: for an unknown ``lm_head`` mode or an invalid candidate.
    """
    if lm_head not in LM_HEAD_MODES:
        raise ValueError(f"lm_head must be one of {LM_HEAD_MODES}, got {lm_head!r}")
    lazy = lm_head == "lazy" or (lm_head == "auto" and decoder.device.type == "cpu")
    for b in candidates:
        decoder.check_block_size(int(b))
    n, m = trace.prompt_tokens, len(trace.tokens)
    y = torch.tensor(trace.tokens, dtype=torch.long, device=decoder.device)
    first_stopped = trace.tokens[0] in decoder.stop_ids
    states = [_State(ReplayResult(int(b)), n, 1, first_stopped) for b in sorted(set(int(c) for c in candidates))]
    while True:
        active = [s for s in states if not s.stopped and s.produced < config.max_new_tokens]
        if not active:
            break
        for s in active:
            s.width = min(s.result.block_size, config.max_new_tokens - s.produced)
            s.columns = min(s.width - 1, m - 1 - (s.start - n))
            s.accepted, s.step_gaps, s.step_conf = 0, {}, []
        drafting = [s for s in active if s.width > 1]
        if drafting:
            hidden = _draft(decoder, trace, drafting)
            _accept(drafting, hidden, decoder, trace, y, lazy, record_gaps, record_confidence, top_k)
        for s in active:
            index = s.start - n  # index in y of the step's first block token
            tau = s.accepted + 1
            if trace.stopped and index + tau >= m - 1:  # the stop token y[m-1] is emitted this step
                tau, s.stopped = m - 1 - index, True
            s.result.taus.append(tau)
            s.result.block_sizes.append(s.width)
            s.result.starts.append(s.start)
            if record_gaps:
                s.result.gaps.append(s.step_gaps)
            if record_confidence:
                s.result.confidence.append(s.step_conf)
            s.produced += tau
            s.start += s.accepted + 1
    for s in states:
        s.result.new_tokens = s.produced
    return {s.result.block_size: s.result for s in states}


def first_divergence(brute_taus: list[int], result: ReplayResult, trace: Trace) -> dict | None:
    """Where a brute-force decode and a replay of the same B part ways (None when they agree).

    Returns:
        {step, brute_tau, replay_tau, position (absolute position of the draft token judged
        differently), target_gap (the target's top-2 score gap there), draft_gap (the replay drafter's
        top-2 score gap there)} — gaps need ``record_gaps`` in both ``target_trace`` and ``replay``.
    """
    for k, (tb, tr) in enumerate(zip(brute_taus, result.taus)):
        if tb != tr:
            column = min(tb, tr)
            position = result.starts[k] + column
            index = position - trace.prompt_tokens
            return {
                "step": k, "brute_tau": tb, "replay_tau": tr, "position": position,
                "target_gap": trace.gaps[index] if trace.gaps and index < len(trace.gaps) else None,
                "draft_gap": result.gaps[k].get(column) if k < len(result.gaps) else None,
            }
    if len(brute_taus) != len(result.taus):
        return {"step": min(len(brute_taus), len(result.taus)), "brute_tau": None, "replay_tau": None,
                "position": None, "target_gap": None, "draft_gap": None}
    return None
