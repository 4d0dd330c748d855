"""A lean forward of a Llama-family target's base model for decode steps: transformers' own computation (bit-identical
with SDPA attention) or, on the smallm kernels, the same with the kernel's batch-invariant attention.

On this project's CPU path an autoregressive step of SmolLM2-135M spends more time in Python and small-op
dispatch (module calls, decorators, output recorders, a dozen element-wise ops per layer) than in its
GEMMs. ``FastForward`` runs the same computation with the same tensor operations in the same order, but
without the module machinery, and on the ``smallm`` kernels it multiplies q/k/v and gate/up with one
concatenated weight each (every output column of the smallm kernel is its own FMA chain, so a
concatenated product equals the separate ones bit for bit). It uses transformers' own pieces where they
decide numerics: the model's rotary embedding and ``apply_rotary_pos_emb``, ``create_causal_mask``, the
KV cache's ``update`` and ``sdpa_attention_forward``.

With ``attention="kernel"`` (what a decoder on the smallm backend in float32 takes) the attention is instead the smallm
kernel's ``attend``: causal attention of each query row over its request's cache as one fixed computation per row,
so a row's output is bit-identical whether it runs alone, in a verify or in a batched step of many requests
(``pipeline.models.batched_forward``). Its logits then differ from transformers' SDPA by rounding (about 1e-6);
decodes still equal transformers' ``generate`` token for token (``tests/test_backend.py``).

Supported: decoder layers of the Llama, Mistral, Qwen2 and Qwen3 families (RMSNorm, SiLU gated MLP,
optional q/k norms and biases) with SDPA attention and no sliding window. ``FastForward.supports`` says
whether a model qualifies; anything else keeps transformers' forward. Tests check the logits, the hidden
states and the cache against transformers' forward bit for bit, and the decodes against ``generate``.

``FastDraft`` runs the DFlash drafter's own forward (``pipeline/models/hub/modeling_dflash.py``) with its ``fused``
option: the block's and the new context's q/k/v as one product, and gate/up as one, on the smallm kernels (the
context rows' queries are computed and dropped: a row's outputs do not depend on the other rows).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask

from pipeline.models.backend import (EXACT_FORMATS, PACKED, SMALLM, SMALLM_MAX_ROWS, pack_smallm, packed_kind,
                                     weight_version)
from pipeline.models.cache import reserve_rows
from pipeline.models.kernel import smallm_kernel
from pipeline.models.native import PRECISIONS, NativeStack, build_draft_stack

ATTENTIONS = ("sdpa", "kernel")  # transformers' SDPA (bit-identical to its forward) | the smallm kernel's ``attend``
LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``'s operations, in its order (bit-identical)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def tree_mask(row_parents: list[int], context: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The additive attention mask [1, 1, R, context + R] of a tree verify over ``context`` cached tokens: row r sees
    the context, its ancestors and itself (0), nothing else (the dtype's lowest value). The dense reference of the
    kernel's per-row parents, and what transformers' forward takes on the other paths."""
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


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches, rows, layer_idx: int,
                     scale: float, parents=None) -> torch.Tensor:
    """One layer's attention of N requests on the smallm kernel: request i's ``rows[i]`` new rows (consecutive in q, k,
    v) are appended to ``caches[i]``'s layer ``layer_idx`` and attend causally over that request's cache, each row as
    one fixed computation (bit-identical alone or with other rows). On ``PreallocatedCache`` layers the append happens
    inside the kernel's call (``PreallocatedLayer.reserve``); on other caches through their ``update`` first.

    Args:
        q: [R, Hq, D] float32 queries (rotated); k, v: [R, Hkv, D] float32 new keys (rotated) and values.
        caches: one KV cache per request; rows: rows per request (summing to R).
        parents: None, or a draft tree's parent of each row among its request's rows (-1: the first row): a row then
            attends to the cached context, its ancestors and itself (``pipeline.decoding.trees``).
    Returns:
        [R, Hq * D]: each row's heads side by side.
    """
    attend = smallm_kernel().attend
    tree = [] if parents is None else [int(p) for p in parents]
    slots = [getattr(c.layers[layer_idx], "reserve", None) if layer_idx < len(c.layers) else None for c in caches]
    if all(s is not None for s in slots):
        reserved = [s(r) for s, r in zip(slots, rows)]
        if all(x is not None for x in reserved):
            return attend(q, k, v, [x[0] for x in reserved], [x[1] for x in reserved], list(rows),
                          [x[2] for x in reserved], scale, tree)
        for s, x, r in zip(slots, reserved, rows):  # undo the reservations made (none is written yet)
            if x is not None:
                s.__self__.crop(-r)
    keys, values, at = [], [], 0
    for c, r in zip(caches, rows):
        kj, vj = c.update(k[at: at + r].transpose(0, 1)[None], v[at: at + r].transpose(0, 1)[None], layer_idx)
        keys.append(kj[0])
        values.append(vj[0])
        at += r
    return attend(q, None, None, keys, values, list(rows), [x.shape[1] for x in keys], scale, tree)


class _Fused:
    """Linears sharing one input, multiplied as one concatenated smallm weight, repacked when any weight changes."""

    __slots__ = ("linears", "kind", "versions", "packed", "splits", "bias")

    def __init__(self, linears: list[nn.Linear], kind: str):
        self.linears, self.kind = linears, kind
        self.versions, self.packed = None, None
        self.splits = [lin.weight.shape[0] for lin in linears]
        self.bias = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        versions = [weight_version(lin.weight) for lin in self.linears]
        if versions != self.versions:
            with torch.no_grad():
                weight = torch.cat([lin.weight.detach() for lin in self.linears])
                self.packed = pack_smallm(weight, () if self.kind == "smallm_f32" else EXACT_FORMATS)
                biases = [lin.bias for lin in self.linears]
                self.bias = None if all(b is None for b in biases) else torch.cat(
                    [b.detach() if b is not None else torch.zeros(n) for b, n in zip(biases, self.splits)])
            self.versions = versions
        out = self.packed(x.reshape(-1, x.shape[-1]), self.bias)
        return [t.view(*x.shape[:-1], t.shape[-1]) for t in out.split(self.splits, dim=-1)]


def _fused_linears(cache: dict, i: int, layer: nn.Module, kind: str | None) -> tuple:
    """(qkv, gate_up) of decoder or draft layer i on backend ``kind``: one concatenated smallm product each
    (``_Fused``), or (None, None) off the smallm kernels, where a concatenated product may not give the separate
    ones' bits. Kept in ``cache`` under (i, kind)."""
    if (i, kind) not in cache:
        attn, mlp = layer.self_attn, layer.mlp
        cache[(i, kind)] = ((_Fused([attn.q_proj, attn.k_proj, attn.v_proj], kind), _Fused([mlp.gate_proj, mlp.up_proj], kind))
                            if kind in SMALLM else (None, None))
    return cache[(i, kind)]


class FastForward:
    """The lean forward of ``base`` (a transformers base model: ``embed_tokens``, ``layers``, ``norm``,
    ``rotary_emb``), for inference.

    Args:
        attention: ``sdpa`` (transformers' ``sdpa_attention_forward``: bit-identical to its forward) or ``kernel``
            (the smallm kernel's ``attend``: float32, each row's output independent of the other rows of the call).
    Raises:
        ValueError: from the constructor when ``base`` is not supported (``supports`` says why), or for another
            ``attention``.
    """

    def __init__(self, base: nn.Module, attention: str = "sdpa", native: bool = True, precision: str = "exact"):
        reason = self.unsupported(base)
        if reason:
            raise ValueError(f"FastForward does not support this model: {reason}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {list(ATTENTIONS)}, got {attention!r}")
        self.base = base
        self.attention = attention
        layer = base.layers[0]
        self.rotary = sys.modules[type(layer).__module__].apply_rotary_pos_emb
        self._fused: dict[tuple, tuple] = {}
        self._layers: dict[tuple, tuple] = {}
        self._native: dict[str, NativeStack] = {}
        self.native = attention == "kernel" and native
        if precision not in PRECISIONS:
            raise ValueError(f"model.precision must be one of {list(PRECISIONS)}, got {precision!r}")
        if precision != "exact" and not self.native:
            raise ValueError(f"model.precision={precision} runs on the native stack only (the smallm backend in float32)")
        self.precision = precision
        # the hidden_states indices a caller reads (the drafter's taps: ``set_taps``); None: all of them
        self.taps: list[int] | None = None

    def set_taps(self, taps) -> None:
        """Return only hidden states ``taps`` (indices of transformers' ``hidden_states``) from forwards with
        ``output_hidden_states``: the drafter's tapped layers (``[i + 1 for i in target_layer_ids]``)."""
        self.taps = sorted(set(int(t) for t in taps))

    def takes(self, rows: int) -> bool:
        """Whether a forward of ``rows`` rows runs here: any decode step or verify (up to ``SMALLM_MAX_ROWS`` rows), and
        a prefill chunk of any length where the native stack runs (one kernel call per chunk, on the decoder's
        precision: a ``model.precision=int8`` prefill multiplies int8 activations too)."""
        if rows <= SMALLM_MAX_ROWS:
            return True
        return self.native_stack(packed_kind(self.base)) is not None

    def native_stack(self, kind: str | None) -> NativeStack | None:
        """The ``NativeStack`` of the base model on smallm backend ``kind`` (None where the native path is off or the
        linears are not on the smallm kernels)."""
        if not self.native or kind not in SMALLM:
            return None
        if kind not in self._native:
            self._native[kind] = NativeStack(self.base, kind, self.precision)
        return self._native[kind]

    def run_native(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches, rows, kind: str | None,
                   output_hidden_states: bool, parents=None):
        """The layers of ``h`` [1, R, H] on the ``NativeStack`` (see there), or None where it cannot run.

        Returns:
            (final normed states [1, R, H], {hidden_states index: [1, R, H]} for ``self.taps`` (all indices when
            unset) or None without ``output_hidden_states``).
        """
        stack = self.native_stack(kind)
        if stack is None:
            return None
        count = len(stack.layers)
        taps = (self.taps if self.taps is not None else list(range(count + 1))) if output_hidden_states else []
        got = stack(h[0], cos[0], sin[0], caches, rows, taps, parents)
        if got is None:
            return None
        out, tapped = got
        H = out.shape[-1]
        states = {t: tapped[None, :, j * H: (j + 1) * H] for j, t in enumerate(taps)} if output_hidden_states else None
        return out[None], states

    @staticmethod
    def unsupported(base: nn.Module) -> str | None:
        """Why ``base`` cannot run on ``FastForward`` (None when it can)."""
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

    @classmethod
    def supports(cls, base: nn.Module) -> bool:
        """True when ``base`` can run on ``FastForward``."""
        return cls.unsupported(base) is None

    def _linears(self, i: int, layer: nn.Module, kind: str | None):
        """(qkv, gate_up, o, down) callables of layer i for the linears' backend ``kind``."""
        if (i, kind) not in self._layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = _fused_linears(self._fused, i, layer, kind)
            if qkv is None:
                def qkv(x, attn=attn):
                    return [attn.q_proj.forward(x), attn.k_proj.forward(x), attn.v_proj.forward(x)]

                def gate_up(x, mlp=mlp):
                    return [mlp.gate_proj.forward(x), mlp.up_proj.forward(x)]
            self._layers[(i, kind)] = (qkv, gate_up, attn.o_proj.forward, mlp.down_proj.forward)
        return self._layers[(i, kind)]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, output_hidden_states: bool = False,
                 parents=None):
        """The base model's forward over ``ids`` [1, q] at ``positions`` [1, q], appending to ``cache``; ``parents``:
        None (causal) or a draft tree's parent of each row (``pipeline.decoding.trees``: a row sees the cache, its
        ancestors and itself; on the kernel, the same bits as the causal row of its path).

        Returns:
            (last_hidden_state [1, q, H] after the final norm, hidden_states or None): ``hidden_states`` is
            transformers' ``output_hidden_states`` tuple (the embedding output, then every decoder layer's
            output, the last one after the final norm).
        """
        base = self.base
        kind = packed_kind(base)
        h = base.embed_tokens(ids)
        kernel = self.attention == "kernel"
        cos, sin = base.rotary_emb(h, position_ids=positions)
        if kernel and self.native:
            done = self.run_native(h, cos, sin, [cache], [ids.shape[1]], kind, output_hidden_states, parents)
            if done is not None:
                return done
        if kernel:
            mask = None
        elif parents is not None:
            mask = tree_mask(parents, cache.get_seq_length(), h.dtype)
        else:
            mask = create_causal_mask(config=base.config, inputs_embeds=h, attention_mask=None, cache=cache,
                                      position_ids=positions)
        states = [h] if output_hidden_states else None
        q_len = ids.shape[1]
        for i, layer in enumerate(base.layers[: base.config.num_hidden_layers]):
            qkv, gate_up, o_proj, down_proj = self._linears(i, layer, kind)
            attn = layer.self_attn
            x = _rms_norm(layer.input_layernorm, h)
            q, k, v = qkv(x)
            shape = (1, q_len, -1, attn.head_dim)
            q, k, v = q.view(shape), k.view(shape), v.view(shape)
            if getattr(attn, "q_norm", None) is not None:
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            if kernel:
                out = kernel_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0], [cache], [q_len],
                                       attn.layer_idx, attn.scaling, parents)
            else:
                k, v = cache.update(k, v.transpose(1, 2), attn.layer_idx)
                out, _ = sdpa_attention_forward(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
            h = h + o_proj(out.reshape(1, q_len, -1).contiguous())
            x = _rms_norm(layer.post_attention_layernorm, h)
            gate, up = gate_up(x)
            h = h + down_proj(layer.mlp.act_fn(gate) * up)
            if states is not None:
                states.append(h)
        h = _rms_norm(base.norm, h)
        if states is not None:
            states[-1] = h
        return h, tuple(states) if states is not None else None


def runs_native(base: nn.Module, setting: bool | str | None, backend: str) -> bool:
    """Whether the target ``base`` runs on the native stack with ``model.fast_forward`` = ``setting`` on ``backend``:
    the smallm kernel in float32, fast_forward not off, a supported target (where ``model.precision=int8`` can run)."""
    return (backend in SMALLM and base.dtype == torch.float32 and setting not in (False, "false")
            and FastForward.supports(base))


def fast_forward_for(base: nn.Module, setting: bool | str | None, backend: str,
                     precision: str = "exact") -> FastForward | None:
    """A decoder's ``FastForward`` for ``model.fast_forward`` = ``setting`` on ``backend``, or None; ``precision``
    (``model.precision``): ``exact`` or ``int8`` (the native stack's q4 products on int8 activations).

    ``auto`` (or None): one for a packed backend when ``base`` is supported; True: one (raises when unsupported);
    False: None.

    Raises:
        ValueError: for True on an unsupported target (naming why), or another setting; for ``int8`` without the native
            stack (not smallm in float32, or fast_forward off).
    """
    attention = "kernel" if backend in SMALLM and base.dtype == torch.float32 else "sdpa"
    if precision != "exact" and not runs_native(base, setting, backend):
        raise ValueError(f"model.precision={precision} runs on the native stack (model.backend=smallm or auto on an AVX2 "
                         "CPU, float32, fast_forward on, a supported target); use model.precision=exact")
    if setting in ("auto", None):
        return FastForward(base, attention, precision=precision) if backend in PACKED and FastForward.supports(base) else None
    if setting is True or setting == "true":
        return FastForward(base, attention, precision=precision)
    if setting is False or setting == "false":
        return None
    raise ValueError(f"model.fast_forward must be auto, true or false, got {setting!r}")


class FastDraft:
    """The drafter's draft forward on the fast path: ``DFlashDraftModel.forward`` (``pipeline/models/hub``) with its
    ``fused`` option set, on the smallm kernels, to one concatenated product for each layer's q/k/v and one for its
    gate/up (``_Fused``; every output column of the kernel is its own FMA chain, so the products equal the separate
    ones bit for bit); off the smallm kernels the plain forward. The layer math is the drafter's own, masks included.

    Raises:
        ValueError: from the constructor when the drafter is not a ``DFlashDraftModel`` (``unsupported`` says why).
    """

    def __init__(self, drafter: nn.Module, native: bool = True, precision: str = "exact"):
        reason = self.unsupported(drafter)
        if reason:
            raise ValueError(f"FastDraft does not support this drafter: {reason}")
        self.drafter = drafter
        self._fused: dict[tuple, tuple] = {}
        # the whole draft forward as one kernel call (DraftStack) where every layer attends to all its keys
        self.native = native and drafter.fc.weight.dtype == torch.float32 and all(
            not layer.self_attn.is_causal and layer.self_attn.sliding_window is None for layer in drafter.layers)
        self.precision = precision  # the native stack's products: exact, or bf16 (model.draft_precision)
        self._stack = None
        self._versions = None
        self._counted = [w for w in drafter.parameters() if not w.is_inference()]

    def _kind(self) -> str | None:
        return packed_kind(self.drafter)

    def native_stack(self):
        """The drafter's ``DraftStack`` on the smallm kernel (built once, again when a weight changes), or None where the
        native path is off or the drafter's linears are not on the smallm kernels."""
        kind = self._kind()
        if not self.native or kind not in SMALLM:
            return None
        versions = [w._version for w in self._counted]
        if self._stack is None or versions != self._versions:
            self._stack = build_draft_stack(self.drafter, kind, self.precision)
            self._versions = versions
        return self._stack

    def run_native(self, embeds, features, positions, caches) -> list[torch.Tensor] | None:
        """The draft forwards of N requests in one ``DraftStack`` call: request i's block ``embeds[i]`` [1, b_i, H] with
        its pending context features ``features[i]`` [1, c_i, F] at ``positions[i]`` [1, c_i + b_i], appended to its
        draft cache ``caches[i]`` (a ``PreallocatedCache``; the caller crops the block back out).

        Returns:
            per request the final normed states [1, b_i, H], or None where the native path cannot run (nothing changed).
        """
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
        dtype = d.fc.weight.dtype
        tables = [d.rotary_emb(e.to(dtype), p) for e, p in zip(embeds, positions)]
        cos = torch.cat([t[0][0] for t in tables])
        sin = torch.cat([t[1][0] for t in tables])
        out = stack.forward(torch.cat([f[0].to(dtype) for f in features]), torch.cat([e[0].to(dtype) for e in embeds]),
                            cos, sin, keys, values, [f.shape[1] for f in features], [e.shape[1] for e in embeds], lengths)
        sizes = [e.shape[1] for e in embeds]
        return [part[None].to(e.dtype) for part, e in zip(out.split(sizes), embeds)]

    def new_cache(self):
        """A draft cache this forward writes in place (``PreallocatedCache``) where the native path runs, else
        transformers' ``DynamicCache``."""
        from transformers import DynamicCache

        from pipeline.models.cache import PreallocatedCache

        return PreallocatedCache() if self.native_stack() is not None else DynamicCache()

    @staticmethod
    def unsupported(drafter: nn.Module) -> str | None:
        """Why ``drafter`` cannot run on ``FastDraft`` (None when it can): it needs the DFlash drafter's layers, whose
        attention takes a fused q/k/v product (``project``) and whose layers a fused gate/up one (``feed_forward``)."""
        layers = getattr(drafter, "layers", None)
        if not layers or not all(hasattr(layer, "feed_forward") and hasattr(layer.self_attn, "project") for layer in layers):
            return f"{type(drafter).__name__} is not a DFlash drafter (pipeline/models/hub/modeling_dflash.py)"
        return None

    def products(self) -> list[tuple] | None:
        """Per draft layer, the (qkv, gate_up) one-product callables on the drafter's current backend (the ``fused``
        option of its forward), or None off the smallm kernels."""
        kind = self._kind()
        if kind not in SMALLM:
            return None
        return [_fused_linears(self._fused, i, layer, kind) for i, layer in enumerate(self.drafter.layers)]

    @torch.inference_mode()
    def __call__(self, noise_embedding: torch.Tensor, target_features: torch.Tensor, position_ids: torch.Tensor,
                 cache=None) -> torch.Tensor:
        """``drafter(noise_embedding, target_features, position_ids, cache=cache)`` on the fast path: [b, q, H]."""
        if noise_embedding.shape[0] == 1 and cache is not None:
            got = self.run_native([noise_embedding], [target_features], [position_ids], [cache])
            if got is not None:
                return got[0]
        return self.drafter(noise_embedding, target_features, position_ids, cache=cache, fused=self.products())


def fast_draft_for(drafter: nn.Module | None, setting: bool | str | None, backend: str, precision: str = "exact"
                   ) -> FastDraft | None:
    """A decoder's ``FastDraft`` for ``model.fast_forward`` = ``setting`` (as ``fast_forward_for``), or None
    (no drafter, or one ``FastDraft`` does not support under ``auto``).

    Raises:
        ValueError: for True with an unsupported drafter, or another setting.
    """
    if drafter is None:
        return None
    if setting in ("auto", None):
        return (FastDraft(drafter, precision=precision) if backend in PACKED and FastDraft.unsupported(drafter) is None
                else None)
    if setting is True or setting == "true":
        return FastDraft(drafter, precision=precision)
    if setting is False or setting == "false":
        return None
    raise ValueError(f"model.fast_forward must be auto, true or false, got {setting!r}")
