"""The DFlash drafter: z-lab's ``DFlashDraftModel`` (z-lab/dflash ``dflash/model.py``) on transformers' Qwen3 blocks.

This is BlockPilot's one drafter class. BlockPilot runs it in process (``pipeline.models.drafter.DFlashDrafter`` is
this class plus BlockPilot's checkpoint reader and writer) and copies this file into every drafter folder it writes
(``config.json`` names it in ``auto_map``), so ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` builds
the same model; hence it depends only on torch and transformers. It loads the same tensors as z-lab's
``dflash.DFlashDraftModel`` (``layers.*``, ``fc``, ``hidden_norm``, ``norm``) and takes z-lab's keywords:
``model(position_ids=..., noise_embedding=..., target_hidden=..., past_key_values=..., use_cache=...)`` returns the
normalised hidden states of the block positions, ``model.compute_logits(hidden, target_lm_head)`` scores them and
``model.spec_generate(target=..., input_ids=..., max_new_tokens=..., stop_token_ids=...)`` decodes greedily.

Math (DFlash, Chen et al. 2026): the tapped target layers' hidden states, concatenated, are projected (``fc``) and
normalised (``hidden_norm``) into context features; in every layer the block's queries attend to the keys/values of
[context features ; block], non-causally on ``full_attention`` layers; a ``sliding_attention`` layer
(``config.layer_types``) is causal unless ``config.is_causal`` says otherwise and sees only keys within
``config.sliding_window`` positions. Each step of a layer is a method (``DFlashAttention.project``, ``queries``,
``keys``, ``values``, ``visible``, ``attend``; ``DFlashDecoderLayer.feed_forward``), so a caller that arranges the rows
differently (BlockPilot's replay labelling packs several blocks into one pass) runs the same code.

Rotary: ``inv_freq`` stays float32 when the model is cast (``.to(torch.bfloat16)``), as z-lab's loader keeps it; a
bfloat16 ``inv_freq`` turns the angle at position 1,000 by up to ~1 rad.

Draft vocabulary (absent from z-lab checkpoints), in vLLM's layout of a reduced draft head (EAGLE-3's): the
top-level ``draft_vocab_size`` = N, an int64 tensor ``d2t`` [N] of offsets (draft row i proposes target token
i + d2t[i]) and ``lm_head.weight`` [N, H], the target LM head's rows of those tokens (vLLM scores with the drafter's
own head). This class scores with the target's LM head rows at ``draft_vocab`` (= arange(N) + d2t), the rows it was
trained with, and leaves ``lm_head.weight`` to loaders that need it. ``draft_logits`` returns the N scores,
``compute_logits`` returns full-vocabulary logits that are -inf outside the draft vocabulary (so z-lab's
``dflash_generate``, which takes an argmax or samples over the vocabulary, proposes only draft-vocabulary tokens).
Folders of older BlockPilot versions (``dflash_config.draft_vocab_size`` and an absolute-id tensor ``draft_vocab``)
are refused here with the re-export command; ``pipeline.models.drafter.DFlashDrafter`` still reads them.

Dtype: ``config.json``'s ``dtype`` is the dtype the weights are stored in (``dtype="auto"``, the transformers 5
default, loads them so). ``forward`` casts its inputs to the drafter's dtype and returns the caller's dtype (that of
``noise_embedding``), and ``compute_logits`` scores in the LM head's dtype, so a bfloat16 drafter runs beside a
float32 target; pass ``dtype=torch.float32`` to compute in float32.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def dflash_setting(config, name: str, default=None):
    """``config.dflash_config[name]``, else the config's top-level ``name``, else ``default`` (z-lab's lookup)."""
    value = (getattr(config, "dflash_config", None) or {}).get(name)
    return value if value is not None else getattr(config, name, default)


def draft_vocab_size(config) -> int | None:
    """N of a config's draft vocabulary: the top-level ``draft_vocab_size`` (vLLM's key, the one BlockPilot writes) or
    ``dflash_config.draft_vocab_size`` (older BlockPilot folders); None for the full vocabulary (no key, or N equal to
    ``vocab_size``, which vLLM also reads as the full vocabulary)."""
    n = getattr(config, "draft_vocab_size", None) or (getattr(config, "dflash_config", None) or {}).get("draft_vocab_size")
    return int(n) if n and int(n) != int(getattr(config, "vocab_size", -1)) else None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [b, heads, n, d] at the positions of cos/sin [b, n, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def _crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` (self-contained twin of ``pipeline.models.cache.crop_to``)."""
    if cache.get_seq_length() >= length:  # crop(0) still trims sliding-window layers back to their window
        cache.crop(length - cache.get_seq_length())


def _cache_keyword(target: nn.Module) -> str:
    """The keyword ``target``'s forward takes its KV cache by: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


class DFlashRotaryEmbedding(Qwen3RotaryEmbedding):
    """Qwen3's rotary embedding whose ``inv_freq`` stays float32 when the module is cast (moved, not rounded)."""

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers[name] for name in ("inv_freq", "original_inv_freq")
                if isinstance(self._buffers.get(name), torch.Tensor) and self._buffers[name].dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != torch.float32 and before.device.type != "meta":
                self._buffers[name] = before.to(after.device)
        return self


class DFlashAttention(nn.Module):
    """Block queries over [context features ; block] keys/values (z-lab's ``Qwen3DFlashAttention``)."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        layer_type = layer_types[layer_idx] if layer_types else "full_attention"
        is_causal = getattr(config, "is_causal", None)
        self.is_causal = layer_type == "sliding_attention" if is_causal is None else bool(is_causal)
        self.sliding_window = int(config.sliding_window) if layer_type == "sliding_attention" else None

    def project(self, hidden: torch.Tensor, context: torch.Tensor | None):
        """Raw products: q [b, q, heads*d] of the block rows ``hidden`` [b, q, H], and k, v [b, c+q, kv_heads*d] of
        [``context`` [b, c, H] ; hidden] (``context`` None: the block rows only)."""
        kv_in = hidden if context is None else torch.cat([context, hidden], dim=1)
        return self.q_proj(hidden), self.k_proj(kv_in), self.v_proj(kv_in)

    def queries(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Raw queries [b, n, heads*d] at the positions of cos/sin [b, n, d] -> normed, rotated [b, heads, n, d]."""
        return _rope(self.q_norm(q.reshape(*q.shape[:2], -1, self.head_dim)).transpose(1, 2), cos, sin)

    def keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Raw keys [b, n, kv_heads*d] at the positions of cos/sin [b, n, d] -> normed, rotated [b, kv_heads, n, d]."""
        return _rope(self.k_norm(k.reshape(*k.shape[:2], -1, self.head_dim)).transpose(1, 2), cos, sin)

    def values(self, v: torch.Tensor) -> torch.Tensor:
        """Raw values [b, n, kv_heads*d] -> [b, kv_heads, n, d]."""
        return v.reshape(*v.shape[:2], -1, self.head_dim).transpose(1, 2)

    def visible(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor | None:
        """bool [q, k]: which keys (at ``key_positions`` [k]) each query (at ``query_positions`` [q]) may see on this
        layer (True = may attend): causal, key <= query; sliding window w, query - key < w (and, non-causal,
        key - query < w). None on a full-attention layer, which sees every key."""
        if not self.is_causal and self.sliding_window is None:
            return None
        query, key = query_positions[:, None], key_positions[None, :]
        visible = torch.ones(query.shape[0], key.shape[1], dtype=torch.bool, device=query.device)
        if self.is_causal:
            visible &= key <= query
        if self.sliding_window is not None:
            visible &= query - key < self.sliding_window
            if not self.is_causal:
                visible &= key - query < self.sliding_window
        return visible

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """q [b, heads, n, d] over k, v [b, kv_heads, keys, d] (mask bool [b|1, 1, n, keys] or None) -> o_proj: [b, n, H]."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))

    def forward(self, hidden, context, cos, sin, attention_mask=None, past_key_values=None):
        """hidden [b, q, H] (normed); context [b, c, H]; cos/sin [b, c+q, d]; mask bool [b|1, 1, q, keys] or None."""
        q_len = hidden.shape[1]
        q, k, v = self.project(hidden, context)
        q, k, v = self.queries(q, cos[:, -q_len:], sin[:, -q_len:]), self.keys(k, cos, sin), self.values(v)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        k_len = k.shape[-2]  # queries sit at the last q_len of the k_len key positions
        window = self.visible(torch.arange(k_len - q_len, k_len, device=q.device), torch.arange(k_len, device=q.device))
        if window is not None:
            attention_mask = window[None, None] if attention_mask is None else attention_mask & window
        return self.attend(q, k, v, attention_mask)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3-shaped layer whose attention also reads the context features."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden + mlp(post_attention_layernorm(hidden))``."""
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, hidden, context, cos, sin, attention_mask=None, past_key_values=None):
        attn = self.self_attn(self.input_layernorm(hidden), context, cos, sin, attention_mask, past_key_values)
        return self.feed_forward(hidden + attn)


class DFlashDraftModel(Qwen3PreTrainedModel):
    """DFlash drafter (z-lab layout, plus an optional draft vocabulary in vLLM's layout: ``d2t``).

    Attributes:
        target_layer_ids: target decoder layers (0-based) whose outputs, concatenated, are ``target_hidden``.
        block_size: the training block size B; mask_token_id: the token at the B-1 drafted positions.
        d2t: int64 [N] offsets of the draft vocabulary (the stored tensor), or None (full vocabulary).
        draft_vocab: int64 [N] target token ids the drafter may propose (arange(N) + d2t), or None.
    Raises:
        ValueError: from the constructor, for a config without ``dflash_config.target_layer_ids`` or without a mask
            token id (``dflash_config.mask_token_id``, or a top-level ``mask_token_id`` as z-lab's loader reads).
    """

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]
    # vLLM's copy of the draft head rows: this class scores with the target's LM head (``draft_head``)
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\.weight$"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        layer_ids = dflash_setting(config, "target_layer_ids")
        if layer_ids is None:
            raise ValueError("a DFlash drafter config must define dflash_config.target_layer_ids")
        mask_token_id = dflash_setting(config, "mask_token_id")
        if mask_token_id is None:
            raise ValueError("a DFlash drafter config must define dflash_config.mask_token_id (or a top-level "
                             "mask_token_id): the token id the drafter was trained with at the drafted positions")
        self.target_layer_ids = [int(i) for i in layer_ids]
        self.block_size = int(dflash_setting(config, "block_size", 16))
        self.mask_token_id = int(mask_token_id)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        n_draft_vocab = draft_vocab_size(config)
        self.d2t: torch.Tensor | None
        if n_draft_vocab:
            self.register_buffer("d2t", torch.zeros(n_draft_vocab, dtype=torch.long))
        else:
            self.d2t = None
        self.post_init()

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """int64 [N] target token ids of the draft vocabulary (``arange(N) + d2t``), or None (full vocabulary)."""
        if self.d2t is None:
            return None
        return self.d2t + torch.arange(self.d2t.numel(), dtype=self.d2t.dtype, device=self.d2t.device)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``.

        Raises:
            ValueError: when the config names a draft vocabulary (``draft_vocab_size``) whose ``d2t`` tensor the
                weights lack; for a folder of an older BlockPilot (absolute ids in ``draft_vocab``) it names the
                re-export that writes vLLM's layout.
        """
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if model.d2t is not None and "d2t" in info.get("missing_keys", ()):
            if "draft_vocab" in info.get("unexpected_keys", ()):
                raise ValueError("this drafter folder stores its draft vocabulary as absolute ids (draft_vocab, an older "
                                 "BlockPilot layout): re-export it into vLLM's layout (d2t offsets + lm_head rows) with "
                                 "make export-drafter SRC=<folder> DST=<folder>")
            raise ValueError("config.json sets draft_vocab_size but the weights hold no d2t tensor: remove "
                             "draft_vocab_size from config.json or use the weights saved with it")
        return (model, info) if want_info else model

    @property
    def max_block_size(self) -> int:
        """Largest inference block size accepted: twice the training block size (at least 16)."""
        return max(16, 2 * self.block_size)

    def extract_context(self, hidden_states) -> torch.Tensor:
        """Concatenate the tapped layers of a target's ``output_hidden_states`` (entry 0 = embeddings; each [b, t, H])
        -> [b, t, len(target_layer_ids) * H]."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def forward(self, noise_embedding=None, target_hidden=None, position_ids=None, attention_mask=None,
                past_key_values=None, use_cache=False, cache=None, **kwargs) -> torch.Tensor:
        """Hidden states [b, q, H] of the block positions (final norm applied), in ``noise_embedding``'s dtype.

        Call it with z-lab's keywords; BlockPilot also calls it positionally, in the order below.

        Args:
            noise_embedding: [b, q, H] target input embeddings of the block (anchor + mask tokens).
            target_hidden: [b, c, n_taps * H] context features not yet in the cache (c may be 0).
            position_ids: [b, c + q] positions of the new context features, then of the block.
            attention_mask: bool [b|1, 1, q, keys] (True = may attend) or None (all visible).
            past_key_values: a ``DynamicCache`` of projected context keys/values (``cache``: the same, BlockPilot's
                name); the block's are appended too, so the caller crops it back to the context.
        """
        past_key_values = cache if past_key_values is None else past_key_values
        out_dtype = noise_embedding.dtype
        dtype = self.fc.weight.dtype
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        hidden = noise_embedding.to(dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, attention_mask, past_key_values)
        return self.norm(hidden).to(out_dtype)

    def context_keys_values(self, target_hidden: torch.Tensor, position_ids: torch.Tensor) -> list[tuple]:
        """Per layer, the keys (rotated) and values [b, kv_heads, c, d] of context features ``target_hidden``
        [b, c, n_taps * H] at ``position_ids`` [b, c]: what ``forward`` puts in its cache for them."""
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self.rotary_emb(context, position_ids)
        return [(layer.self_attn.keys(layer.self_attn.k_proj(context), cos, sin),
                 layer.self_attn.values(layer.self_attn.v_proj(context))) for layer in self.layers]

    def _head(self, output_head) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [V, H], bias [V] or None) of an LM head module (or a bare weight tensor)."""
        if isinstance(output_head, torch.Tensor):
            return output_head, None
        return output_head.weight, getattr(output_head, "bias", None)

    def draft_head(self, lm_head: torch.Tensor) -> torch.Tensor:
        """The LM-head rows the drafter scores: ``lm_head[draft_vocab]`` [N, H], or the full [V, H]."""
        return lm_head if self.draft_vocab is None else lm_head[self.draft_vocab.to(lm_head.device)]

    def draft_logits(self, hidden: torch.Tensor, output_head) -> torch.Tensor:
        """Scores [..., N] of the draft-vocabulary rows of ``output_head`` ([..., V] without a draft vocabulary)."""
        weight, bias = self._head(output_head)
        if self.draft_vocab is not None:
            rows = self.draft_vocab.to(weight.device)
            weight, bias = weight[rows], None if bias is None else bias[rows]
        return F.linear(hidden.to(weight.dtype), weight, bias)

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices over ``draft_logits``' last axis -> target token ids (identity without a draft vocabulary)."""
        return index if self.draft_vocab is None else self.draft_vocab.to(index.device)[index]

    def compute_logits(self, hidden: torch.Tensor, output_head) -> torch.Tensor:
        """Full-vocabulary logits [..., V]; -inf outside the draft vocabulary (only its rows are computed)."""
        logits = self.draft_logits(hidden, output_head)
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., self.draft_vocab.to(logits.device)] = logits
        return full

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: list[int] | None = None, temperature: float = 0.0,
                      block_size: int | None = None) -> torch.LongTensor:
        """Greedy speculative decoding of one sequence with ``target`` (a transformers causal LM); lossless.

        Returns:
            [1, prompt + generated] token ids (at most ``max_new_tokens`` new ones; stops after a stop token).
        Raises:
            NotImplementedError: for ``temperature > 0`` (sample with z-lab's ``dflash.model.dflash_generate``,
                which calls ``compute_logits``, or with BlockPilot's decoder).
        """
        if temperature > 0:
            raise NotImplementedError("spec_generate decodes greedily (temperature=0); for sampling use z-lab's "
                                      "dflash.model.dflash_generate(model, target, ...) or BlockPilot's SpeculativeDecoder")
        self.eval()
        block_size = int(block_size or self.block_size)
        device = input_ids.device
        stops = set(stop_token_ids or [])
        max_length = input_ids.shape[1] + max_new_tokens
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        target_cache, draft_cache = DynamicCache(config=target.config), DynamicCache()
        cache_kw = _cache_keyword(target)

        out = target(input_ids, use_cache=True, output_hidden_states=True, **{cache_kw: target_cache})
        tokens = input_ids[0].tolist() + [int(out.logits[0, -1].argmax())]
        context = self.extract_context(out.hidden_states)
        while len(tokens) < max_length and tokens[-1] not in stops:
            start = len(tokens) - 1  # position of the anchor: the last token, not yet in the target's cache
            q_len = min(block_size, max_length - start)
            block = torch.full((1, q_len), self.mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = tokens[-1]
            if q_len > 1:
                positions = torch.arange(draft_cache.get_seq_length(), start + q_len, device=device)[None]
                hidden = self(position_ids=positions, noise_embedding=embed(block), target_hidden=context,
                              past_key_values=draft_cache, use_cache=True)
                _crop_to(draft_cache, start)
                block[0, 1:] = self.to_target_ids(self.draft_logits(hidden[:, 1:], head).argmax(-1))[0]
            out = target(block, position_ids=torch.arange(start, start + q_len, device=device)[None],
                         use_cache=True, output_hidden_states=True, **{cache_kw: target_cache})
            posterior = out.logits[0].argmax(-1)
            accepted = int((block[0, 1:] == posterior[:-1]).cumprod(0).sum())
            new = block[0, 1 : accepted + 1].tolist() + [int(posterior[accepted])]
            for i, token in enumerate(new):
                if token in stops:
                    new = new[: i + 1]
                    break
            tokens += new[: max_length - len(tokens)]
            _crop_to(target_cache, start + accepted + 1)
            context = self.extract_context(out.hidden_states)[:, : accepted + 1]
        return torch.tensor([tokens[:max_length]], dtype=torch.long, device=device)
