"""The forwards a decoder runs: one for the target and one for the drafter, each over the rows of any number of
requests, each with two implementations chosen once at load (``forward_for``, the one place that reads
``model.backend``, ``model.fast_forward``, ``model.kv_cache``, ``model.precision`` and ``model.draft_precision``):

- **the native stack** (``pipeline.models.native``): the whole target (``NativeStack``) or the whole DFlash draft
  (``DraftStack``) as ONE call of the smallm kernel over every request's rows, on the products chosen at load (the
  GGUF's exact q4/q8 forms, or int8 activations; the drafter's exact, bf16 or int8). Each row's result is the same
  bits alone, in a verify or in a batched step of many requests; a draft tree's row is the bits of its path's causal
  row. It runs where the target is a supported Llama-family model in float32 on the smallm backend with preallocated
  KV caches (``native_reason`` says why not), and the drafter a DFlash drafter in float32 whose layers see every key.
- **transformers' own model** everywhere else (other families and dtypes, the eager and oneDNN backends, CUDA): each
  request's forward alone (a tree's rows under the dense ``tree_mask``), the drafter's own ``forward``.

The LM heads run in calls of at most ``SMALLM_MAX_ROWS`` rows (``by_rows``): on the smallm kernels a row's logits are
then the same bits whatever the rows beside it (PyTorch's GEMM, which takes longer calls, is not row-invariant).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from pipeline.models.backend import SMALLM, SMALLM_MAX_ROWS, LMHead, packed_kind, resolve_backend, set_backend
from pipeline.models.cache import reserve_rows, resolve_kv_cache
from pipeline.models.native import (Bf16Head, Int8Head, NativeStack, build_draft_stack, resolve_draft_precision,
                                    resolve_kv_dtype, resolve_precision)
from pipeline.models.threads import GOVERNOR

LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
SETTINGS = ("auto", "true", "false")  # model.fast_forward: the native stack where it can run | required | never


def tree_mask(row_parents: list[int], context: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The additive attention mask [1, 1, R, context + R] of a tree verify over ``context`` cached tokens: row r sees
    the context, its ancestors and itself (0), nothing else (the dtype's lowest value). The dense reference of the
    kernel's per-row parents, and what transformers' forward takes."""
    rows = len(row_parents)
    allowed = torch.zeros(rows, context + rows, dtype=torch.bool, device=device)
    allowed[:, :context] = True
    for r in range(rows):
        a = r
        while a >= 0:
            allowed[r, context + a] = True
            a = row_parents[a]
    mask = torch.zeros(rows, context + rows, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def row_depths(parents: list[int] | None, rows: int, device=None) -> torch.Tensor:
    """Each row's offset from its request's first row: 0..rows-1 for causal rows (``parents`` None), else its depth in
    the draft tree whose row parents are ``parents`` (-1: the first row)."""
    if parents is None:
        return torch.arange(rows, device=device)
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return torch.tensor(depths, device=device)


def by_rows(fn: Callable, x: torch.Tensor, limit: int = SMALLM_MAX_ROWS) -> torch.Tensor:
    """``fn`` (a head or linear) over ``x`` [R, K] in calls of at most ``limit`` rows."""
    if x.shape[0] <= limit:
        return fn(x)
    return torch.cat([fn(x[i: i + limit]) for i in range(0, x.shape[0], limit)])


def native_reason(base: nn.Module) -> str | None:
    """Why the target ``base`` (a transformers base model) cannot run on the native stack (None when it can): a
    decoder-only Llama/Mistral/Qwen2/Qwen3 model with SDPA attention, RMSNorms, SiLU-gated MLPs of linear layers and
    no sliding window."""
    config = getattr(base, "config", None)
    layers = getattr(base, "layers", None)
    if config is None or layers is None or not all(hasattr(base, a) for a in ("embed_tokens", "norm", "rotary_emb")):
        return f"{type(base).__name__} is not a decoder-only base model with embed_tokens, layers, norm, rotary_emb"
    if getattr(config, "_attn_implementation", "sdpa") != "sdpa":
        return f"attention implementation {config._attn_implementation!r} (needs sdpa)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if type(base.norm).__name__ not in NORMS:
        return f"final norm {type(base.norm).__name__}"
    for layer in layers:
        if type(layer).__name__ not in LAYERS:
            return f"decoder layer {type(layer).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        if not all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention projections are not linear layers"
        if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            return "the MLP is not gate/up/down linear layers"
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            return f"MLP activation {type(mlp.act_fn).__name__}"
        for name in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"):
            sub = getattr(layer, name, None) if "layernorm" in name else getattr(attn, name, None)
            if sub is not None and type(sub).__name__ not in NORMS:
                return f"{name} is a {type(sub).__name__}"
        if getattr(attn, "sliding_window", None):
            return "sliding-window attention"
    return None


def draft_native_reason(drafter: nn.Module) -> str | None:
    """Why the drafter cannot run on the native ``DraftStack`` (None when it can): a DFlash drafter in float32 whose
    layers attend to every key (no causal or sliding-window layer)."""
    layers = getattr(drafter, "layers", None)
    if not layers or not all(hasattr(layer.self_attn, "project") for layer in layers):
        return f"{type(drafter).__name__} is not a DFlash drafter (pipeline/models/hub/modeling_dflash.py)"
    if drafter.fc.weight.dtype != torch.float32:
        return f"the drafter is {drafter.fc.weight.dtype} (the native draft runs float32)"
    if any(layer.self_attn.is_causal or layer.self_attn.sliding_window is not None for layer in layers):
        return "a causal or sliding-window draft layer"
    return None


class RotaryTable:
    """A model's rotary ``cos``/``sin`` rows looked up by position from a table its own ``rotary_emb`` computed, instead
    of computed again at every forward (in place, ~100 us of a ~5 ms int8 step on an AMD EPYC Zen 4, 2026-12-07).

    The same bits: each element is one product ``inv_freq * position`` and its cos / sin, an element-wise computation
    of the position alone (``test_forward`` holds the table against ``rotary_emb`` called on the rows). The table is
    filled in calls of ``_CHUNK`` positions and doubles when a position past it is asked for. Rotary types whose
    frequencies change with the sequence length (``dynamic``, ``longrope``) are computed per call as before.
    """

    _CHUNK = 256

    def __init__(self, rotary: nn.Module):
        self.rotary = rotary
        kind = str(getattr(rotary, "rope_type", "default"))
        self.static = "dynamic" not in kind and kind != "longrope"
        self.cos = self.sin = None

    def _grow(self, size: int, like: torch.Tensor) -> None:
        have = 0 if self.cos is None else self.cos.shape[0]
        size = max(size, 2 * have, self._CHUNK)
        parts = [self.rotary(like, torch.arange(a, min(a + self._CHUNK, size), device=like.device)[None])
                 for a in range(have, size, self._CHUNK)]
        cos, sin = torch.cat([c[0] for c, _ in parts]), torch.cat([t[0] for _, t in parts])
        self.cos = cos if self.cos is None else torch.cat([self.cos, cos])
        self.sin = sin if self.sin is None else torch.cat([self.sin, sin])

    def __call__(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [R, D] of ``positions`` [1, R] (``like``: a tensor of the rows' dtype and device)."""
        if not self.static:
            cos, sin = self.rotary(like, positions)
            return cos[0], sin[0]
        flat = positions.reshape(-1)
        if self.cos is None or self.cos.dtype != like.dtype or int(flat.max()) >= self.cos.shape[0]:
            if self.cos is not None and self.cos.dtype != like.dtype:
                self.cos = self.sin = None
            self._grow(int(flat.max()) + 1, like)
        return self.cos.index_select(0, flat), self.sin.index_select(0, flat)


class NativeTarget:
    """The target's layers on the ``NativeStack`` of its current smallm backend (built on first use), returning the
    hidden states at ``taps`` (transformers' ``hidden_states`` indices: the drafter's tapped layers)."""

    def __init__(self, base: nn.Module, precision: str, taps: Sequence[int] = (), kv_dtype: torch.dtype = torch.float32):
        self.base, self.precision, self.taps, self.kv_dtype = base, precision, sorted(set(int(t) for t in taps)), kv_dtype
        self._stacks: dict[str, NativeStack] = {}
        self.rotary = RotaryTable(base.rotary_emb)

    def stack(self) -> NativeStack | None:
        kind = packed_kind(self.base)
        if kind not in SMALLM:
            return None
        if kind not in self._stacks:
            self._stacks[kind] = NativeStack(self.base, kind, self.precision, self.kv_dtype)
        return self._stacks[kind]

    def __call__(self, h, cos, sin, caches, rows, features: bool, parents=None):
        """(final normed states [R, H], {hidden_states index: [1, R, H]} or None), or None where a cache cannot take
        the native path (nothing changed)."""
        stack = self.stack()
        got = None if stack is None else stack(h, cos, sin, caches, rows, self.taps if features else [], parents)
        if got is None:
            return None
        out, tapped = got
        H = out.shape[-1]
        return out, ({t: tapped[None, :, j * H: (j + 1) * H] for j, t in enumerate(self.taps)} if features else None)


class NativeDraft:
    """The drafter's whole draft forward as one ``DraftStack`` call over every request's block (built on first use,
    again when a weight changes: training)."""

    def __init__(self, drafter: nn.Module, precision: str):
        self.drafter, self.precision = drafter, precision
        self._stack = None
        self.rotary = RotaryTable(drafter.rotary_emb)
        self._counted = [w for w in drafter.parameters() if not w.is_inference()]

    def native_stack(self):
        kind = packed_kind(self.drafter)
        if kind not in SMALLM:
            return None
        if self._stack is None or self._stack.changed():
            self._stack = build_draft_stack(self.drafter, kind, self.precision)
            self._stack.watch(self._counted)
        return self._stack

    def __call__(self, embeds, features, positions, caches) -> list[torch.Tensor] | None:
        """Request i's block ``embeds[i]`` [1, b_i, H] with its pending context features ``features[i]`` [1, c_i, F] at
        ``positions[i]`` [1, c_i + b_i], appended to its draft cache ``caches[i]`` (the caller crops the block back
        out) -> per request the final normed states [1, b_i, H]; None where a cache cannot take it (nothing changed)."""
        stack = self.native_stack()
        if stack is None or any(c is None for c in caches):
            return None
        d = self.drafter
        attn0 = d.layers[0].self_attn
        reserved = reserve_rows(caches, [e.shape[1] + f.shape[1] for e, f in zip(embeds, features)], len(d.layers),
                                (attn0.num_kv_heads, attn0.head_dim, torch.float32))
        if reserved is None:
            return None
        keys, values, lengths = reserved
        f32 = torch.float32
        cos, sin = self.rotary(embeds[0].to(f32), torch.cat(list(positions), dim=1))
        out = stack.forward(torch.cat([f[0].to(f32) for f in features]), torch.cat([e[0].to(f32) for e in embeds]),
                            cos, sin, keys, values,
                            [f.shape[1] for f in features], [e.shape[1] for e in embeds], lengths)
        return [part[None].to(e.dtype) for part, e in zip(out.split([e.shape[1] for e in embeds]), embeds)]


@dataclass
class Path:
    """What ``forward_for`` chose: the linears' backend, the target's precision and KV cache (kind and element), the
    native target (or None: transformers' forward), the drafter's precision and native draft (or None: its own
    forward), the heads."""

    backend: str
    precision: str
    kv_cache: str
    kv_dtype: torch.dtype
    native: NativeTarget | None
    draft_precision: str
    native_draft: NativeDraft | None
    head: object
    drafter_head: object


def forward_for(model: nn.Module, drafter: nn.Module | None, draft_head: torch.Tensor | None, backend: str = "eager",
                kv_cache: str = "auto", setting: bool | str | None = "auto", precision: str = "exact",
                draft_precision: str | None = "auto", kv_dtype: str | None = "auto") -> Path:
    """``model.*`` -> what every forward of a decoder runs (see the module doc); the linears of the target and drafter
    are put on the resolved backend here.

    Args:
        setting: ``model.fast_forward``: ``auto`` (the native stack where it can run), ``true`` (required: raises
            naming why it cannot) or ``false`` (transformers' forward).
        precision: ``model.precision`` (``pipeline.models.native.resolve_precision``); draft_precision:
            ``model.draft_precision`` (``resolve_draft_precision``); kv_dtype: ``model.kv_cache_dtype``
            (``resolve_kv_dtype``).
    Raises:
        ValueError: for an unknown setting, backend or kv_cache, ``true`` where the native stack cannot run, or a
            precision other than exact off the native stack (each naming the fix).
    """
    from pipeline.models.target import logit_head

    setting = str(setting).lower() if setting is not None else "auto"
    if setting not in SETTINGS:
        raise ValueError(f"model.fast_forward must be one of {list(SETTINGS)}, got {setting!r}")
    base = model.base_model
    backend = resolve_backend(backend, model.device, model.dtype)
    resolve_kv_cache(kv_cache)  # an unknown name fails before the backend is set
    for part in (base, drafter):
        if part is not None:
            set_backend(part, backend)
    off = ("model.fast_forward=false" if setting == "false"
           else f"model.backend={backend} (the native stack runs smallm)" if backend not in SMALLM else None)
    reason = off or (f"dtype {model.dtype} (the native stack runs float32)" if model.dtype != torch.float32
                     else native_reason(base))
    kv_cache = resolve_kv_cache(kv_cache, "kernel" if reason is None else "sdpa")
    if reason is None and kv_cache != "preallocated":
        reason = f"model.kv_cache={kv_cache} (the native stack writes preallocated caches)"
    if setting == "true" and reason is not None:
        raise ValueError(f"model.fast_forward=true: the target cannot run on the native stack: {reason}")
    precision = resolve_precision(precision, reason is None)
    if precision != "exact" and reason is not None:
        raise ValueError(f"model.precision={precision} runs on the native stack ({reason}); use model.precision=exact")
    head = logit_head(model).with_backend(backend, float32=True)
    if precision == "int8":
        head = head.on_int8()  # a q8 LM head (SmolLM2's) on int8 products too
    taps = [i + 1 for i in drafter.target_layer_ids] if drafter is not None else []
    kv_dtype = resolve_kv_dtype(kv_dtype, precision, reason is None)
    native = NativeTarget(base, precision, taps, kv_dtype) if reason is None else None
    if drafter is None:
        return Path(backend, precision, kv_cache, kv_dtype, native, "exact", None, head, None)
    draft_reason = off or draft_native_reason(drafter)
    if setting == "true" and draft_reason is not None:
        raise ValueError(f"model.fast_forward=true: the drafter cannot run on the native draft stack: {draft_reason}")
    resolved = resolve_draft_precision(draft_precision)
    if resolved != "exact" and draft_reason is not None:
        if draft_precision not in (None, "auto"):
            raise ValueError(f"model.draft_precision={draft_precision} runs on the native draft stack ({draft_reason}); "
                             "use model.draft_precision=auto or exact")
        resolved = "exact"
    native_draft = NativeDraft(drafter, resolved) if draft_reason is None else None
    drafter_head = (Bf16Head(draft_head) if resolved == "bf16" else Int8Head.quantized(draft_head)
                    if resolved == "int8" else LMHead(draft_head, backend, float32=True))
    return Path(backend, precision, kv_cache, kv_dtype, native, resolved, native_draft, head, drafter_head)


class Forward:
    """The target and draft forwards of a ``SpeculativeDecoder`` over the rows of N requests (see the module doc):
    on the native stacks in one call each, elsewhere each request's forward alone."""

    def __init__(self, decoder):
        self.decoder = decoder

    @property
    def exact(self) -> bool:
        """Whether the target's rows of all requests share one forward (the native stack), each row's bits as alone."""
        return self.decoder.native is not None

    @torch.inference_mode()
    def target(self, ids: Sequence[torch.Tensor], caches: Sequence, starts: Sequence[int], want_features: Sequence[bool],
               parents: Sequence[list[int] | None] | None = None, last_only: bool = False
               ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Target forwards of N requests: request i's ``ids[i]`` [1, q_i] at positions starts[i].., appending to
        ``caches[i]``.

        Args:
            parents: per request None (causal rows) or a draft tree's parent of each of its rows (-1: the first row,
                ``pipeline.decoding.trees``): a row then sits at start + its depth and attends to its request's cache,
                its ancestors and itself. None: every request causal.
            last_only: each request's last row's logits only (a prefill).
        Returns:
            per request (logits [q_i or 1, V] float32, features [1, q_i, n_taps*H] or None).
        """
        dec = self.decoder
        GOVERNOR.adapt()  # one thread while another process holds a core (``pipeline.models.threads``)
        parents = list(parents) if parents is not None else [None] * len(ids)
        if dec.native is not None:
            got = self._native(ids, caches, starts, want_features, parents, last_only)
            if got is not None:
                return got
        results = []
        for x, cache, start, want, tree in zip(ids, caches, starts, want_features, parents):
            positions = (start + row_depths(tree, x.shape[1], x.device))[None]
            mask = None if tree is None else tree_mask(tree, cache.get_seq_length(), dec.model.dtype, x.device)
            out = dec.base(input_ids=x, position_ids=positions, cache=cache, use_cache=True, output_hidden_states=want,
                           attention_mask=mask)
            hidden = out.last_hidden_state[0, -1:] if last_only else out.last_hidden_state[0]
            results.append((dec.head(hidden).float(), dec.drafter.extract_context(out.hidden_states) if want else None))
        return results

    def _native(self, ids, caches, starts, want_features, parents, last_only):
        dec = self.decoder
        base = dec.base
        sizes = [x.shape[1] for x in ids]
        h = base.embed_tokens(ids[0] if len(ids) == 1 else torch.cat(ids, dim=1))
        if len(ids) == 1 and parents[0] is None:  # one request's causal rows (a plain step, a chain's verify)
            positions = torch.arange(starts[0], starts[0] + sizes[0], device=h.device)[None]
        else:
            positions = torch.cat([s + row_depths(p, r, h.device) for s, p, r in zip(starts, parents, sizes)])[None]
        cos, sin = dec.native.rotary(h, positions)
        tree = None  # every row's parent among its request's rows, where any request verifies a tree
        if any(p is not None for p in parents):
            tree = [q for p, r in zip(parents, sizes) for q in (p if p is not None else range(-1, r - 1))]
        keep = any(want_features)
        got = dec.native(h[0], cos, sin, caches, sizes, keep, tree)
        if got is None:
            return None
        out, states = got
        ends = list(itertools.accumulate(sizes))
        logits = by_rows(dec.head, out[[e - 1 for e in ends]] if last_only else out).float()
        features = dec.drafter.extract_context(states) if keep else None
        results = []
        for j, (end, r, want) in enumerate(zip(ends, sizes, want_features)):
            rows = logits[j: j + 1] if last_only else logits[end - r: end]
            results.append((rows, features[:, end - r: end] if want else None))
        return results

    @torch.inference_mode()
    def draft_hidden(self, blocks: Sequence[torch.Tensor], features: Sequence[torch.Tensor], starts: Sequence[int],
                     caches: Sequence) -> list[torch.Tensor]:
        """Draft forwards of N requests: request i's block ``blocks[i]`` [1, b_i] (anchor + mask tokens) with its
        pending context features ``features[i]`` [1, c_i, n_taps*H], the block at positions starts[i]..; its drafter
        cache ``caches[i]`` gets the context's keys/values (the caller crops it).

        Returns:
            per request the drafter's hidden states [1, b_i, H] (after its final norm).
        """
        positions = [torch.arange(s - f.shape[1], s + b.shape[1], device=b.device)[None]
                     for b, f, s in zip(blocks, features, starts)]
        return self.draft_embedded([self.decoder.embed(b) for b in blocks], features, positions, caches)

    @torch.inference_mode()
    def draft_embedded(self, embeds: Sequence[torch.Tensor], features: Sequence[torch.Tensor],
                       positions: Sequence[torch.Tensor], caches: Sequence) -> list[torch.Tensor]:
        """``draft_hidden`` from the blocks' embeddings ``embeds[i]`` [1, b_i, H] at ``positions[i]`` [1, c_i + b_i]:
        one native ``DraftStack`` call where it runs, else each request's drafter forward alone."""
        dec = self.decoder
        if dec.native_draft is not None:
            got = dec.native_draft(embeds, features, positions, caches)
            if got is not None:
                return got
        return [dec.drafter(e, f, p, cache=c) for e, f, p, c in zip(embeds, features, positions, caches)]

    @torch.inference_mode()
    def draft_logits(self, hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The drafter head's logits of each request's rows ``hidden[i]`` [r_i, H] -> [r_i, N] float32, in calls of at
        most ``SMALLM_MAX_ROWS`` rows over every request's rows."""
        head = self.decoder.drafter_head
        sizes = [h.shape[0] for h in hidden]
        return list(by_rows(head, torch.cat(list(hidden)) if len(hidden) > 1 else hidden[0]).float().split(sizes))
