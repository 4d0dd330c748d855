"""DFlash drafter for ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` (exported by BlockPilot).

This file is copied into every drafter folder BlockPilot writes (``config.json`` names it in ``auto_map``), so it
depends only on torch and transformers. It loads the same tensors as z-lab's ``dflash.DFlashDraftModel`` (the
z-lab checkpoint layout: ``layers.*``, ``fc``, ``hidden_norm``, ``norm``) and keeps its call signature:
``model(position_ids=..., noise_embedding=..., target_hidden=..., past_key_values=..., use_cache=...)`` returns
the normalised hidden states of the block positions, ``model.compute_logits(hidden, target_lm_head)`` scores them
and ``model.spec_generate(target=..., input_ids=..., max_new_tokens=..., stop_token_ids=...)`` decodes greedily.

BlockPilot extension (absent from z-lab checkpoints): a draft vocabulary. With ``dflash_config.draft_vocab_size``
= N the folder holds an int64 tensor ``draft_vocab`` [N] of target token ids, as in EAGLE-3's reduced draft head;
the drafter then scores only those N rows of the target's LM head. ``draft_logits`` returns the N scores,
``compute_logits`` returns full-vocabulary logits that are -inf outside the draft vocabulary (so z-lab's
``dflash_generate``, which takes an argmax or samples over the vocabulary, proposes only draft-vocabulary tokens).

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


def _crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` (a negative ``crop`` works across transformers 4.5x and 5.x)."""
    remove = cache.get_seq_length() - length
    if remove >= 0:  # crop(0) still trims sliding-window layers back to their window
        cache.crop(-remove)


def _cache_keyword(target: nn.Module) -> str:
    """The keyword ``target``'s forward takes its KV cache by: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _visible(q_len: int, k_len: int, causal: bool, sliding_window: int | None, device) -> torch.Tensor:
    """bool [1, 1, q_len, k_len]: which keys the last ``q_len`` of ``k_len`` positions may see (True = may attend)."""
    query = (k_len - q_len + torch.arange(q_len, device=device))[:, None]
    key = torch.arange(k_len, device=device)[None, :]
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        visible &= key <= query
    if sliding_window is not None:
        visible &= query - key < sliding_window
        if not causal:
            visible &= key - query < sliding_window
    return visible[None, None]


class DFlashAttention(nn.Module):
    """Block queries attend to [context features ; block] keys/values, non-causally on ``full_attention`` layers.

    A ``sliding_attention`` layer (``config.layer_types``) is causal unless ``config.is_causal`` says otherwise and
    sees only keys within ``config.sliding_window`` positions.
    """

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

    def forward(self, hidden, context, cos, sin, attention_mask=None, past_key_values=None):
        b, q_len, _ = hidden.shape
        c_len = context.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(b, q_len, -1, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([context, hidden], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, c_len + q_len, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c_len + q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # queries sit at the last q_len positions
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if self.is_causal or self.sliding_window is not None:
            window = _visible(q_len, k.shape[-2], self.is_causal, self.sliding_window, q.device)
            attention_mask = window if attention_mask is None else attention_mask & window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3-shaped layer whose attention also reads the context features."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin, attention_mask=None, past_key_values=None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, cos, sin, attention_mask, past_key_values)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """DFlash drafter (z-lab layout, plus BlockPilot's optional ``draft_vocab``).

    Attributes:
        target_layer_ids: target decoder layers (0-based) whose outputs, concatenated, are ``target_hidden``.
        block_size: the training block size B; mask_token_id: the token at the B-1 drafted positions.
        draft_vocab: int64 [N] target token ids the drafter may propose, or None (full vocabulary).
    """

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        if "target_layer_ids" not in dflash:
            raise ValueError("a DFlash drafter config must define dflash_config.target_layer_ids")
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.block_size = int(getattr(config, "block_size", 16))
        self.mask_token_id = int(dflash.get("mask_token_id", 0))
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        n_draft_vocab = dflash.get("draft_vocab_size")
        self.draft_vocab: torch.Tensor | None
        if n_draft_vocab:
            self.register_buffer("draft_vocab", torch.zeros(int(n_draft_vocab), dtype=torch.long))
        else:
            self.draft_vocab = None
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``; raises ``ValueError`` when the config names a draft vocabulary
        (``dflash_config.draft_vocab_size``) that the weights lack."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if model.draft_vocab is not None and "draft_vocab" in info.get("missing_keys", ()):
            raise ValueError("config.json sets dflash_config.draft_vocab_size but the weights hold no draft_vocab "
                             "tensor: remove draft_vocab_size from config.json or use the weights saved with it")
        return (model, info) if want_info else model

    def extract_context(self, hidden_states) -> torch.Tensor:
        """Concatenate the tapped layers of a target's ``output_hidden_states`` (entry 0 = embeddings)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def forward(self, position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
                past_key_values=None, use_cache=False, **kwargs) -> torch.Tensor:
        """Hidden states [b, q, H] of the block positions (final norm applied), in ``noise_embedding``'s dtype.

        Args:
            position_ids: [b, c + q] positions of the new context features, then of the block.
            attention_mask: bool [b|1, 1, q, keys] (True = may attend) or None (all visible).
            noise_embedding: [b, q, H] target input embeddings of the block (anchor + mask tokens).
            target_hidden: [b, c, n_taps * H] context features not yet in ``past_key_values`` (c may be 0).
            past_key_values: a ``DynamicCache`` of projected context keys/values; the caller crops it.
        """
        out_dtype = noise_embedding.dtype
        dtype = self.fc.weight.dtype
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        hidden = noise_embedding.to(dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, attention_mask, past_key_values)
        return self.norm(hidden).to(out_dtype)

    def _head(self, output_head) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [V, H], bias [V] or None) of an LM head module (or a bare weight tensor)."""
        if isinstance(output_head, torch.Tensor):
            return output_head, None
        return output_head.weight, getattr(output_head, "bias", None)

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
