"""``pipeline.models.forward``: ``forward_for`` puts the target and the drafter on the native stacks exactly where they
can run and says why not elsewhere (refusing ``fast_forward=true`` and non-exact precisions there, naming the reason);
off the native stack a decoder runs transformers' own forward (bit for bit its ``generate``'s computation) and the
drafter's own forward; the native stack follows weight updates (training)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.decoding import SpeculativeDecoder
from pipeline.models.backend import set_backend, smallm_available
from pipeline.models.forward import draft_native_reason, native_reason
from pipeline.models.target import new_cache

needs_smallm = pytest.mark.skipif(not smallm_available(), reason="the smallm kernel does not build on this CPU")


@pytest.fixture
def eager_afterwards(tiny):
    yield
    for arch in ("llama", "qwen3"):
        set_backend(tiny.target(arch).model, "eager")
        set_backend(tiny.drafter(arch, "random"), "eager")


@needs_smallm
def test_the_native_stack_runs_only_where_it_may(tiny, eager_afterwards):
    target, drafter = tiny.target("llama"), tiny.drafter("llama", "random")
    on = SpeculativeDecoder(target, drafter, backend="smallm")
    assert on.native is not None and on.native_draft is not None and on.kv_cache == "preallocated"
    assert on.forward_path()["target"] == "native" and on.forward_path()["drafter"] == f"native {on.draft_precision}"
    for off in (SpeculativeDecoder(target, drafter, backend="eager"),
                SpeculativeDecoder(target, drafter, backend="smallm", fast_forward=False)):
        assert off.native is None and off.native_draft is None and off.precision == "exact"
        assert off.forward_path()["target"] == "transformers float32 cpu"
        assert off.forward_path()["drafter"] == "transformers" and off.draft_precision == "exact"
    dynamic = SpeculativeDecoder(target, backend="smallm", kv_cache="dynamic")
    assert dynamic.native is None and dynamic.forward_path()["drafter"] is None
    assert len(on.forward_path()) <= 6
    with pytest.raises(ValueError, match="one of .'auto', 'true', 'false'."):
        SpeculativeDecoder(target, backend="smallm", fast_forward="sometimes")
    with pytest.raises(ValueError, match="model.precision=int8 runs on the native stack .model.backend=eager"):
        SpeculativeDecoder(target, backend="eager", precision="int8")
    with pytest.raises(ValueError, match="cannot run on the native stack: model.kv_cache=dynamic"):
        SpeculativeDecoder(target, backend="smallm", kv_cache="dynamic", fast_forward=True)
    layer = target.model.base_model.layers[0]
    act = layer.mlp.act_fn
    try:
        layer.mlp.act_fn = nn.GELU()  # an architecture the native stack does not compute
        assert "MLP activation GELU" in native_reason(target.model.base_model)
        assert SpeculativeDecoder(target, backend="smallm").native is None
        with pytest.raises(ValueError, match="cannot run on the native stack: MLP activation GELU"):
            SpeculativeDecoder(target, backend="smallm", fast_forward=True)
    finally:
        layer.mlp.act_fn = act


@needs_smallm
def test_the_native_draft_runs_only_where_it_may(tiny, eager_afterwards):
    target, drafter = tiny.target("llama"), tiny.drafter("llama", "random")
    assert "is not a DFlash drafter" in draft_native_reason(nn.Linear(4, 4))
    attn = drafter.layers[0].self_attn
    try:
        attn.is_causal = True  # a causal draft layer: the drafter's own forward builds its mask
        assert draft_native_reason(drafter) == "a causal or sliding-window draft layer"
        dec = SpeculativeDecoder(target, drafter, backend="smallm")
        assert dec.native is not None and dec.native_draft is None and dec.draft_precision == "exact"
        with pytest.raises(ValueError, match="the drafter cannot run on the native draft stack: a causal"):
            SpeculativeDecoder(target, drafter, backend="smallm", fast_forward=True)
        with pytest.raises(ValueError, match="model.draft_precision=bf16 runs on the native draft stack"):
            SpeculativeDecoder(target, drafter, backend="smallm", draft_precision="bf16")
    finally:
        attn.is_causal = False


@pytest.mark.parametrize("parents", [None, [-1, 0, 0, 1]])
def test_off_the_native_stack_a_step_is_transformers_own_forward(tiny, arch, parents):
    """The eager decoder's target forward is transformers' forward bit for bit (a tree's rows under ``tree_mask``): its
    hidden states, and its logits are its head's product of transformers' final states (the eager head's transposed
    small-M product equals ``F.linear``'s bits on some CPUs, not on others: 7e-7 apart on an AMD EPYC Zen 4, 2026-12-07)."""
    from pipeline.models.forward import row_depths, tree_mask

    dec = SpeculativeDecoder(tiny.target(arch), tiny.drafter(arch, "random"))
    assert dec.native is None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, dec.lm_head.shape[0], (1, 24), generator=g)
    ours, theirs = new_cache(dec.model, dec.kv_cache), new_cache(dec.model, dec.kv_cache)
    with torch.inference_mode():
        dec.target_forward(ids[:, :20], ours, 0, want_features=False)
        dec.base(input_ids=ids[:, :20], cache=theirs, use_cache=True)
        logits, features = dec.target_forward(ids[:, 20:], ours, 20, want_features=True, parents=parents)
        mask = None if parents is None else tree_mask(parents, 20)
        ref = dec.model(input_ids=ids[:, 20:], position_ids=20 + row_depths(parents, 4)[None], cache=theirs,
                        use_cache=True, output_hidden_states=True, attention_mask=mask)
    assert torch.equal(logits, dec.head(ref.hidden_states[-1][0]).float())
    assert torch.allclose(logits, ref.logits[0].float(), rtol=0, atol=1e-5)
    assert torch.equal(features, dec.drafter.extract_context(ref.hidden_states))


@needs_smallm
def test_the_native_stack_follows_weight_updates(tiny, eager_afterwards):
    dec = SpeculativeDecoder(tiny.target("llama"), backend="smallm")
    ids = torch.arange(1, 6)[None]

    def logits():
        with torch.inference_mode():
            return dec.target_forward(ids, new_cache(dec.model, dec.kv_cache), 0, want_features=False)[0]

    before = logits()
    proj = dec.base.layers[0].self_attn.k_proj
    saved = proj.weight.detach().clone()
    try:
        with torch.no_grad():
            proj.weight.mul_(1.5)  # the stack must be packed again
        after = logits()
        native, dec.native = dec.native, None
        reference = logits()  # transformers' forward on the new weights
        dec.native = native
        assert not torch.equal(after, before)
        torch.testing.assert_close(after, reference, rtol=1e-4, atol=1e-4)
    finally:
        with torch.no_grad():
            proj.weight.copy_(saved)


@needs_smallm
def test_the_native_draft_stack_follows_weight_updates(tiny, eager_afterwards):
    """The drafter's stack is packed again after a weight changes in place (training), and only then."""
    drafter = tiny.drafter("llama", "random")
    dec = SpeculativeDecoder(tiny.target("llama"), drafter, backend="smallm")
    first = dec.native_draft.native_stack()
    assert first is not None and dec.native_draft.native_stack() is first  # unchanged weights: the same stack
    proj = drafter.layers[0].mlp.down_proj
    saved = proj.weight.detach().clone()
    try:
        with torch.no_grad():
            proj.weight.mul_(1.5)
        second = dec.native_draft.native_stack()
        assert second is not first and dec.native_draft.native_stack() is second
    finally:
        with torch.no_grad():
            proj.weight.copy_(saved)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_rotary_table_gives_the_rotary_embeddings_own_bits(tiny, arch):
    """``RotaryTable`` (the native stacks' cos / sin rows looked up by position) against the model's own
    ``rotary_emb`` called on the same rows: the same bits for the target's and the drafter's, for a step's few rows,
    a tree's repeated positions, several requests' rows side by side and a prefill chunk, across the table's growth."""
    from pipeline.models.forward import RotaryTable

    g = torch.Generator().manual_seed(0)
    for rotary in (tiny.target(arch).model.base_model.rotary_emb, tiny.drafter(arch, "random").rotary_emb):
        table = RotaryTable(rotary)
        assert table.static
        like = torch.zeros(1, 1, 8)
        for positions in (torch.tensor([[5]]), torch.tensor([[300, 301, 301, 302, 302, 303]]),
                          torch.arange(700, 956)[None], torch.randint(0, 3000, (1, 40), generator=g),
                          torch.tensor([[17, 18, 2049, 2050, 2051]]), torch.tensor([[0]])):
            cos, sin = table(like, positions)
            want_cos, want_sin = rotary(like, positions)
            assert cos.shape == want_cos[0].shape and torch.equal(cos, want_cos[0]), positions
            assert torch.equal(sin, want_sin[0]), positions
        assert table.cos.shape[0] > 2051  # grown past the first 256 positions
