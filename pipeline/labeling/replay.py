"""Replay labelling: tau(B) for every candidate B from ONE target decode plus drafter forwards.

The decoder is lossless and T>0 sampling is keyed by position, so the target's continuation
``y`` (positions n, n+1, ...) is the same for every block size B. Hence:

1. ``target_trace`` decodes once autoregressively (B=1, the decoder's own loop) and keeps the drafter's
   context features of every token fed to the target (prompt + ``y[:-1]``).
2. ``replay`` walks the block boundaries of every candidate B exactly as ``SpeculativeDecoder.decode``
   would (first token from prefill; a block ``min(B, max_new_tokens - produced)`` wide; accepted drafts
   + 1 bonus per step; a stop token ends the output), but needs only drafter forwards: a draft token
   is accepted iff it equals ``y`` at its position.

It is cheap because DFlash's context keys/values depend only on the target features and their
positions: ``DrafterContext`` projects them once for all positions, and the K candidates' blocks of
each step are packed into ONE drafter forward (a block-diagonal attention mask keeps them apart; each
block sees the context before its own start).

The LM head is the other cost (a [V, H] product per draft row). With ``lm_head="lazy"`` (CPU default)
a rejection is first proven cheaply: the draft at position p is rejected as soon as some token v of a
shortlist (the target's own top-k scores at p, kept by the trace) scores higher than y_p under the
drafter (argmax picks the first maximum, so a tie with a smaller id also rejects). Columns are walked
in growing chunks (1, 2, 4, ...) and the drafter's last layer runs only for blocks not yet decided;
only the columns before each block's first proven rejection go through the full LM head, where
acceptance is decided exactly as the decoder does (argmax over the whole vocabulary). A drafter with a
(small) draft vocabulary decides each chunk directly with its draft head. ``lm_head="full"`` (GPU
default) runs every row and pushes every draft column through the head in one product.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.decoding.sampling import PositionKeyedSampler, draft_confidence
from pipeline.decoding.requests import DecodeConfig, PrefillResult
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.decoding.trees import TOP_K as TREE_CANDIDATES
from pipeline.labeling.checks import LM_HEAD_MODES
from pipeline.models.clock import now
from pipeline.models.drafter import DFlashDrafter, lm_head_logits



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
    short = [first_scores.topk(k, dim=-1).indices] if k > 0 else None
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
            short.append(scores.topk(k, dim=-1).indices)
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
    short = sampler.scores(logits, list(range(n, n + m))).topk(k, dim=-1).indices if k > 0 else None
    return Trace(list(tokens), torch.cat(features, dim=1), n, tokens[-1] in decoder.stop_ids, decode_ms, sampler, short)


class DrafterContext:
    """Per draft layer, the context keys/values of every position, projected once (``context_keys_values``).

    Args:
        drafter: the DFlash drafter.
        features: [1, P, F] context features of positions 0..P-1.
        fused: the drafter's fast-path products (``FastDraft.products()``: per layer (qkv, gate_up)), or None; the
            packed blocks run on them as the decoder's drafts do.
    Attributes:
        keys, values: per layer [1, kv_heads, P, head_dim]; keys carry RoPE at their positions.
    """

    def __init__(self, drafter: DFlashDrafter, features: torch.Tensor, fused: list[tuple] | None = None):
        self.drafter = drafter
        self.fused = fused
        positions = torch.arange(features.shape[1], device=features.device)[None]
        pairs = drafter.context_keys_values(features, positions)
        self.keys: list[torch.Tensor] = [k for k, _ in pairs]
        self.values: list[torch.Tensor] = [v for _, v in pairs]

    def blocks(self, embed: torch.nn.Module, anchors: list[int], starts: list[int], sizes: list[int]) -> "PackedBlocks":
        """Several blocks in one drafter forward (packed along the sequence); see ``PackedBlocks``."""
        return PackedBlocks(self, embed, anchors, starts, sizes)

    def block_hidden(self, embed: torch.nn.Module, anchors: list[int], starts: list[int], sizes: list[int]) -> torch.Tensor:
        """Final drafter hidden states of every row of several blocks: [sum(sizes), H] (see ``PackedBlocks``)."""
        packed = self.blocks(embed, anchors, starts, sizes)
        return packed.rows(list(range(packed.total)))


class PackedBlocks:
    """The drafter over several blocks at once; its last layer runs only for the rows asked for.

    Block i is ``[anchors[i], mask, ..., mask]`` (``sizes[i]`` tokens) at positions
    ``starts[i] .. starts[i]+sizes[i]-1``; it attends to the context positions ``< starts[i]`` and to its
    own tokens (as each layer's ``visible`` rule allows), as ``DFlashDrafter.forward`` with a cache holding
    that context does. The layers' own steps run (``project``, ``queries``, ``keys``, ``values``, ``attend``,
    ``feed_forward``), on the context's fast-path products when it has them. Every layer but the last runs for
    every row at construction (each row is a key of the next layer), and so do the last layer's q/k/v products;
    its attention, output projection and MLP run in ``rows`` only, so a block whose first draft is rejected costs
    one row there instead of ``sizes[i]``.

    Attributes:
        offsets: packed row of each block's first token; total: sum(sizes).
    """

    def __init__(self, context: DrafterContext, embed: torch.nn.Module, anchors: list[int], starts: list[int],
                 sizes: list[int]):
        drafter = self.drafter = context.drafter
        device = self.device = context.keys[0].device
        sizes_t = torch.tensor(sizes, device=device)
        starts_t = torch.tensor(starts, device=device)
        self.total = int(sum(sizes))
        segment = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes_t)
        offsets = torch.cumsum(sizes_t, 0) - sizes_t
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        within = torch.arange(self.total, device=device) - offsets[segment]
        ids = torch.full((self.total,), drafter.mask_token_id, dtype=torch.long, device=device)
        ids[offsets] = torch.tensor(anchors, dtype=torch.long, device=device)
        positions = (starts_t[segment] + within)[None]
        self.context_len = max(starts)
        context_positions = torch.arange(self.context_len, device=device)
        block_mask = torch.cat([
            context_positions[None, :] < starts_t[segment][:, None],
            segment[:, None] == segment[None, :],
        ], dim=1)  # [total, context_len + total]: True = may attend
        key_positions = torch.cat([context_positions, positions[0]])
        self.masks = []  # per layer [1, 1, total, context_len + total]
        for layer in drafter.layers:
            window = layer.self_attn.visible(positions[0], key_positions)
            self.masks.append((block_mask if window is None else block_mask & window)[None, None])
        hidden = embed(ids)[None]
        self.cos, self.sin = drafter.rotary_emb(hidden, positions)
        fused = context.fused or [(None, None)] * len(drafter.layers)
        layers = list(zip(drafter.layers, context.keys, context.values, fused, self.masks))
        for layer, ctx_k, ctx_v, (qkv, gate_up), mask in layers[:-1]:
            attn = layer.self_attn
            q, keys, values = self._project(attn, layer.input_layernorm(hidden), ctx_k, ctx_v, qkv)
            hidden = layer.feed_forward(hidden + attn.attend(attn.queries(q, self.cos, self.sin), keys, values, mask), gate_up)
        self.last, ctx_k, ctx_v, (qkv, self.gate_up), _ = layers[-1]
        self.hidden = hidden  # [1, total, H]: input of the last layer
        self.q, self.keys, self.values = self._project(self.last.self_attn, self.last.input_layernorm(hidden), ctx_k, ctx_v, qkv)

    def _project(self, attn, normed: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, qkv):
        """Raw queries [1, total, heads*d] of the packed rows, and the [context ; block] keys (with RoPE) and values of
        one layer: each [1, kv_heads, context_len + total, d]."""
        q, k, v = attn.project(normed, None, qkv)
        keys = torch.cat([ctx_k[:, :, : self.context_len], attn.keys(k, self.cos, self.sin)], dim=2)
        return q, keys, torch.cat([ctx_v[:, :, : self.context_len], attn.values(v)], dim=2)

    def rows(self, index: list[int]) -> torch.Tensor:
        """Final hidden states (after the final norm) of the packed rows ``index`` -> [len(index), H]."""
        index_t = torch.tensor(index, dtype=torch.long, device=self.device)
        attn = self.last.self_attn
        q = attn.queries(self.q[:, index_t], self.cos[:, index_t], self.sin[:, index_t])
        out = attn.attend(q, self.keys, self.values, self.masks[-1][:, :, index_t])
        return self.drafter.norm(self.last.feed_forward(self.hidden[:, index_t] + out, self.gate_up))[0]


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


def _shortlist_rejects(h: torch.Tensor, y_index: list[int], trace: Trace, y: torch.Tensor,
                       head: torch.Tensor) -> list[bool]:
    """Whether the drafts of rows ``h`` [R, H] (at y-indices ``y_index``) are proven rejected by the shortlist.

    A draft is rejected when a shortlist token v (the target's best-scoring ids at that position)
    beats ``y`` under the drafter: ``score_v > score_y``, or equal with ``v < y`` (argmax returns the
    first maximum). Costs (1 + k) dot products per row instead of V. Full vocabulary heads only.
    """
    n = trace.prompt_tokens
    index = torch.tensor(y_index, device=y.device)
    ids = torch.cat([y[index][:, None], trace.shortlist[index]], dim=1)  # [R, 1 + k], y first
    scores = torch.bmm(head[ids], h[:, :, None])[..., 0].float()
    if trace.sampler.temperature > 0:
        noise = trace.sampler.noise([i + n for i in y_index], scores.device)
        scores = scores / trace.sampler.temperature + noise.gather(1, ids)
    beats = (scores[:, 1:] > scores[:, :1]) | ((scores[:, 1:] == scores[:, :1]) & (ids[:, 1:] < ids[:, :1]))
    return beats.any(dim=1).tolist()


def _drafts_match(h: torch.Tensor, positions: list[int], trace: Trace, y: torch.Tensor, head: torch.Tensor,
                  draft_vocab: torch.Tensor | None, record_gaps: bool, record_confidence: bool = False,
                  scorer=None, top_k: int = TREE_CANDIDATES) -> tuple[list[bool], list[float], list[tuple]]:
    """Whether the drafter's token (argmax over its whole head, as in the decoder) equals y, per row.

    Args:
        h: [R, H] final drafter hidden states of draft rows at absolute ``positions``.
        head: the decoder's draft head ([V, H], or [N, H] over ``draft_vocab`` [N]).
        scorer: hidden [R, H] -> logits [R, V | N] on the decoder's path (``decoder.drafter_head``, the one its drafts
            are scored with); None: ``lm_head_logits(h, head)``.
        top_k: candidates per row kept with ``record_confidence`` (a draft tree's, ``SpeculativeDecoder.draft_candidates``).
    Returns:
        (matches, top-2 score gaps or [] without ``record_gaps``, per row ``(p, top_p, rank)`` or [] without
        ``record_confidence``: the drafter's probability of its draft (``draft_confidence``), of its ``top_k`` best
        candidates (best first, by the score the pick maximises), and the rank among them of the target's token
        (-1: none of them)).
    """
    logits = (scorer(h) if scorer is not None else lm_head_logits(h, head)).float()
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


def _accept(states: list[_State], packed: PackedBlocks, trace: Trace, y: torch.Tensor, head: torch.Tensor,
            lazy: bool, record_gaps: bool, draft_vocab: torch.Tensor | None = None, record_confidence: bool = False,
            scorer=None, top_k: int = TREE_CANDIDATES) -> None:
    """Set ``state.accepted`` (leading draft tokens equal to y) for every drafting state.

    Draft column j (1..b-1) of the block of ``states[i]`` (packed row ``packed.offsets[i] + j``) proposes
    position ``start + j``; it is accepted iff the drafter's token there, the argmax over its whole head
    (full vocabulary, or ``draft_vocab`` with ``head`` = the decoder's [N, H] draft head), equals
    ``y[start + j - n]`` and every earlier column was accepted.

    Full mode (and ``record_gaps``): every comparable column through the last layer and the head at once.
    Lazy mode: columns in growing chunks (1, 2, 4, ...), only for blocks not yet decided. With a full
    vocabulary head each chunk is screened by the shortlist (proven rejections end a block) and the
    surviving columns go through the full head once at the end; with a (small) draft head each chunk
    is decided exactly right away. ``record_confidence`` keeps ``(column, probability, accepted, top_k candidates'
    probabilities, the target token's rank among them)`` of the columns up to each block's first rejection in
    ``state.step_conf`` (a full-vocabulary head then takes
    the full path: the shortlist proves rejections without the probabilities).
    """
    for s in states:
        s.accepted = 0
        s.step_conf = []
    screen = trace.shortlist is not None and draft_vocab is None
    if not lazy or record_gaps or (record_confidence and screen):
        spans = [(i, 1, s.columns) for i, s in enumerate(states) if s.columns > 0]
        h, positions = _rows(packed, states, spans)
        matches, gaps, confidence = _drafts_match(h, positions, trace, y, head, draft_vocab, record_gaps, record_confidence,
                                                    scorer, top_k)
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
    kept: list[list[torch.Tensor]] = [[] for _ in states]  # screened columns awaiting the full head
    done = [0] * len(states)
    open_states = [i for i, s in enumerate(states) if s.columns > 0]
    chunk = 1
    while open_states:
        spans = [(i, done[i] + 1, min(done[i] + chunk, states[i].columns)) for i in open_states]
        h, positions = _rows(packed, states, spans)
        if screen:
            y_index = [p - trace.prompt_tokens for p in positions]
            passed = [not r for r in _shortlist_rejects(h, y_index, trace, y, head)]
        else:
            passed, _, confidence = _drafts_match(h, positions, trace, y, head, draft_vocab, False, record_confidence,
                                                        scorer, top_k)
        offset, still_open = 0, []
        for i, lo, hi in spans:
            width = hi - lo + 1
            ok = 0
            while ok < width and passed[offset + ok]:
                ok += 1
            if record_confidence:  # not screen: the columns lo..first rejection
                states[i].step_conf += [_sample(lo + c, confidence[offset + c], passed[offset + c])
                                        for c in range(min(ok + 1, width))]
            if screen:
                kept[i].extend(h[offset : offset + ok])
            else:
                states[i].accepted += ok
            done[i] = lo - 1 + ok
            if ok == width and hi < states[i].columns:
                still_open.append(i)
            offset += width
        open_states, chunk = still_open, chunk * 2
    rows = [r for rs in kept for r in rs]
    if rows:
        positions = [s.start + j for s, rs in zip(states, kept) for j in range(1, len(rs) + 1)]
        matches, _, _ = _drafts_match(torch.stack(rows), positions, trace, y, head, draft_vocab, False, False, scorer)
        offset = 0
        for s, rs in zip(states, kept):
            while s.accepted < len(rs) and matches[offset + s.accepted]:
                s.accepted += 1
            offset += len(rs)


def _rows(packed: PackedBlocks, states: list[_State], spans: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
    """Final hidden states of columns lo..hi of each (state index, lo, hi) span, and their absolute positions."""
    index = [packed.offsets[i] + j for i, lo, hi in spans for j in range(lo, hi + 1)]
    positions = [states[i].start + j for i, lo, hi in spans for j in range(lo, hi + 1)]
    return packed.rows(index), positions


@torch.inference_mode()
def replay(decoder: SpeculativeDecoder, trace: Trace, candidates: list[int], config: DecodeConfig,
           lm_head: str = "auto", record_gaps: bool = False, record_confidence: bool = False,
           top_k: int = TREE_CANDIDATES) -> dict[int, ReplayResult]:
    """tau(B) of every candidate B from one trace, all candidates batched per step.

    Args:
        decoder: the decoder that made ``trace`` (its drafter, embeddings, LM head and stop ids are used).
        trace: from ``target_trace`` with the same ``config``.
        candidates: block sizes (1 = autoregressive; each at most the drafter's limit).
        config: the request's ``DecodeConfig`` (max_new_tokens, temperature, seed).
        lm_head: ``lazy`` (fewest LM-head rows: best on CPU), ``full`` (all draft columns in one
            product: best on GPU), ``auto`` (lazy on CPU, full elsewhere).
        record_gaps: keep the drafter's top-2 score gap of every computed draft column.
        record_confidence: keep the verify-width calibration's samples (``ReplayResult.confidence``).
        top_k: with ``record_confidence``, the drafter's candidates kept per sample (a draft tree's top_k).
    Returns:
        {B: ReplayResult}; ``taus`` and ``block_sizes`` equal those of
        ``decoder.decode(prefill, B, config)`` (up to floating-point ties between the top-2 logits).
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
    fused = decoder.fast_draft.products() if decoder.fast_draft is not None else None  # the decoder's draft path
    context = DrafterContext(decoder.drafter, trace.features, fused) if any(s.result.block_size > 1 for s in states) else None
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
            packed = context.blocks(decoder.embed, [trace.tokens[s.start - n] for s in drafting],
                                    [s.start for s in drafting], [s.width for s in drafting])
            _accept(drafting, packed, trace, y, decoder.draft_head, lazy, record_gaps, decoder.draft_vocab,
                    record_confidence, decoder.drafter_head, top_k)
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
