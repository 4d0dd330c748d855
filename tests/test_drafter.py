"""The DFlash drafter: config matching, z-lab checkpoint layout, compatibility errors, forward semantics."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F
from transformers import DynamicCache

from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.models.drafter import (
    DFlashDrafter,
    check_compatible,
    default_target_layer_ids,
    lm_head_logits,
    loss_weights,
    make_drafter_config,
)
from tiny_models import make_tiny_drafter, make_tiny_target


def _inputs(drafter: DFlashDrafter, context: int = 5, block: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    H = drafter.config.hidden_size
    noise = torch.randn(1, block, H, generator=g)
    features = torch.randn(1, context, len(drafter.target_layer_ids) * H, generator=g)
    positions = torch.arange(context + block)[None]
    return noise, features, positions


def test_default_target_layer_ids_follow_z_lab_spacing():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(30, num_taps=1) == [14]


def test_drafter_config_matches_the_target(tiny, arch):
    tc = tiny.target(arch).model.config
    config = make_drafter_config(tc, num_layers=2, block_size=8, target_layer_ids=[0, 2], mask_token_id=3)
    assert (config.hidden_size, config.vocab_size, config.num_attention_heads, config.num_key_value_heads) == (
        tc.hidden_size, tc.vocab_size, tc.num_attention_heads, tc.num_key_value_heads)
    assert config.head_dim == tc.hidden_size // tc.num_attention_heads
    assert config.num_hidden_layers == 2 and config.block_size == 8 and config.num_target_layers == tc.num_hidden_layers
    assert config.dflash_config == {"target_layer_ids": [0, 2], "mask_token_id": 3}
    drafter = DFlashDrafter(config)
    assert drafter.block_size == 8 and drafter.max_block_size == 16 and drafter.mask_token_id == 3
    assert DFlashDrafter(make_drafter_config(tc, block_size=16)).max_block_size == 32


def test_drafter_config_needs_target_layer_ids(tiny):
    config = make_drafter_config(tiny.target("llama").model.config)
    config.dflash_config = {"mask_token_id": 0}
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashDrafter(config)


def test_z_lab_layout_round_trip(tiny, tmp_path):
    drafter = tiny.drafter("llama", "random", block_size=4)
    out = drafter.save_pretrained(tmp_path / "dflash", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == 4
    assert config["num_target_layers"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert config["dflash_config"]["mask_token_id"] == 0
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dtype"] == "float32"
    # transformers 4.x readers take the rotary base from rope_theta; transformers 5 from rope_parameters
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == drafter.config.rope_parameters["rope_theta"]
    assert "rope_scaling" not in config or config["rope_scaling"] is None
    weights = load_file(out / "model.safetensors")
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight"} <= set(weights)
    assert not any("rotary" in k or "embed" in k or "lm_head" in k for k in weights)  # shared with the target
    assert weights["fc.weight"].shape == (64, 2 * 64)

    reloaded = DFlashDrafter.from_pretrained(out)
    assert reloaded.config.rope_parameters == drafter.config.rope_parameters
    noise, features, positions = _inputs(drafter)
    with torch.no_grad():
        assert torch.equal(drafter(noise, features, positions), reloaded(noise, features, positions))

    # the decoder gives identical outputs with the reloaded drafter
    target = tiny.target("llama")
    ids = torch.tensor([[5, 17, 42, 9, 77]])
    a = SpeculativeDecoder(target, drafter).generate(ids, 4, DecodeConfig(24))
    b = SpeculativeDecoder(target, reloaded).generate(ids, 4, DecodeConfig(24))
    assert a.output_ids == b.output_ids and a.taus == b.taus


def test_bfloat16_export_loads_into_float32(tiny, tmp_path):
    drafter = tiny.drafter("llama", "random", block_size=4)
    out = drafter.save_pretrained(tmp_path / "bf16")  # default export dtype
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(out / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    reloaded = DFlashDrafter.from_pretrained(out, dtype=torch.float32)
    assert next(reloaded.parameters()).dtype == torch.float32
    torch.testing.assert_close(reloaded.fc.weight, drafter.fc.weight, atol=1e-2, rtol=1e-2)


def test_checkpoint_that_does_not_match_its_config(tiny, tmp_path):
    out = tiny.drafter("llama").save_pretrained(tmp_path / "broken", dtype=torch.float32)
    weights = load_file(out / "model.safetensors")
    del weights["fc.weight"]
    save_file(weights, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"does not match its config: missing \['fc.weight'\]"):
        DFlashDrafter.from_pretrained(out)


def test_missing_drafter_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model\.drafter=/path/to/drafter"):
        DFlashDrafter.from_pretrained(tmp_path / "no-such-drafter")


def test_incompatible_hidden_size(tiny, tmp_path):
    narrow = make_tiny_target(tmp_path / "narrow", hidden_size=32)
    drafter = DFlashDrafter.from_pretrained(make_tiny_drafter(narrow, tmp_path / "narrow-drafter"))
    with pytest.raises(ValueError, match=r"hidden size 32 != target's 64.*make draft model\.target="):
        check_compatible(drafter, tiny.target("llama").model.config)
    with pytest.raises(ValueError, match="hidden size"):
        SpeculativeDecoder(tiny.target("llama"), drafter)


def test_incompatible_layer_ids(tiny, tmp_path):
    target_dir = tiny.target_dir("llama")
    drafter = DFlashDrafter.from_pretrained(make_tiny_drafter(target_dir, tmp_path / "d", target_layer_ids=[0, 7]))
    with pytest.raises(ValueError, match=r"target_layer_ids \[7\] outside the target's 4 layers"):
        SpeculativeDecoder(tiny.target("llama"), drafter)


def test_incompatible_vocab_and_mask_token(tiny):
    tc = tiny.target("llama").model.config
    config = make_drafter_config(tc, num_layers=1, target_layer_ids=[0, 2])
    config.vocab_size = tc.vocab_size + 10
    config.dflash_config = {"target_layer_ids": [0, 2], "mask_token_id": tc.vocab_size + 5}
    with pytest.raises(ValueError, match=rf"vocab size {tc.vocab_size + 10} != target's {tc.vocab_size}.*mask_token_id"):
        check_compatible(DFlashDrafter(config), tc)
    check_compatible(DFlashDrafter(make_drafter_config(tc, num_layers=1, target_layer_ids=[0, 2])), tc)  # fits: no error


def test_forward_shape_and_bidirectional_block(tiny):
    drafter = tiny.drafter("qwen3", "random", block_size=4)
    noise, features, positions = _inputs(drafter)
    with torch.no_grad():
        out = drafter(noise, features, positions)
        assert out.shape == (1, 4, 64)
        changed = noise.clone()
        changed[0, -1] += 1.0
        out2 = drafter(changed, features, positions)
    # block positions attend to each other non-causally: the last token moves the first position
    assert not torch.allclose(out[0, 0], out2[0, 0])


def test_cached_context_equals_full_context(tiny):
    """The decoder feeds context features incrementally through the draft cache; results must not change."""
    drafter = tiny.drafter("llama", "random", block_size=4)
    noise, features, _ = _inputs(drafter, context=7, block=4)
    with torch.no_grad():
        full = drafter(noise, features, torch.arange(11)[None])
        cache = DynamicCache()
        drafter(noise, features[:, :4], torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]]), cache=cache)
        # the decoder crops the block's keys/values away and keeps the context's
        cache.crop(-4)
        assert cache.get_seq_length() == 4
        step = drafter(noise, features[:, 4:], torch.tensor([[4, 5, 6, 7, 8, 9, 10]]), cache=cache)
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_attention_mask_hides_keys(tiny):
    drafter = tiny.drafter("llama", "random", block_size=4)
    noise, features, positions = _inputs(drafter, context=5, block=4)
    mask = torch.ones(1, 1, 4, 9, dtype=torch.bool)
    mask[..., 2] = False  # hide context position 2
    with torch.no_grad():
        masked = drafter(noise, features, positions, attention_mask=mask)
        perturbed = features.clone()
        perturbed[0, 2] += 5.0
        masked2 = drafter(noise, perturbed, positions, attention_mask=mask)
        unmasked2 = drafter(noise, perturbed, positions)
        unmasked = drafter(noise, features, positions)
    torch.testing.assert_close(masked, masked2)  # the hidden position has no influence
    assert not torch.allclose(unmasked, unmasked2)


def test_extract_context_taps_decoder_layer_outputs(tiny):
    drafter = tiny.drafter("llama", "random", block_size=4)
    hidden_states = tuple(torch.full((1, 3, 64), float(i)) for i in range(5))  # entry 0 = embeddings
    ctx = drafter.extract_context(hidden_states)
    assert ctx.shape == (1, 3, 128)
    assert ctx[0, 0, 0] == 1.0 and ctx[0, 0, 64] == 3.0  # layers 0 and 2 -> entries 1 and 3


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_lm_head_logits_equals_linear(rows):
    g = torch.Generator().manual_seed(rows)
    weight, hidden = torch.randn(300, 32, generator=g), torch.randn(2, rows, 32, generator=g)
    torch.testing.assert_close(lm_head_logits(hidden, weight), F.linear(hidden, weight), atol=1e-4, rtol=1e-4)


def test_loss_weights():
    torch.testing.assert_close(loss_weights(4, 4.0), torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 4))
    assert torch.equal(loss_weights(5, float("inf")), torch.ones(4))
    assert loss_weights(16, 7.0).shape == (15,)


def test_draft_vocabulary_round_trip(tiny, tmp_path):
    tc = tiny.target("llama").model.config
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(tc, num_layers=1, block_size=4, target_layer_ids=[0, 2]))
    assert drafter.draft_vocab is None  # z-lab checkpoints: the full vocabulary
    lm_head = tiny.target("llama").model.get_output_embeddings().weight
    assert drafter.draft_head(lm_head) is lm_head
    ids = torch.tensor([2, 5, 40, 41, 300])
    drafter.set_draft_vocab(ids)
    assert torch.equal(drafter.draft_head(lm_head), lm_head[ids])
    assert drafter.to_target_ids(torch.tensor([0, 4, 2])).tolist() == [2, 300, 40]
    with pytest.raises(ValueError, match="set_draft_vocab\\(token_ids, lm_head="):  # vLLM needs the head rows
        drafter.save_pretrained(tmp_path / "no-head")
    drafter.set_draft_vocab(ids, lm_head)

    out = drafter.save_pretrained(tmp_path / "dv", dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 5 and "draft_vocab_size" not in config["dflash_config"]
    stored = load_file(out / "model.safetensors")
    assert stored["d2t"].dtype == torch.int64 and (stored["d2t"] + torch.arange(5)).tolist() == ids.tolist()  # not cast
    assert stored["lm_head.weight"].dtype == lm_head.dtype and torch.equal(stored["lm_head.weight"], lm_head[ids])
    assert stored["fc.weight"].dtype == torch.bfloat16
    reloaded = DFlashDrafter.from_pretrained(out)
    assert reloaded.draft_vocab.dtype == torch.long and torch.equal(reloaded.draft_vocab, ids)
    assert torch.equal(reloaded.draft_lm_head, lm_head[ids])
    check_compatible(reloaded, tc)


def test_draft_vocabulary_outside_the_target(tiny):
    tc = tiny.target("llama").model.config
    drafter = DFlashDrafter(make_drafter_config(tc, num_layers=1, target_layer_ids=[0, 2]))
    drafter.set_draft_vocab(torch.tensor([1, 2, tc.vocab_size + 3]))
    with pytest.raises(ValueError, match="draft_vocab holds ids outside the target's vocabulary"):
        check_compatible(drafter, tc)


# ------------------------------------------------------------------------------------------------
# issue 15 items 5 and 8: drafter configs that do not fit, sliding-window layers
# ------------------------------------------------------------------------------------------------
def _edit_config(directory, **edits) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in edits.items():
        config[key] = value(config[key]) if callable(value) else value
    path.write_text(json.dumps(config))


def test_a_config_listing_more_taps_than_the_weights_names_the_fix(tiny, tmp_path):
    """Item 5: three tap layers in config.json for weights made for two gave a raw torch size-mismatch error."""
    out = make_tiny_drafter(tiny.target_dir("llama"), tmp_path / "two-taps", target_layer_ids=[0, 2])
    _edit_config(out, dflash_config=lambda d: {**d, "target_layer_ids": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"fc.weight is made for 2 target-layer taps but dflash_config.target_layer_ids "
                                         r"lists 3 \(\[0, 1, 2\]\): set target_layer_ids in .*config.json"):
        DFlashDrafter.from_pretrained(out)


def test_a_drafter_for_another_target_is_refused(tiny, tmp_path):
    """Item 5: nothing checked num_target_layers or the target a drafter's config names."""
    target = tiny.target("llama")
    out = make_tiny_drafter(tiny.target_dir("llama"), tmp_path / "deep", target_layer_ids=[0, 2])
    _edit_config(out, num_target_layers=36)
    with pytest.raises(ValueError, match=r"trained on a target with 36 layers \(num_target_layers\), this one has 4.*make draft"):
        SpeculativeDecoder(target, DFlashDrafter.from_pretrained(out))
    _edit_config(out, num_target_layers=4, dflash_config=lambda d: {**d, "target_model": "Qwen/Qwen3-4B"})
    named = DFlashDrafter.from_pretrained(out)
    with pytest.raises(ValueError, match=r"made for target 'Qwen/Qwen3-4B', not '.*target-llama'"):
        SpeculativeDecoder(target, named)
    check_compatible(named, target.model.config, "/models/Qwen3-4B")  # the same model by another path: fits
    check_compatible(named, target.model.config)  # no target name given: not checked


def test_sliding_window_layers_follow_layer_types(tiny):
    """Item 8: a ``sliding_attention`` layer is causal with a window (z-lab's rule); the drafter used to ignore both.

    With one draft layer, the last block position's output depends only on the keys it may see: the last
    ``window - B`` context positions and the whole block. So it equals a full-attention drafter's output fed only
    those context features, and with a window wider than everything the layer is plain causal attention.
    """
    tc = tiny.target("llama").model.config
    config = make_drafter_config(tc, num_layers=1, block_size=4, target_layer_ids=[0, 2])
    torch.manual_seed(0)
    full = DFlashDrafter(config).eval()
    sliding_config = make_drafter_config(tc, num_layers=1, block_size=4, target_layer_ids=[0, 2])
    sliding_config.layer_types, sliding_config.sliding_window = ["sliding_attention"], 6
    sliding = DFlashDrafter(sliding_config).eval()
    sliding.load_state_dict(full.state_dict())
    assert (sliding.layers[0].self_attn.is_causal, sliding.layers[0].self_attn.sliding_window) == (True, 6)
    assert (full.layers[0].self_attn.is_causal, full.layers[0].self_attn.sliding_window) == (False, None)
    noise, features, positions = _inputs(full, context=9, block=4)
    with torch.no_grad():
        windowed = sliding(noise, features, positions)
        visible = full(noise, features[:, -2:], positions[:, -6:])  # 6 - 4 = 2 context positions in the window
        assert not torch.allclose(windowed[0, -1], full(noise, features, positions)[0, -1], atol=1e-4)
        torch.testing.assert_close(windowed[0, -1], visible[0, -1], atol=1e-5, rtol=1e-5)
        sliding_config.sliding_window = 100
        wide = DFlashDrafter(sliding_config).eval()
        wide.load_state_dict(full.state_dict())
        causal = full(noise, features, positions, attention_mask=torch.ones(4, 13, dtype=torch.bool).tril(9)[None, None])
        torch.testing.assert_close(wide(noise, features, positions), causal, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# issue 24 items 7(b) and 7(f): the rotary table under a cast, the mask token id's keys
# ------------------------------------------------------------------------------------------------
def test_rotary_inv_freq_stays_float32_when_the_drafter_is_cast(tiny, tmp_path):
    """7(b): ``model.to(device, dtype)`` rounded the drafter's rotary ``inv_freq`` to bfloat16 (an angle error of
    ~1 rad at position 1,000); z-lab's loader keeps it float32, and so does every cast of ours now."""
    tc = tiny.target("llama").model.config
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(tc, num_layers=1, block_size=4, target_layer_ids=[0, 2]))
    positions = torch.tensor([[1, 300, 1000]])
    with torch.no_grad():
        cos32, sin32 = drafter.rotary_emb(torch.zeros(1, 3, 64), positions)
        rounded = drafter.rotary_emb.inv_freq.to(torch.bfloat16).float()  # what a cast used to leave
        error = (positions[0, -1] * (rounded - drafter.rotary_emb.inv_freq)).abs().max()
    assert error > 0.1  # the angle a bfloat16 inv_freq gets wrong at position 1,000 (rad)
    out = drafter.save_pretrained(tmp_path / "d", dtype=torch.bfloat16)
    for model in (drafter.to(torch.bfloat16), DFlashDrafter.from_pretrained(out, dtype=torch.bfloat16)):
        assert model.fc.weight.dtype == torch.bfloat16
        assert model.rotary_emb.inv_freq.dtype == model.rotary_emb.original_inv_freq.dtype == torch.float32
        with torch.no_grad():
            cos, sin = model.rotary_emb(torch.zeros(1, 3, 64, dtype=torch.bfloat16), positions)
        assert torch.equal(cos, cos32.to(torch.bfloat16)) and torch.equal(sin, sin32.to(torch.bfloat16))
    assert drafter.float().rotary_emb.inv_freq.dtype == torch.float32


def test_mask_token_id_from_dflash_config_or_top_level(tiny, tmp_path):
    """7(f): a config without ``dflash_config.mask_token_id`` silently drafted with token 0; now a top-level
    ``mask_token_id`` is read (as z-lab's loader does) and a config with neither is refused, naming the key."""
    tc = tiny.target("llama").model.config
    out = make_tiny_drafter(tiny.target_dir("llama"), tmp_path / "d", target_layer_ids=[0, 2])
    _edit_config(out, dflash_config=lambda d: {k: v for k, v in d.items() if k != "mask_token_id"}, mask_token_id=7)
    drafter = DFlashDrafter.from_pretrained(out)
    assert drafter.mask_token_id == 7
    check_compatible(drafter, tc)
    _edit_config(out, dflash_config=lambda d: {**d, "mask_token_id": 5})  # dflash_config wins over the top level
    assert DFlashDrafter.from_pretrained(out).mask_token_id == 5
    _edit_config(out, dflash_config=lambda d: {k: v for k, v in d.items() if k != "mask_token_id"})
    config = json.loads((out / "config.json").read_text())
    del config["mask_token_id"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"must define dflash_config.mask_token_id \(or a top-level mask_token_id\)"):
        DFlashDrafter.from_pretrained(out)
