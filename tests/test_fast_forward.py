"""``pipeline.models.fast_forward``: the lean decode-step forward equals transformers' own forward bit for bit
(last hidden state, every hidden state, the KV cache) on every packed backend, for Llama and Qwen3 (q/k
norms), and the decoder takes it only where it may; the drafter's fast path (its own forward with fused
products) equals its plain forward bit for bit, masks included."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from pipeline.decoding import SpeculativeDecoder
from pipeline.models.cache import crop_to
from pipeline.models.backend import set_backend
from pipeline.models.fast_forward import FastDraft, FastForward
from pipeline.models.target import new_cache


@pytest.fixture
def eager_afterwards(tiny):
    yield
    for arch in ("llama", "qwen3"):
        set_backend(tiny.target(arch).model, "eager")


@pytest.mark.parametrize("backend", ["smallm", "smallm_f32", "onednn"])
@pytest.mark.parametrize("q", [1, 3, 9])
def test_fast_forward_is_bit_identical_to_transformers(tiny, arch, backend, q, eager_afterwards):
    target = tiny.target(arch)
    base = target.model.base_model
    set_backend(base, backend)
    fast = FastForward(base)
    torch.manual_seed(0)
    ids = torch.randint(0, target.model.config.vocab_size, (1, 20 + q))
    with torch.inference_mode():
        theirs, ours = new_cache(target.model), new_cache(target.model)
        for cache in (theirs, ours):
            base(input_ids=ids[:, :20], cache=cache, use_cache=True)
        for step in range(2):  # two steps: the second reads what the first appended
            start = 20 + step * q
            block = torch.randint(0, target.model.config.vocab_size, (1, q))
            positions = torch.arange(start, start + q)[None]
            ref = base(input_ids=block, position_ids=positions, cache=theirs, use_cache=True, output_hidden_states=True)
            last, states = fast(block, positions, ours, output_hidden_states=True)
            assert torch.equal(last, ref.last_hidden_state)
            assert len(states) == len(ref.hidden_states) and all(torch.equal(a, b) for a, b in zip(states, ref.hidden_states))
            for mine, hf in zip(ours.layers, theirs.layers):
                assert torch.equal(mine.keys, hf.keys) and torch.equal(mine.values, hf.values)
        last_plain, none = fast(block, positions, ours)
        assert none is None and last_plain.shape == last.shape


def test_fast_forward_follows_weight_updates(tiny, eager_afterwards):
    target = tiny.target("llama")
    base = target.model.base_model
    set_backend(base, "smallm")
    fast = FastForward(base)
    ids = torch.arange(1, 6)[None]
    with torch.inference_mode():
        before, _ = fast(ids, torch.arange(5)[None], new_cache(target.model))
    proj = base.layers[0].self_attn.k_proj
    saved = proj.weight.detach().clone()
    try:
        with torch.no_grad():
            proj.weight.mul_(1.5)  # the fused q/k/v weight must be repacked
        with torch.inference_mode():
            after, _ = fast(ids, torch.arange(5)[None], new_cache(target.model))
            ref = base(input_ids=ids, position_ids=torch.arange(5)[None], cache=new_cache(target.model), use_cache=True)
        assert not torch.equal(after, before) and torch.equal(after, ref.last_hidden_state)
    finally:
        with torch.no_grad():
            proj.weight.copy_(saved)


def test_decoder_takes_the_fast_forward_only_where_it_may(tiny, eager_afterwards):
    target = tiny.target("llama")
    assert SpeculativeDecoder(target, backend="smallm").fast is not None  # auto, packed backend
    assert SpeculativeDecoder(target, backend="eager").fast is None  # eager = transformers' path, unchanged
    assert SpeculativeDecoder(target, backend="smallm", fast_forward=False).fast is None
    with pytest.raises(ValueError, match="auto, true or false"):
        SpeculativeDecoder(target, backend="smallm", fast_forward="sometimes")
    layer = target.model.base_model.layers[0]
    act = layer.mlp.act_fn
    try:
        layer.mlp.act_fn = nn.GELU()  # an architecture the lean forward does not reproduce
        assert "MLP activation GELU" in FastForward.unsupported(target.model.base_model)
        assert SpeculativeDecoder(target, backend="smallm").fast is None
        with pytest.raises(ValueError, match="does not support this model: MLP activation GELU"):
            SpeculativeDecoder(target, backend="smallm", fast_forward=True)
    finally:
        layer.mlp.act_fn = act


@pytest.fixture
def eager_drafters(tiny):
    yield
    for arch in ("llama", "qwen3"):
        set_backend(tiny.drafter(arch, "random"), "eager")


@pytest.mark.parametrize("backend", ["smallm", "smallm_f32", "onednn"])
@pytest.mark.parametrize("context", [0, 2, 5])
def test_fast_draft_is_bit_identical_to_the_drafters_forward(tiny, arch, backend, context, eager_drafters):
    """The lean draft forward gives the drafter's hidden states and context keys/values bit for bit, over two
    steps (the second reads the first's cached context), whatever the number of new context features."""
    target, drafter = tiny.target(arch), tiny.drafter(arch, "random")
    set_backend(drafter, backend)
    fast = FastDraft(drafter)
    hidden_size = target.model.config.hidden_size
    torch.manual_seed(0)
    theirs, ours = DynamicCache(), DynamicCache()
    start = 7
    with torch.inference_mode():
        for step in range(2):
            c = context if step == 0 else context + 1
            features = torch.randn(1, c, len(drafter.target_layer_ids) * hidden_size)
            block = torch.randn(1, drafter.block_size, hidden_size)
            positions = torch.arange(start - c, start + drafter.block_size)[None]
            ref = drafter(block, features, positions, cache=theirs)
            mine = fast(block, features, positions, cache=ours)
            assert torch.equal(mine, ref), f"step {step}"
            for a, b in zip(ours.layers, theirs.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            for cache in (theirs, ours):
                crop_to(cache, start)  # the decoder keeps the context keys/values, not the block's
            start += 3


def test_decoder_takes_the_fast_draft_only_where_it_may(tiny, eager_afterwards, eager_drafters):
    target, drafter = tiny.target("llama"), tiny.drafter("llama", "random")
    assert SpeculativeDecoder(target, drafter, backend="smallm").fast_draft is not None
    assert SpeculativeDecoder(target, drafter, backend="eager").fast_draft is None
    assert SpeculativeDecoder(target, drafter, backend="smallm", fast_forward=False).fast_draft is None
    assert SpeculativeDecoder(target, backend="smallm").fast_draft is None  # no drafter
    assert SpeculativeDecoder(target, drafter, backend="onednn").fast_draft.products() is None  # fused on smallm only
    assert "is not a DFlash drafter" in FastDraft.unsupported(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="does not support this drafter: Linear is not a DFlash drafter"):
        FastDraft(nn.Linear(4, 4))


def test_fast_draft_runs_causal_and_sliding_window_layers(tiny, eager_drafters):
    """The fast path is the drafter's own forward with fused products, so it builds the same masks: a causal layer and
    a sliding-window one give the plain forward's hidden states bit for bit (the old lean copy refused them)."""
    target, drafter = tiny.target("llama"), tiny.drafter("llama", "random")
    set_backend(drafter, "smallm")
    attn = drafter.layers[0].self_attn
    hidden_size = target.model.config.hidden_size
    torch.manual_seed(1)
    try:
        for causal, window in ((True, None), (False, 3), (True, 4)):
            attn.is_causal, attn.sliding_window = causal, window
            features = torch.randn(1, 6, len(drafter.target_layer_ids) * hidden_size)
            block = torch.randn(1, drafter.block_size, hidden_size)
            positions = torch.arange(6 + drafter.block_size)[None]
            with torch.inference_mode():
                plain = drafter(block, features, positions)
                fast = FastDraft(drafter)(block, features, positions)
            attn.is_causal, attn.sliding_window = False, None
            with torch.inference_mode():
                unmasked = drafter(block, features, positions)
            assert torch.equal(fast, plain)
            assert not torch.equal(fast, unmasked), (causal, window)  # the mask did change the result
    finally:
        attn.is_causal, attn.sliding_window = False, None
