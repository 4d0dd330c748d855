"""The preallocated target KV cache (``pipeline.models.cache``): decoding with it is token-identical to
transformers' ``DynamicCache`` path and to ``generate`` for every B and verify width, its forwards give the
same logits over appends and crops, it grows, crops and deep-copies without aliasing, and sliding-window
targets keep transformers' sliding layers."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from omegaconf import OmegaConf
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import pipeline.models.cache as cache_module
from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.step import chain_step
from pipeline.models.cache import crop_to
from pipeline.models.cache import PreallocatedCache, PreallocatedLayer, resolve_kv_cache
from pipeline.models.target import load_target, new_cache
from pipeline.prompts import chat_input_ids

PROMPTS = ["def add(a, b):", "Natalia sold clips to 48 of her friends", "The quick brown fox"]


@pytest.fixture
def small_headroom(monkeypatch):
    """One spare token per new buffer and no request-sized first buffer: the decodes below grow every layer's buffer
    several times."""
    import pipeline.decoding.speculative as speculative

    monkeypatch.setattr(cache_module, "HEADROOM", 1)
    monkeypatch.setattr(speculative, "new_cache", lambda model, kind="auto", tokens=None: new_cache(model, kind))


def test_a_requests_cache_is_sized_once_for_its_decode(trained_decoder):
    """A request's target cache is allocated once for its prompt, its max_new_tokens and a verify's rows: decoding
    with drafts to its last token never grows a layer's buffer (no copy, no doubled capacity)."""
    from pipeline.models.backend import SMALLM_MAX_ROWS

    dec = SpeculativeDecoder(trained_decoder.target, trained_decoder.drafter, kv_cache="preallocated")
    ids = chat_input_ids(dec.target.tokenizer, [PROMPTS[0]])
    config = DecodeConfig(160, 0.0, 0)  # more than the default headroom: the request's size decides
    prefill = dec.prefill(ids, config)
    layers = prefill.cache.layers
    buffers = [layer._key_buffer for layer in layers]
    assert all(layer.capacity == ids.shape[1] + 160 + SMALLM_MAX_ROWS for layer in layers)
    stats = dec.decode(prefill, 4, config)
    assert len(stats.output_ids) > cache_module.HEADROOM and max(stats.taus) > 1  # past the old first buffer, drafting
    assert all(layer._key_buffer is b for layer, b in zip(layers, buffers))


def hf_greedy(target, ids: torch.Tensor, max_new_tokens: int, stop_ids) -> list[int]:
    """transformers' own greedy decoding (its loop, its DynamicCache), cut like the decoder's output."""
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids),
                                pad_token_id=target.tokenizer.pad_token_id or 0)
    return out[0, ids.shape[1]:].tolist()


def decoders(target, drafter) -> dict[str, SpeculativeDecoder]:
    return {kind: SpeculativeDecoder(target, drafter, kv_cache=kind) for kind in ("dynamic", "preallocated")}


# ------------------------------------------------------------------------------------------------
# the switch
# ------------------------------------------------------------------------------------------------
def test_new_cache_kinds_and_the_decoder_switch(tiny, monkeypatch):
    model = tiny.target("llama").model
    dynamic, prealloc = new_cache(model, "dynamic"), new_cache(model, "preallocated")
    assert type(dynamic) is DynamicCache and [type(layer) for layer in dynamic.layers] == [DynamicLayer] * 4
    assert isinstance(prealloc, PreallocatedCache) and isinstance(prealloc, DynamicCache)
    assert [type(layer) for layer in prealloc.layers] == [PreallocatedLayer] * 4
    assert resolve_kv_cache("auto") == resolve_kv_cache(None) == cache_module.DEFAULT_KV_CACHE
    monkeypatch.setattr(cache_module, "DEFAULT_KV_CACHE", "dynamic")
    assert type(new_cache(model)) is DynamicCache and SpeculativeDecoder(tiny.target("llama")).kv_cache == "dynamic"
    monkeypatch.setattr(cache_module, "DEFAULT_KV_CACHE", "preallocated")
    assert type(new_cache(model, "auto")) is PreallocatedCache
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        new_cache(model, "static")
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        SpeculativeDecoder(tiny.target("llama"), kv_cache="paged")
    decoder = SpeculativeDecoder(tiny.target("llama"), kv_cache="dynamic")
    assert type(decoder.prefill(torch.arange(5, 12)[None], DecodeConfig(4)).cache) is DynamicCache
    decoder = SpeculativeDecoder(tiny.target("llama"), kv_cache="preallocated")
    assert type(decoder.prefill(torch.arange(5, 12)[None], DecodeConfig(4)).cache) is PreallocatedCache


def test_build_decoder_passes_model_kv_cache(tiny, compose_config):
    from pipeline.decoding.build import build_decoder

    cfg = compose_config("bench_step", [f"model.target={tiny.target_dir('llama')}", "model.drafter=null",
                                      "model.backend=eager"])
    assert cfg.model.kv_cache == "auto"
    assert build_decoder(cfg.model).kv_cache == cache_module.DEFAULT_KV_CACHE
    for kind in ("dynamic", "preallocated"):
        model_cfg = OmegaConf.merge(cfg.model, {"kv_cache": kind})
        assert build_decoder(model_cfg).kv_cache == kind


# ------------------------------------------------------------------------------------------------
# losslessness
# ------------------------------------------------------------------------------------------------
def test_preallocated_is_lossless_for_every_block_size(trained_decoder, small_headroom):
    """Every B in 1..16 with the preallocated cache (growing many times) gives the dynamic cache's B=1 output,
    which is transformers' greedy ``generate``."""
    target = trained_decoder.target
    by_kind = decoders(target, trained_decoder.drafter)
    config, accepted = DecodeConfig(max_new_tokens=40), 0
    for text in PROMPTS:
        ids = chat_input_ids(target.tokenizer, [text])
        reference = by_kind["dynamic"].generate(ids, 1, config).output_ids
        assert reference == hf_greedy(target, ids, config.max_new_tokens, by_kind["dynamic"].stop_ids)
        for B in range(1, 17):
            stats = by_kind["preallocated"].generate(ids, B, config)
            assert stats.output_ids == reference, f"B={B} with the preallocated cache diverges on {text!r}"
            accepted += sum(t > 1 for t in stats.taus)
    assert accepted > 20  # drafts really were accepted, so verifies really were cropped


def test_preallocated_equals_generate_on_both_archs(tiny, arch, small_headroom):
    target = tiny.target(arch)
    by_kind = decoders(target, tiny.drafter(arch, "random", 4))
    config = DecodeConfig(max_new_tokens=24)
    for text in PROMPTS[:2]:
        ids = chat_input_ids(target.tokenizer, [text])
        reference = hf_greedy(target, ids, config.max_new_tokens, by_kind["dynamic"].stop_ids)
        assert by_kind["preallocated"].generate(ids, 1, config).output_ids == reference, (arch, text)
        for B in (2, 4, 7, 16):
            assert by_kind["preallocated"].generate(ids, B, config).output_ids == reference, (arch, B, text)
            assert by_kind["dynamic"].generate(ids, B, config).output_ids == reference, (arch, B, text)


def test_preallocated_verify_width_is_lossless(trained_decoder, small_headroom):
    """``step(..., verify_width=k)`` on the preallocated cache, the step API the label and serve stages use."""
    target = trained_decoder.target
    decoder = SpeculativeDecoder(target, trained_decoder.drafter, kv_cache="preallocated")
    config = DecodeConfig(max_new_tokens=30)
    ids = chat_input_ids(target.tokenizer, [PROMPTS[0]])
    reference = SpeculativeDecoder(target, kv_cache="dynamic").generate(ids, 1, config).output_ids
    sampler = PositionKeyedSampler(0.0, 0, decoder.lm_head.shape[0])
    for B, k in [(8, 0), (8, 1), (8, 3), (8, 7), (16, 5), (4, 9)]:
        with torch.inference_mode():
            state = decoder.new_state(decoder.prefill(ids, config), use_drafter=True)
            assert isinstance(state.cache, PreallocatedCache)
            out = [state.pending]
            while len(out) < config.max_new_tokens:
                new, accepted = chain_step(decoder, state, sampler, B, k)
                assert len(new) == accepted + 1 <= min(k, B - 1) + 1
                assert state.cache.get_seq_length() == state.start  # cropped back to the accepted tokens
                out.extend(new)
        assert out[: config.max_new_tokens] == reference, f"B={B}, k={k}"


def test_a_deep_copied_prefill_decodes_like_the_original(trained_decoder, small_headroom):
    """What ``labeling.brute.reseed`` and the serving engine do: decode a deep copy, then the original (and back)."""
    from pipeline.labeling.brute import reseed

    decoder = SpeculativeDecoder(trained_decoder.target, trained_decoder.drafter, kv_cache="preallocated")
    config = DecodeConfig(max_new_tokens=32)
    ids = chat_input_ids(decoder.target.tokenizer, [PROMPTS[1]])
    reference = SpeculativeDecoder(decoder.target, kv_cache="dynamic").generate(ids, 1, config).output_ids
    prefill = decoder.prefill(ids, config)
    snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in prefill.cache.layers]
    first = decoder.decode(reseed(prefill, config), 8, config).output_ids  # decodes a deep copy
    for layer, (keys, values) in zip(prefill.cache.layers, snapshot):  # the original is untouched
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    kept = copy.deepcopy(prefill.cache)
    second = decoder.decode(prefill, 3, config).output_ids  # consumes the original
    for layer, (keys, values) in zip(kept.layers, snapshot):  # the copy did not see the original's decode
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert prefill.cache.get_seq_length() > ids.shape[1]  # the original really was decoded into
    third = decoder.decode(dataclasses.replace(prefill, cache=kept), 16, config).output_ids
    assert first == second == third == reference


# ------------------------------------------------------------------------------------------------
# the layer itself: growth, crops, copies, aliasing
# ------------------------------------------------------------------------------------------------
def _states(generator: torch.Generator, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, q, 4, generator=generator), torch.randn(1, 2, q, 3, generator=generator)


def test_layer_appends_grows_crops_like_concatenation():
    generator = torch.Generator().manual_seed(0)
    layer, ref_k, ref_v = PreallocatedLayer(headroom=2), torch.empty(1, 2, 0, 4), torch.empty(1, 2, 0, 3)
    assert layer.get_seq_length() == 0 and layer.capacity == 0
    capacities, pointers = [], []
    for q, drop in [(3, 0), (1, 0), (2, 1), (4, 2), (1, 0), (8, 5), (2, 0), (1, 1), (6, 0)]:
        k, v = _states(generator, q)
        keys, values = layer.update(k, v)
        ref_k, ref_v = torch.cat([ref_k, k], -2), torch.cat([ref_v, v], -2)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert keys.data_ptr() == layer._key_buffer.data_ptr()  # a view of the buffer, not a new tensor
        capacities.append(layer.capacity)
        pointers.append(layer._key_buffer.data_ptr())
        layer.crop(-drop)
        ref_k, ref_v = ref_k[..., : ref_k.shape[-2] - drop, :], ref_v[..., : ref_v.shape[-2] - drop, :]
        assert layer.get_seq_length() == ref_k.shape[-2]
        assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v)
    # first buffer: 3 + 2 headroom; then doubling only when full; the buffer is kept otherwise
    # (lengths after each update: 3, 4, 6, 9, 8, 16, 13, 14, 19)
    assert capacities == [5, 5, 10, 10, 10, 20, 20, 20, 20]
    assert pointers[0] == pointers[1] and pointers[2] == pointers[3] == pointers[4] and len(set(pointers)) == 3
    layer.crop(-100)  # more than held: empty, not negative
    assert layer.get_seq_length() == 0 and layer.keys.shape == (1, 2, 0, 4)
    with pytest.raises(ValueError, match="positive value"):
        layer.crop(1)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.capacity == 0 and not layer.is_initialized


def test_deepcopy_is_independent_and_earlier_views_survive_growth():
    generator = torch.Generator().manual_seed(1)
    layer = PreallocatedLayer(headroom=0)
    layer.update(*_states(generator, 4))
    before_growth = layer.keys  # a view of the first buffer
    frozen = before_growth.clone()
    copied = copy.deepcopy(layer)
    assert copied.capacity == layer.capacity and copied._key_buffer.data_ptr() != layer._key_buffer.data_ptr()
    assert torch.equal(copied.keys, layer.keys) and torch.equal(copied.values, layer.values)
    layer.crop(-2)
    k, v = _states(generator, 3)
    layer.update(k, v)  # grows (capacity 4 -> 8): the old buffer, seen by `before_growth`, is left alone
    assert torch.equal(before_growth, frozen) and torch.equal(copied.keys, frozen)
    assert torch.equal(layer.keys[..., 2:, :], k)
    k2, v2 = _states(generator, 2)
    copied.crop(-1)
    copied.update(k2, v2)  # writes into the copy only
    assert torch.equal(layer.keys[..., 2:, :], k) and torch.equal(copied.keys[..., 3:, :], k2)
    assert torch.equal(copied.keys[..., :3, :], frozen[..., :3, :])
    # a whole cache deep-copies layer by layer
    cache = PreallocatedCache()
    for i in range(3):
        cache.update(*_states(generator, 5), layer_idx=i)
    clone = copy.deepcopy(cache)
    crop_to(cache, 2)
    for i in range(3):
        cache.update(*_states(generator, 4), layer_idx=i)
    assert clone.get_seq_length() == 5 and cache.get_seq_length() == 6
    assert all(a._key_buffer.data_ptr() != b._key_buffer.data_ptr() for a, b in zip(cache.layers, clone.layers))
    assert not torch.equal(clone.layers[0].keys[..., 2:5, :], cache.layers[0].keys[..., 2:5, :])


def test_in_place_writes_respect_inference_mode_and_autograd():
    generator = torch.Generator().manual_seed(2)
    layer = PreallocatedLayer(headroom=8)
    k0, v0 = _states(generator, 3)
    with torch.inference_mode():
        layer.update(k0, v0)
    assert layer._key_buffer.is_inference()
    k1, v1 = _states(generator, 2)
    keys, _ = layer.update(k1, v1)  # outside inference mode: moved to a normal buffer, not an error
    assert not layer._key_buffer.is_inference() and torch.equal(keys, torch.cat([k0, k1], -2))
    k2 = torch.randn(1, 2, 1, 4, requires_grad=True)
    keys, values = layer.update(k2, torch.zeros(1, 2, 1, 3))  # recorded by autograd: concatenated
    keys.sum().backward()
    assert torch.equal(k2.grad, torch.ones_like(k2))
    with torch.no_grad():
        layer.crop(-1)
        keys, _ = layer.update(*_states(generator, 1))  # the graph's tensor is not written in place
    assert keys.shape[-2] == 6 and not keys.requires_grad


def test_batch_methods_keep_working():
    generator = torch.Generator().manual_seed(3)
    layer = PreallocatedLayer()
    k, v = torch.randn(2, 2, 3, 4, generator=generator), torch.randn(2, 2, 3, 4, generator=generator)
    layer.update(k, v)
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, k[1:]) and layer.get_seq_length() == 3
    k1 = torch.randn(1, 2, 2, 4, generator=generator)
    layer.update(k1, k1)
    assert torch.equal(layer.keys, torch.cat([k[1:], k1], -2))
    layer.batch_repeat_interleave(2)
    assert layer.keys.shape == (2, 2, 5, 4) and torch.equal(layer.keys[0], layer.keys[1])


# ------------------------------------------------------------------------------------------------
# model forwards: same logits as the dynamic cache over appends and crops
# ------------------------------------------------------------------------------------------------
# (forward width q, tokens kept of it afterwards): a prefill, verifies cropped back, plain steps
SCHEDULE = [(9, 9), (1, 1), (8, 3), (4, 4), (16, 2), (1, 1), (5, 0), (12, 12), (3, 1)]


def _forwards(model, kind: str, tokens: torch.Tensor) -> list[torch.Tensor]:
    cache, start, out = new_cache(model, kind), 0, []
    with torch.inference_mode():
        for q, keep in SCHEDULE:
            ids = tokens[:, start : start + q]
            positions = torch.arange(start, start + q)[None]
            result = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            out.append(result.logits[0].float())
            crop_to(cache, start + keep)
            start += keep
            assert cache.get_seq_length() == start
    return out


@pytest.mark.parametrize("headroom", [0, 4, 128])
def test_forward_logits_match_the_dynamic_cache(tiny, arch, headroom, monkeypatch):
    monkeypatch.setattr(cache_module, "HEADROOM", headroom)
    model = tiny.target(arch).model
    tokens = torch.randint(3, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(4))
    dynamic, prealloc = _forwards(model, "dynamic", tokens), _forwards(model, "preallocated", tokens)
    for i, (a, b) in enumerate(zip(dynamic, prealloc)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m: f"forward {i}: {m}")
    # and both equal a cache-free forward over the kept tokens (an independent reference)
    kept = sum(keep for _, keep in SCHEDULE[:-1])
    q = SCHEDULE[-1][0]
    with torch.inference_mode():
        full = model(input_ids=tokens[:, : kept + q]).logits[0, -q:].float()
    torch.testing.assert_close(prealloc[-1], full, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# sliding-window targets keep transformers' sliding layers
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A Gemma2-like tiny target (alternating sliding windows of 8) with a random drafter."""
    from pipeline.models.drafter import DFlashDrafter
    from tiny_models import make_tiny_drafter, make_tiny_target

    root = tmp_path_factory.mktemp("kv-gemma2")
    directory = make_tiny_target(root / "gemma2", arch="gemma2")
    drafter = DFlashDrafter.from_pretrained(make_tiny_drafter(directory, root / "drafter", block_size=4))
    return load_target(str(directory), attn_implementation="eager"), drafter


def test_sliding_window_target_with_the_preallocated_cache(gemma2, small_headroom):
    target, drafter = gemma2
    cache = new_cache(target.model, "preallocated")
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, PreallocatedLayer] * 2  # Gemma2: sliding, full, sliding, full
    assert all(layer.record_past for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer))
    prompt = torch.arange(5, 25)[None]  # 20 tokens: past the window of 8
    reference = target.model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=target.stop_token_ids(),
                                      pad_token_id=target.tokenizer.pad_token_id)[0, prompt.shape[1]:].tolist()
    decoder = SpeculativeDecoder(target, drafter, kv_cache="preallocated")
    for b in (1, 2, 5, 8):
        assert decoder.generate(prompt, b, DecodeConfig(40)).output_ids == reference, b
    tokens = torch.randint(3, target.model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(5))
    for a, b in zip(_forwards(target.model, "dynamic", tokens), _forwards(target.model, "preallocated", tokens)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
