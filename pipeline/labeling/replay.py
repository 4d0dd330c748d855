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
drafter (argmax picks the first maximum, so a tie with a smaller id also rejects). Only the columns
before each block's first proven rejection go through the full LM head, where acceptance is decided
exactly as the decoder does (argmax over the whole vocabulary). ``lm_head="full"`` (GPU default) pushes
every draft column through the LM head in one product.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.speculative import DecodeConfig, PrefillResult, SpeculativeDecoder, _now
from pipeline.models.drafter import DFlashDrafter, lm_head_logits

LM_HEAD_MODES = ("auto", "lazy", "full")


def pick_scores(sampler: PositionKeyedSampler, logits: torch.Tensor, positions: list[int],
                vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The scores whose argmax ``sampler.pick`` takes: logits at T=0, ``logits/T + Gumbel(position)`` at T>0.

    Args:
        logits: [R, V'] float32; row r scores the token at absolute position ``positions[r]``.
        vocab_ids: [V'] target ids of the columns when they cover a draft vocabulary (None: V' = V).
    Returns:
        [R, V'] float32 (same device).
    """
    if sampler.temperature == 0:
        return logits
    noise = torch.stack([sampler.gumbel(p) for p in positions]).to(logits.device)
    if vocab_ids is not None:
        noise = noise[:, vocab_ids]
    return logits.float() / sampler.temperature + noise


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
    first_scores = pick_scores(sampler, prefill.last_logits[None], [n])
    gaps = top2_gap(first_scores) if record_gaps else None
    k = min(shortlist, first_scores.shape[-1])
    short = [first_scores.topk(k, dim=-1).indices] if k > 0 else None
    stopped = tokens[0] in decoder.stop_ids
    start = n
    t0 = _now(decoder.device)
    while not stopped and len(tokens) < config.max_new_tokens:
        block = torch.tensor([[tokens[-1]]], dtype=torch.long, device=decoder.device)
        logits, new_features = decoder._target_forward(block, prefill.cache, start, want_features=True)
        scores = pick_scores(sampler, logits, [start + 1])
        token = int(scores.argmax(dim=-1)[0])
        if record_gaps:
            gaps += top2_gap(scores)
        if short is not None:
            short.append(scores.topk(k, dim=-1).indices)
        tokens.append(token)
        features.append(new_features)
        stopped = token in decoder.stop_ids
        start += 1
    decode_ms = (_now(decoder.device) - t0) * 1e3
    shortlist_ids = torch.cat(short) if short is not None else None
    return Trace(tokens, torch.cat(features, dim=1), n, stopped, decode_ms, sampler, shortlist_ids, gaps)


class DrafterContext:
    """Per draft layer, the context keys/values of every position, projected once.

    Args:
        drafter: the DFlash drafter.
        features: [1, P, F] context features of positions 0..P-1.
    Attributes:
        keys, values: per layer [1, kv_heads, P, head_dim]; keys carry RoPE at their positions.
    """

    def __init__(self, drafter: DFlashDrafter, features: torch.Tensor):
        self.drafter = drafter
        length = features.shape[1]
        context = drafter.hidden_norm(drafter.fc(features))
        positions = torch.arange(length, device=features.device)[None]
        cos, sin = drafter.rotary_emb(context, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer in drafter.layers:
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(context).view(1, length, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(context).view(1, length, -1, attn.head_dim).transpose(1, 2)
            self.keys.append(k * cos + rotate_half(k) * sin)
            self.values.append(v)

    def block_hidden(self, embed: torch.nn.Module, anchors: list[int], starts: list[int], sizes: list[int]) -> torch.Tensor:
        """Drafter hidden states of several blocks in one forward (blocks packed along the sequence).

        Block i is ``[anchors[i], mask, ..., mask]`` (``sizes[i]`` tokens) at positions
        ``starts[i] .. starts[i]+sizes[i]-1``; it attends to the context positions ``< starts[i]`` and to
        its own tokens (non-causally), as in ``DFlashDrafter.forward`` with a cache holding that context.

        Returns:
            [sum(sizes), H] after the final norm; rows of block i follow those of block i-1.
        """
        drafter = self.drafter
        device = self.keys[0].device if self.keys else embed.weight.device
        sizes_t = torch.tensor(sizes, device=device)
        starts_t = torch.tensor(starts, device=device)
        total = int(sizes_t.sum())
        segment = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes_t)
        offsets = torch.cumsum(sizes_t, 0) - sizes_t
        within = torch.arange(total, device=device) - offsets[segment]
        ids = torch.full((total,), drafter.mask_token_id, dtype=torch.long, device=device)
        ids[offsets] = torch.tensor(anchors, dtype=torch.long, device=device)
        positions = (starts_t[segment] + within)[None]
        context_len = max(starts)
        mask = torch.cat([
            torch.arange(context_len, device=device)[None, :] < starts_t[segment][:, None],
            segment[:, None] == segment[None, :],
        ], dim=1)[None, None]
        hidden = embed(ids)[None]
        cos, sin = drafter.rotary_emb(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer, ctx_k, ctx_v in zip(drafter.layers, self.keys, self.values):
            attn = layer.self_attn
            h = layer.input_layernorm(hidden)
            q = attn.q_norm(attn.q_proj(h).view(1, total, -1, attn.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(h).view(1, total, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(h).view(1, total, -1, attn.head_dim).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            keys = torch.cat([ctx_k[:, :, :context_len], k], dim=2)
            values = torch.cat([ctx_v[:, :, :context_len], v], dim=2)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 enable_gqa=attn.num_heads != attn.num_kv_heads)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, total, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return drafter.norm(hidden)[0]


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
    """

    block_size: int
    taus: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    new_tokens: int = 0
    gaps: list[dict[int, float]] = field(default_factory=list)

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


def _proven_rejections(states: list[_State], hidden: list[torch.Tensor], trace: Trace, y: torch.Tensor,
                       lm_head: torch.Tensor) -> list[int]:
    """Per state, the first draft column proven rejected by the shortlist (``columns + 1`` when none).

    The draft at column j is rejected when a shortlist token v (the target's best-scoring ids at that
    position) beats y under the drafter: ``score_v > score_y``, or equal with ``v < y`` (argmax returns
    the first maximum). Costs (1 + k) dot products per column instead of V.
    """
    n = trace.prompt_tokens
    rows, indices = [], []
    for i, s in enumerate(states):
        rows.append(hidden[i][1 : s.columns + 1])
        indices += range(s.start + 1 - n, s.start + s.columns + 1 - n)
    index = torch.tensor(indices, device=y.device)
    ids = torch.cat([y[index][:, None], trace.shortlist[index]], dim=1)  # [R, 1 + k], y first
    h = torch.cat(rows)
    logits = torch.bmm(lm_head[ids], h[:, :, None])[..., 0].float()  # [R, 1 + k]
    if trace.sampler.temperature > 0:
        noise = torch.stack([trace.sampler.gumbel(i + n) for i in indices]).to(logits.device)
        logits = logits / trace.sampler.temperature + noise.gather(1, ids)
    beats = (logits[:, 1:] > logits[:, :1]) | ((logits[:, 1:] == logits[:, :1]) & (ids[:, 1:] < ids[:, :1]))
    rejected = beats.any(dim=1).tolist()
    firsts, offset = [], 0
    for s in states:
        flags = rejected[offset : offset + s.columns]
        firsts.append(flags.index(True) + 1 if True in flags else s.columns + 1)
        offset += s.columns
    return firsts


def _accept(states: list[_State], hidden: list[torch.Tensor], trace: Trace, y: torch.Tensor, lm_head: torch.Tensor,
            lazy: bool, record_gaps: bool, draft_vocab: torch.Tensor | None = None) -> None:
    """Set ``state.accepted`` (leading draft tokens equal to y) for every drafting state.

    Draft column j (1..b-1) of a block starting at ``start`` proposes position ``start + j`` and is
    compared with ``y[start + j - n]``, the draft token being the argmax of the drafter's scores over
    the whole vocabulary (as in the decoder). In the lazy mode, columns from the first proven rejection
    on are never pushed through the LM head (see ``_proven_rejections``); the full mode and
    ``record_gaps`` push every comparable column. With a draft vocabulary (``draft_vocab`` [N], and
    ``lm_head`` = the decoder's [N, H] draft head) the argmax runs over those N tokens, as in the
    decoder, and the lazy shortlist is not used (the head is already small).
    """
    n = trace.prompt_tokens
    if lazy and not record_gaps and trace.shortlist is not None and draft_vocab is None:
        checked = [first - 1 for first in _proven_rejections(states, hidden, trace, y, lm_head)]
    else:
        checked = [s.columns for s in states]  # columns 1..checked[i] go through the full LM head
    rows, positions, targets = [], [], []
    for i, (s, last) in enumerate(zip(states, checked)):
        if last > 0:
            rows.append(hidden[i][1 : last + 1])
            positions += range(s.start + 1, s.start + last + 1)
            targets.append(y[s.start + 1 - n : s.start + last + 1 - n])
    matches, gaps = [], []
    if rows:
        logits = lm_head_logits(torch.cat(rows), lm_head).float()
        scores = pick_scores(trace.sampler, logits, positions, draft_vocab)
        proposed = scores.argmax(dim=-1)
        if draft_vocab is not None:
            proposed = draft_vocab[proposed]
        matches = (proposed == torch.cat(targets)).tolist()
        gaps = top2_gap(scores) if record_gaps else []
    offset = 0
    for s, last in zip(states, checked):
        s.accepted = 0
        for j in range(last):
            if record_gaps:
                s.step_gaps[j + 1] = gaps[offset + j]
            if not matches[offset + j]:
                break
            s.accepted += 1
        offset += last


@torch.inference_mode()
def replay(decoder: SpeculativeDecoder, trace: Trace, candidates: list[int], config: DecodeConfig,
           lm_head: str = "auto", record_gaps: bool = False) -> dict[int, ReplayResult]:
    """tau(B) of every candidate B from one trace, all candidates batched per step.

    Args:
        decoder: the decoder that made ``trace`` (its drafter, embeddings, LM head and stop ids are used).
        trace: from ``target_trace`` with the same ``config``.
        candidates: block sizes (1 = autoregressive; each at most the drafter's limit).
        config: the request's ``DecodeConfig`` (max_new_tokens, temperature, seed).
        lm_head: ``lazy`` (fewest LM-head rows: best on CPU), ``full`` (all draft columns in one
            product: best on GPU), ``auto`` (lazy on CPU, full elsewhere).
        record_gaps: keep the drafter's top-2 score gap of every computed draft column.
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
    context = DrafterContext(decoder.drafter, trace.features) if any(s.result.block_size > 1 for s in states) else None
    while True:
        active = [s for s in states if not s.stopped and s.produced < config.max_new_tokens]
        if not active:
            break
        for s in active:
            s.width = min(s.result.block_size, config.max_new_tokens - s.produced)
            s.columns = min(s.width - 1, m - 1 - (s.start - n))
            s.accepted, s.step_gaps = 0, {}
        drafting = [s for s in active if s.width > 1]
        if drafting:
            packed = context.block_hidden(decoder.embed, [trace.tokens[s.start - n] for s in drafting],
                                          [s.start for s in drafting], [s.width for s in drafting])
            hidden = list(torch.split(packed, [s.width for s in drafting]))
            _accept(drafting, hidden, trace, y, decoder.draft_head, lazy, record_gaps, decoder.draft_vocab)
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
