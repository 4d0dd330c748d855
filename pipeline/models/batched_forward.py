"""One target forward (and one drafter forward) over the rows of many requests, each request's rows bit-identical
to the forward that request's decoder would run alone.

A batched decode step (``pipeline.decoding.batched``) concatenates the token rows of N requests: request i brings
q_i rows (a verify of k_i drafts: k_i + 1 rows; a plain step: 1 row) at its own positions over its own KV cache.
The linear layers (the fused q/k/v, o, the fused gate/up, down, the LM head; the drafter's fc, q/k/v, o, gate/up,
down and its head) run ONCE over the concatenated rows; row-wise operations (RMSNorm, SiLU, residual adds, the
embedding lookup, the rotary rotation at each row's position) run on the concatenation. The target's attention is ONE
call of the smallm kernel's ``attend`` for all requests (each row over its own request's cache, causal, a fixed
computation per row, the cache appends inside the same call: the decoder's solo steps use the same kernel,
``FastForward(attention="kernel")``); only the drafter's attention runs per request. Where the target's forward uses transformers' SDPA instead
(``attention="sdpa"``), its attention runs per request with the causal mask its own forward would build.

Why it is exact: on the ``smallm`` kernels every output is one sequential FMA chain over K, so a row's result does not
depend on the other rows of its call, at any row count (``tests/test_batched.py::test_smallm_rows_invariant``
checks 1..64 rows for every format). But ``packed_linear`` (the o / down projections, the LM heads, the drafter's fc)
sends calls of more than ``SMALLM_MAX_ROWS`` (32) rows to PyTorch's GEMM, which is NOT row-invariant (MKL's result
for a row changes with the rows beside it, at every row count). So every linear call here is split in chunks of at
most ``SMALLM_MAX_ROWS`` rows (``ROW_LIMIT``), and a request whose own call had more rows than that when decoding
alone (a drafter's first step over a long prompt's features) runs that call alone, exactly as it did then.

Off the smallm kernels (``eager``, ``onednn``: PyTorch's and oneDNN's GEMMs are not row-invariant) and for targets
``FastForward`` does not support, ``BatchedForward.exact`` is False and every request's forward runs alone (the same
calls as its decoder makes: exact, but no shared weight reads).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask

from pipeline.models.backend import SMALLM, SMALLM_MAX_ROWS, packed_kind
from pipeline.models.fast_forward import _rms_norm, kernel_attention, tree_mask

ROW_LIMIT = SMALLM_MAX_ROWS  # the most rows one linear call of a batched forward takes (see the module doc)


def row_depths(parents: list[int] | None, rows: int, device=None) -> torch.Tensor:
    """Each row's offset from its request's first row: 0..rows-1 for causal rows (``parents`` None), else its depth in
    the draft tree whose row parents are ``parents`` (-1: the first row)."""
    if parents is None:
        return torch.arange(rows, device=device)
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return torch.tensor(depths, device=device)


def _as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def chunked(fn: Callable, x: torch.Tensor, limit: int = ROW_LIMIT) -> list[torch.Tensor]:
    """``fn`` (a linear, or fused linears returning a list) over ``x`` [1, Q, K] in calls of at most ``limit`` rows.

    Returns:
        the list of outputs, each [1, Q, N_j] (one entry for a plain linear).
    """
    q = x.shape[1]
    if q <= limit:
        return _as_list(fn(x))
    parts = [_as_list(fn(x[:, i: i + limit])) for i in range(0, q, limit)]
    return [torch.cat([p[j] for p in parts], dim=1) for j in range(len(parts[0]))]


def segment_rows(fn: Callable, parts: Sequence[torch.Tensor], limit: int = ROW_LIMIT) -> list[list[torch.Tensor]]:
    """``fn`` over each segment of ``parts`` (each [1, n_i, K]), as if called on each alone: the segments of at most
    ``limit`` rows share chunked calls (row-invariant there), longer ones run alone (as their solo forward did).

    Returns:
        per segment, the list of outputs (each [1, n_i, N_j]).
    """
    out: list[list[torch.Tensor] | None] = [None] * len(parts)
    small = [i for i, p in enumerate(parts) if p.shape[1] <= limit]
    for i, p in enumerate(parts):
        if p.shape[1] > limit:
            out[i] = _as_list(fn(p))
    if small:
        sizes = [parts[i].shape[1] for i in small]
        joined = chunked(fn, torch.cat([parts[i] for i in small], dim=1), limit)
        pieces = [t.split(sizes, dim=1) for t in joined]
        for n, i in enumerate(small):
            out[i] = [p[n] for p in pieces]
    return out  # type: ignore[return-value]


class BatchedForward:
    """The batched target and draft forwards of a ``SpeculativeDecoder`` (see the module doc).

    Attributes:
        exact: True when the target's linears run once over all requests' rows (smallm backend, ``FastForward``);
            False: every request's forward runs alone (still bit-identical to its solo decode).
        exact_draft: the same for the drafter (smallm backend, ``FastDraft``).
    """

    def __init__(self, decoder):
        self.decoder = decoder
        self.exact = decoder.backend in SMALLM and decoder.fast is not None
        self.exact_draft = decoder.backend in SMALLM and decoder.fast_draft is not None

    def takes(self, rows: int) -> bool:
        """Whether ``target`` runs ``rows`` rows of a request batched (the smallm kernel's path), not alone."""
        return self.exact and rows <= SMALLM_MAX_ROWS

    # -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def target(self, ids: Sequence[torch.Tensor], caches: Sequence, starts: Sequence[int], want_features: Sequence[bool],
               parents: Sequence[list[int] | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Target forwards of N requests: request i's ``ids[i]`` [1, q_i] at positions starts[i].., appending to
        ``caches[i]``, bit-identical to ``decoder.target_forward(ids[i], caches[i], starts[i], want_features[i],
        parents=parents[i])``.

        Args:
            parents: per request None (causal rows) or a draft tree's parent of each of its rows (-1: the first row,
                ``pipeline.decoding.trees``): a row then sits at start + its depth and attends to its request's cache,
                its ancestors and itself. None: every request causal.
        Returns:
            per request (logits [q_i, V] float32, features [1, q_i, n_taps*H] or None).
        """
        dec = self.decoder
        n = len(ids)
        parents = list(parents) if parents is not None else [None] * n
        results: list = [None] * n
        batch = [i for i in range(n) if self.takes(ids[i].shape[1])]
        for i in range(n):
            if i not in batch:  # more rows than the kernel takes (a prefill chunk): the request's forward alone
                results[i] = dec.target_forward(ids[i], caches[i], starts[i], want_features=want_features[i],
                                                parents=parents[i])
        if not batch:
            return results
        tree = None  # every row's parent among its request's rows, where any request verifies a tree
        if any(parents[i] is not None for i in batch):
            tree = [p for i in batch for p in (parents[i] if parents[i] is not None else range(-1, ids[i].shape[1] - 1))]
        fast = dec.fast
        base = fast.base
        sizes = [ids[i].shape[1] for i in batch]
        cuts = [0]
        for s in sizes:
            cuts.append(cuts[-1] + s)
        h = base.embed_tokens(ids[batch[0]] if len(batch) == 1 else torch.cat([ids[i] for i in batch], dim=1))
        kernel = fast.attention == "kernel"
        masks, rope = [], []
        for j, i in enumerate(batch):
            positions = starts[i] + row_depths(parents[i], sizes[j], h.device)[None]
            hj = h[:, cuts[j]: cuts[j + 1]]
            if not kernel:
                masks.append(create_causal_mask(config=base.config, inputs_embeds=hj, attention_mask=None,
                                                cache=caches[i], position_ids=positions) if parents[i] is None
                             else tree_mask(parents[i], caches[i].get_seq_length(), hj.dtype, h.device))
            rope.append(base.rotary_emb(hj, position_ids=positions))
        if kernel:  # every request's cos/sin side by side: the rotation is element-wise, so per row as alone
            cos_all, sin_all = rope[0] if len(rope) == 1 else (torch.cat([r[0] for r in rope], dim=1),
                                                               torch.cat([r[1] for r in rope], dim=1))
        keep = any(want_features[i] for i in batch)
        kind = packed_kind(base)
        done = fast.run_native(h, cos_all, sin_all, [caches[i] for i in batch], sizes, kind, keep, tree) if kernel else None
        if done is not None:  # the whole stack in one native call over every request's rows
            h, tapped = done
            return self._finish(results, batch, cuts, h, tapped, want_features)
        states = [h] if keep else None
        for li, layer in enumerate(base.layers[: base.config.num_hidden_layers]):
            qkv, gate_up, o_proj, down_proj = fast._linears(li, layer, kind)
            attn = layer.self_attn
            x = _rms_norm(layer.input_layernorm, h)
            q_all, k_all, v_all = chunked(qkv, x)
            if kernel:  # one rotation and one attention call over every request's rows
                shape = (1, cuts[-1], -1, attn.head_dim)
                q, k, v = q_all.view(shape), k_all.view(shape), v_all.view(shape)
                if getattr(attn, "q_norm", None) is not None:
                    q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
                q, k = fast.rotary(q.transpose(1, 2), k.transpose(1, 2), cos_all, sin_all)
                out = kernel_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0], [caches[i] for i in batch],
                                       sizes, attn.layer_idx, attn.scaling, tree)[None]
            else:
                out = self._attention_per_request(attn, q_all, k_all, v_all, cuts, batch, rope, caches, masks)
            h = h + chunked(o_proj, out)[0]
            x = _rms_norm(layer.post_attention_layernorm, h)
            gate, up = chunked(gate_up, x)
            h = h + chunked(down_proj, layer.mlp.act_fn(gate) * up)[0]
            if states is not None:
                states.append(h)
        h = _rms_norm(base.norm, h)
        if states is not None:
            states[-1] = h
        return self._finish(results, batch, cuts, h, tuple(states) if keep else None, want_features)

    def _finish(self, results, batch, cuts, h, states, want_features):
        """The LM head over the final states ``h`` [1, R, H] and the drafter's features from ``states`` (indexable by
        hidden_states index; None: none wanted), split per request into ``results``."""
        dec = self.decoder
        logits = chunked(dec.head, h)[0][0].float()
        features = dec.drafter.extract_context(states) if states is not None else None
        for j, i in enumerate(batch):
            a, b = cuts[j], cuts[j + 1]
            results[i] = (logits[a:b], features[:, a:b] if want_features[i] else None)
        return results

    def _attention_per_request(self, attn, q_all, k_all, v_all, cuts, batch, rope, caches, masks) -> torch.Tensor:
        """The attention of one layer (transformers' SDPA), each request's rows alone over its own cache, as its
        ``FastForward`` with ``attention="sdpa"`` runs them.

        Returns:
            [1, R, Hq*D]: every request's attention output rows, concatenated in ``batch`` order.
        """
        fast = self.decoder.fast
        outs = []
        for j, i in enumerate(batch):
            a, b = cuts[j], cuts[j + 1]
            shape = (1, b - a, -1, attn.head_dim)
            q, k, v = q_all[:, a:b].view(shape), k_all[:, a:b].view(shape), v_all[:, a:b].view(shape)
            if getattr(attn, "q_norm", None) is not None:
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            cos, sin = rope[j]
            q, k = fast.rotary(q, k, cos, sin)
            k, v = caches[i].update(k, v, attn.layer_idx)
            out, _ = sdpa_attention_forward(attn, q, k, v, masks[j], dropout=0.0, scaling=attn.scaling)
            outs.append(out.reshape(1, b - a, -1).contiguous())
        return torch.cat(outs, dim=1)

    # -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def draft_hidden(self, blocks: Sequence[torch.Tensor], features: Sequence[torch.Tensor], starts: Sequence[int],
                     caches: Sequence) -> list[torch.Tensor]:
        """Draft forwards of N requests: request i's block ``blocks[i]`` [1, b_i] (anchor + mask tokens) with its
        pending context features ``features[i]`` [1, c_i, n_taps*H], the block at positions starts[i]..; its drafter
        cache ``caches[i]`` gets the context's keys/values (the caller crops it). Bit-identical to the hidden states
        ``SpeculativeDecoder.draft`` computes for that request alone.

        Returns:
            per request the drafter's hidden states [1, b_i, H] (after its final norm).
        """
        dec = self.decoder
        drafter = dec.drafter
        embeds = [dec.embed(b) for b in blocks]
        positions = [torch.arange(s - f.shape[1], s + b.shape[1], device=b.device)[None]
                     for b, f, s in zip(blocks, features, starts)]
        if dec.fast_draft is not None:  # the whole draft forward of every request in one native call
            got = dec.fast_draft.run_native(embeds, features, positions, caches)
            if got is not None:
                return got
        products = dec.fast_draft.products() if self.exact_draft else None
        if products is None:  # off the smallm kernels: each request's draft forward alone (exact, nothing shared)
            forward = dec.fast_draft if dec.fast_draft is not None else drafter
            return [forward(e, f, p, cache=c) for e, f, p, c in zip(embeds, features, positions, caches)]
        n = len(blocks)
        sizes = [b.shape[1] for b in blocks]
        cuts = [0]
        for s in sizes:
            cuts.append(cuts[-1] + s)
        dtype = drafter.fc.weight.dtype
        # the drafter's own layer steps (DFlashDraftModel: project/queries/keys/values/visible, feed_forward), with
        # every product over all requests' rows at once and attention per request, as its forward runs them alone
        context = [drafter.hidden_norm(c[0]) for c in segment_rows(drafter.fc.forward, [f.to(dtype) for f in features])]
        rope = [drafter.rotary_emb(e.to(dtype), p) for e, p in zip(embeds, positions)]
        hidden = torch.cat([e.to(dtype) for e in embeds], dim=1)
        for li, layer in enumerate(drafter.layers):
            attn = layer.self_attn
            qkv, gate_up = products[li]
            x = layer.input_layernorm(hidden)
            kv_in = [torch.cat([context[i], x[:, cuts[i]: cuts[i + 1]]], dim=1) for i in range(n)]
            projected = segment_rows(qkv, kv_in)
            outs = []
            for i in range(n):
                q, k, v = projected[i]
                q_len = sizes[i]
                cos, sin = rope[i]
                q = attn.queries(q[:, k.shape[1] - q_len:], cos[:, -q_len:], sin[:, -q_len:])
                k, v = attn.keys(k, cos, sin), attn.values(v)
                if caches[i] is not None:
                    k, v = caches[i].update(k, v, attn.layer_idx)
                k_len = k.shape[-2]
                mask = attn.visible(torch.arange(k_len - q_len, k_len, device=q.device), torch.arange(k_len, device=q.device))
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if mask is None else mask[None, None],
                    enable_gqa=attn.num_heads != attn.num_kv_heads)
                outs.append(out.transpose(1, 2).reshape(1, q_len, -1))
            hidden = hidden + chunked(attn.o_proj.forward, torch.cat(outs, dim=1))[0]
            x = layer.post_attention_layernorm(hidden)
            gate, up = chunked(gate_up, x)
            hidden = hidden + chunked(layer.mlp.down_proj.forward, layer.mlp.act_fn(gate) * up)[0]
        hidden = drafter.norm(hidden).to(embeds[0].dtype)
        return [hidden[:, cuts[i]: cuts[i + 1]] for i in range(n)]

    @torch.inference_mode()
    def draft_logits(self, hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The drafter head's logits of each request's rows ``hidden[i]`` [r_i, H] -> [r_i, N] float32, as
        ``decoder.drafter_head(hidden[i]).float()`` computes them alone."""
        head = self.decoder.drafter_head
        if not self.exact_draft:
            return [head(h).float() for h in hidden]
        return [out[0][0].float() for out in segment_rows(head, [h[None] for h in hidden])]
