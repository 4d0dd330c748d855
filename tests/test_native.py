"""The native decoder stack (``pipeline.models.native.NativeStack``, ``Stack`` in ``kernels/smallm.cpp``) and the
kernel's run-time ISA dispatch (``pipeline.models.kernel``).

- one native call per forward gives the logits and tapped states of the per-layer Python forward on the same kernel
  (to rounding: its norms and SiLU sum in another order) and decodes the same text as transformers' ``generate``
  (``tests/test_backend.py::test_b1_equals_transformers_generate`` runs it on smallm);
- a row's result is the same bits alone, in a 16-row verify, and beside other requests of other lengths;
- the AVX2 and AVX-512 builds give the same bits (products and whole stack), on a CPU that runs both (else skipped
  with the reason); the ISA is chosen from the CPU's flags, and a forced one the CPU lacks is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pipeline import PROJECT_ROOT
from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.models import kernel
from pipeline.models.backend import pack_smallm, set_backend, smallm_available
from pipeline.models.cache import crop_to
from pipeline.models.native import Int8Head, bf16_dot_available, int8_dot_available
from pipeline.models.target import new_cache
from pipeline.timing.limits import floor_ms

needs_smallm = pytest.mark.skipif(not smallm_available(), reason="the smallm kernel does not build on this CPU")


def _context(decoder, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, decoder.lm_head.shape[0], (1, length), generator=g)
    cache = new_cache(decoder.model, decoder.kv_cache)
    with torch.inference_mode():
        decoder.target_forward(ids, cache, 0, want_features=False)
    return cache


@needs_smallm
def test_native_stack_matches_transformers_forward(smallm_decoder):
    dec = smallm_decoder
    native_target = dec.native
    assert dec.native is not None and dec.forward_path()["target"] == "native"
    assert dec.forward_path()["backend"].split()[1] == kernel.kernel_isa()  # avx512, avx512+amx or avx2
    g = torch.Generator().manual_seed(1)
    for width in (1, 3, 8, 16):
        block = torch.randint(3, dec.lm_head.shape[0], (1, width), generator=g)
        cache = _context(dec, 21)
        got = {}
        for native in (True, False):
            dec.native = native_target if native else None
            with torch.inference_mode():
                got[native] = dec.target_forward(block, cache, 21, want_features=True)
            crop_to(cache, 21)
        dec.native = native_target
        (nl, nf), (pl, pf) = got[True], got[False]
        assert nl.shape == pl.shape and nf.shape == pf.shape
        torch.testing.assert_close(nl, pl, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(nf, pf, rtol=1e-4, atol=1e-4)
        assert torch.equal(nl.argmax(-1), pl.argmax(-1))


@needs_smallm
def test_a_long_prefill_runs_on_the_native_stack_and_matches_transformers_forward(smallm_decoder, monkeypatch):
    """A prefill chunk of more than ``SMALLM_MAX_ROWS`` tokens is one native call (exact products); its last logits
    and every position's drafter features match transformers' own forward of the prompt to rounding, and it leaves
    the keys/values the following steps read (the next step's logits match too)."""
    from pipeline.models.backend import SMALLM_MAX_ROWS
    from pipeline.models.native import NativeStack

    dec = smallm_decoder
    n = SMALLM_MAX_ROWS + 19
    native_target = dec.native
    assert native_target.stack() is not None
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, dec.lm_head.shape[0], (1, n + 1), generator=g)
    calls = []
    native_call = NativeStack.__call__
    monkeypatch.setattr(NativeStack, "__call__", lambda self, h, *a, **k: (calls.append(h.shape[0]),
                                                                          native_call(self, h, *a, **k))[1])
    got = {}
    for native in (True, False):
        calls.clear()
        if not native:  # the same prefill on transformers' forward
            dec.native = None
        cache = new_cache(dec.model, dec.kv_cache)
        with torch.inference_mode():
            prefill = dec.target_forward(ids[:, :n], cache, 0, want_features=True, last_only=True)
            step = dec.target_forward(ids[:, n:], cache, n, want_features=True)
        assert calls == ([n, 1] if native else [])  # the prefill in one native call, or none
        got[native] = (prefill, step)
    dec.native = native_target
    (nl, nf), (ns, _) = got[True]
    (pl, pf), (ps, _) = got[False]
    torch.testing.assert_close(nl, pl, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nf, pf, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ns, ps, rtol=1e-4, atol=1e-4)
    assert torch.equal(nl.argmax(-1), pl.argmax(-1)) and torch.equal(ns.argmax(-1), ps.argmax(-1))


@needs_smallm
def test_native_rows_are_the_same_bits_alone_in_a_verify_and_beside_other_requests(smallm_decoder):
    dec = smallm_decoder
    g = torch.Generator().manual_seed(2)
    block = torch.randint(3, dec.lm_head.shape[0], (1, 16), generator=g)
    cache = _context(dec, 30)
    with torch.inference_mode():
        wide, wide_features = dec.target_forward(block, cache, 30, want_features=True)
        crop_to(cache, 30)
        for j in range(16):  # row j alone, after rows 0..j-1 (an autoregressive step at each position)
            alone, features = dec.target_forward(block[:, j: j + 1], cache, 30 + j, want_features=True)
            assert torch.equal(alone[0], wide[j]) and torch.equal(features[0, 0], wide_features[0, j]), j
        others = [_context(dec, n, seed=n) for n in (5, 44)]
        crop_to(cache, 30)
        batched = dec.forward.target([block, block[:, :3], block[:, :1]], [cache, *others], [30, 5, 44],
                                             [True, True, False])
    assert torch.equal(batched[0][0], wide) and torch.equal(batched[0][1], wide_features)


_ISA_PROBE = r"""
import json, sys, torch
from pipeline.models.backend import pack_smallm
from pipeline.models.kernel import smallm_kernel
torch.manual_seed(0)
n, k = 80, 96
d = (torch.rand(n, k // 32, 1) * 0.01 + 1e-3).half().float()
m = (-torch.rand(n, k // 32, 1) * 0.05).half().float()
q = torch.randint(0, 16, (n, k // 32, 32)).float(); q[..., 0] = 0; q[..., 1] = 15
weights = {"q4": ((d * q) + m).view(n, k), "bf16": torch.randn(n, k).bfloat16().float(), "f32": torch.randn(n, k)}
out = {"isa": smallm_kernel().isa()}
for name, w in weights.items():
    packed = pack_smallm(w, exact_rows=32)
    for rows in (1, 5, 16, 21):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        out[f"{name}-{rows}"] = packed(x, None).view(torch.int32).flatten().tolist()
json.dump(out, sys.stdout)
"""


def _probe(isa: str) -> dict:
    env = {**os.environ, kernel.ISA_ENV: isa}
    done = subprocess.run([sys.executable, "-c", _ISA_PROBE], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.slow
@needs_smallm
def test_avx2_and_avx512_builds_give_the_same_bits():
    if "avx512" not in kernel.supported_isas():
        pytest.skip(f"this CPU runs only {kernel.supported_isas()}: the AVX-512 build cannot be compared here")
    wide, narrow = _probe("avx512"), _probe("avx2")
    assert wide.pop("isa") == "avx512" and narrow.pop("isa") == "avx2"
    assert wide == narrow


def test_the_isa_follows_the_cpu_flags_and_a_forced_one_must_exist(monkeypatch):
    avx2 = {"avx2", "fma", "sse4_2"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert kernel.supported_isas(avx2) == ["avx2"]
    assert kernel.supported_isas(avx512) == ["avx512", "avx2"]
    assert kernel.supported_isas(avx2 | {"avx512f"}) == ["avx2"]  # F alone is not enough
    assert kernel.supported_isas({"sse4_2"}) == []
    monkeypatch.setattr(kernel, "cpu_flags", lambda: avx2)
    monkeypatch.delenv(kernel.ISA_ENV, raising=False)
    assert kernel.cpu_isa() == "avx2"
    monkeypatch.setenv(kernel.ISA_ENV, "avx512")
    with pytest.raises(kernel.KernelUnavailableError, match="runs only"):
        kernel.cpu_isa()
    monkeypatch.setenv(kernel.ISA_ENV, "neon")
    with pytest.raises(kernel.KernelUnavailableError, match="not one of"):
        kernel.cpu_isa()
    monkeypatch.setattr(kernel, "cpu_flags", lambda: avx512)
    monkeypatch.setenv(kernel.ISA_ENV, "avx2")
    assert kernel.cpu_isa() == "avx2"


def test_the_floor_is_the_slower_of_reading_the_weights_and_their_products():
    limits = {"read_gb_s": 40.0, "gflop_s": 200.0}
    # 100 MB at 40 GB/s = 2.5 ms; 2 x 100M x rows at 200 GFLOP/s = 1 ms a row
    assert floor_ms(100e6, 100e6, 1, limits) == pytest.approx(2.5)
    assert floor_ms(100e6, 100e6, 2, limits) == pytest.approx(2.5)
    assert floor_ms(100e6, 100e6, 8, limits) == pytest.approx(8.0)


def _q4_exact_target(tiny, arch: str):
    """A fresh copy of the tiny target whose decoder-layer weights hold GGUF Q4_1 values (d * q + m per block of 32
    along K, two roundings), as the embedded SmolLM2 does: the int8 path multiplies exactly such weights."""
    from pipeline.models.target import load_target

    target = load_target(str(tiny.target_dir(arch)))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, lin in target.model.base_model.layers.named_modules():
            if isinstance(lin, torch.nn.Linear):
                n, k = lin.weight.shape
                blocks = lin.weight.view(n, k // 32, 32)
                m = blocks.amin(-1, keepdim=True)
                d = ((blocks.amax(-1, keepdim=True) - m) / 15).half().float().clamp_min(1e-3)
                q = torch.randint(0, 16, blocks.shape, generator=g).float()
                q[..., 0], q[..., 1] = 0, 15
                lin.weight.copy_(((d * q) + m).view(n, k))
        head = target.model.get_output_embeddings().weight  # GGUF Q8_0 values (d * q per block of 32), as SmolLM2's
        n, k = head.shape
        q = torch.randint(-126, 127, (n, k // 32, 32), generator=g).float()
        q[..., 0] = 127
        head.copy_((q * (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()).view(n, k))
    return target


needs_vnni = pytest.mark.skipif(
    not smallm_available() or kernel.cpu_isa() != "avx512" or "avx512_vnni" not in kernel.cpu_flags(),
    reason="model.precision=int8 needs the kernel's AVX-512 build and AVX-512 VNNI, which this CPU lacks")


@needs_vnni
def test_int8_precision_is_lossless_against_its_own_ar_and_close_to_exact(tiny):
    target = _q4_exact_target(tiny, "llama")
    drafter = tiny.drafter("llama", "trained")
    try:
        exact = SpeculativeDecoder(target, drafter, backend="smallm")
        int8 = SpeculativeDecoder(target, drafter, backend="smallm", precision="int8")
        assert int8.forward_path()["precision"] == "int8" and exact.forward_path()["precision"] == "exact"
        assert (int8.head.precision, exact.head.precision) == ("int8", "exact")
        weight = int8.head.weight  # bench_step's floor reads the int8 rows' bytes, not the float32 weight's
        assert int8.head.nbytes < exact.head.nbytes < 0.35 * weight.numel() * weight.element_size()  # float16 scales
        # the q4 layers and the q8 head do run on the int8 products: logits close to the exact ones, not equal
        block = torch.randint(3, exact.lm_head.shape[0], (1, 6), generator=torch.Generator().manual_seed(0))
        got = {}
        for name, dec in (("exact", exact), ("int8", int8)):
            cache = _context(dec, 17)
            with torch.inference_mode():
                got[name] = dec.target_forward(block, cache, 17, want_features=False)[0]
                for j in range(6):  # each row the same bits alone (its own activations' quantization)
                    crop_to(cache, 17 + j)
                    alone = dec.target_forward(block[:, j: j + 1], cache, 17 + j, want_features=False)[0]
                    assert torch.equal(alone[0], got[name][j]), (name, j)
        assert not torch.equal(got["exact"], got["int8"])
        scale = float(got["exact"].abs().max())  # the int8 head's rounding scales with the logits' size
        torch.testing.assert_close(got["int8"], got["exact"], rtol=0.1, atol=0.05 * scale)
        config = DecodeConfig(max_new_tokens=24)
        for text in ("def add(a, b):", "Count to ten.", "The quick brown fox"):
            ids = target.tokenizer(text, return_tensors="pt").input_ids
            ar = int8.generate(ids, 1, config).output_ids
            for B in (2, 4, 8):
                assert int8.generate(ids, B, config).output_ids == ar, (text, B)
    finally:
        set_backend(drafter, "eager")


@needs_vnni
def test_the_int8_head_is_the_integer_product_of_its_quantized_rows_and_each_row_the_same_bits_alone():
    """``linear_q8_int8`` against the exact integer arithmetic it stands for: each row quantized per group of 32 to
    round(x * 127 / max|x|), times the q8 weights, scaled by both scales, in float64 (float32 rounding apart); each row
    the same bits alone and in calls of 1-16 rows."""
    g = torch.Generator().manual_seed(0)
    n, k = 1000, 576
    q = torch.randint(-126, 127, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127  # a block's absmax at 127: GGUF Q8_0's d = absmax / 127
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    packed = pack_smallm((q * d[..., None]).view(n, k), ("q8",))
    assert packed.fmt == "q8"
    head = Int8Head(packed)
    x = torch.randn(16, k, generator=g) * 3
    y = head(x)
    groups = x.view(16, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    qx = torch.round(groups * (127.0 / amax))
    exact = torch.einsum("rgk,ngk->rng", qx.double(), q.double())
    reference = (exact * d.double()[None] * (amax[..., 0].double() / 127.0)[:, None, :]).sum(-1)
    torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-4)
    for rows in (1, 3, 7, 16):
        assert torch.equal(head(x[:rows]), y[:rows]), rows
    with pytest.raises(ValueError, match="q8 form"):
        Int8Head(pack_smallm(torch.randn(32, 64), ()))


@needs_vnni
def _amx_granted() -> bool:
    if not (smallm_available() and kernel.cpu_isa() == "avx512" and "avx512_vnni" in kernel.cpu_flags()):
        return False
    was = kernel.kernel_isa().endswith("+amx")
    granted = kernel.set_amx(True)
    kernel.set_amx(was)
    return granted


@pytest.mark.skipif(not _amx_granted(), reason="this CPU lacks AMX-INT8 (or Linux does not grant this process its tile "
                    "state): the int8 products run on AVX-512 VNNI alone")
def test_the_int8_products_on_amx_tiles_are_the_same_bits_as_on_vnni_alone_and_batched():
    """``linear_q4_int8`` and ``linear_q8_int8`` of 12 or more rows run on AMX tiles where the CPU has them: the same
    integer sums per group and the same scaling order as the VNNI path, so every row's bits are the VNNI path's and its
    own alone, at row counts around the tile sizes (whole, balanced, padded) and a prefill chunk's."""
    from pipeline.models.native import q4_scales, q8_quantize, q8_scales, q8_vnni_layout, vnni_layout

    smallm = kernel.smallm_kernel()
    was = kernel.kernel_isa().endswith("+amx")
    g = torch.Generator().manual_seed(3)
    try:
        for n, k in ((1536, 576), (576, 1536), (40, 64)):  # the last: a part panel of 8 columns
            panels = (n + 15) // 16
            w = vnni_layout(torch.randint(0, 256, (panels, k, 8), dtype=torch.uint8, generator=g))
            scales = q4_scales((torch.rand(panels, k // 32, 16, generator=g) * 0.01).half().float(),
                               (torch.randn(panels, k // 32, 16, generator=g) * 0.01).half().float())
            for rows in (1, 11, 12, 16, 17, 33, 256):
                x = torch.randn(rows, k, generator=g) * 3
                kernel.set_amx(False)
                vnni = smallm.linear_q4_int8(x, w, scales, n)
                assert kernel.set_amx(True)
                amx = smallm.linear_q4_int8(x, w, scales, n)
                assert torch.equal(amx, vnni), (n, k, rows)
                alone = torch.cat([smallm.linear_q4_int8(x[i: i + 1], w, scales, n) for i in range(rows)])
                assert torch.equal(alone, amx), (n, k, rows)
            q8 = q8_quantize(torch.randn(n, k, generator=g))  # the int8 head's and drafts' q8 products
            w8, d8 = q8_vnni_layout(q8.q), q8_scales(q8.d)
            for rows in (1, 12, 17, 64):
                x = torch.randn(rows, k, generator=g)
                kernel.set_amx(False)
                vnni = smallm.linear_q8_int8(x, w8, d8, n)
                kernel.set_amx(True)
                amx = smallm.linear_q8_int8(x, w8, d8, n)
                assert torch.equal(amx, vnni), ("q8", n, k, rows)
                alone = torch.cat([smallm.linear_q8_int8(x[i: i + 1], w8, d8, n) for i in range(rows)])
                assert torch.equal(alone, amx), ("q8", n, k, rows)
        assert kernel.kernel_isa() == "avx512+amx"
    finally:
        kernel.set_amx(was)


def test_a_drafters_weights_round_to_q8_by_gguf_rule_and_its_int8_head_multiplies_them():
    """``q8_quantize`` (the drafter's int8 products): per row and group of 32, as ggml's Q8_0, q = round(w / d) with d =
    absmax / 127, kept as the float16 of d (d'), so the weight it stands for is within d / 2 + 127 |d' - d| of each
    value and a group's largest value is +-127 d'; a weight already of Q8_0's form comes back as its own values.
    ``Int8Head.quantized`` multiplies those rows (the int8 head above)."""
    from pipeline.models.native import q8_quantize

    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 96, generator=g).bfloat16().float()  # a bf16 drafter's weight; 70 rows: a partial panel
    w[3, :32] = 0  # an all-zero group: d = 0, q = 0
    packed = q8_quantize(w)
    dense = packed.dense()
    d = w.view(70, 3, 32).abs().amax(-1) / 127
    stored = d.half().float()
    assert packed.fmt == "q8" and packed.nbytes == 80 * 96 + 80 * 3 * 4  # a byte a weight, a float32 d a group (5 panels)
    bound = d / 2 * (1 + 1e-5) + 127 * (stored - d).abs()
    assert bool(((dense - w).abs().view(70, 3, 32) <= bound[..., None]).all())
    assert torch.equal(dense[3, :32], torch.zeros(32))
    assert torch.equal(dense.view(70, 3, 32).abs().amax(-1), 127 * stored)
    q = torch.randint(-127, 128, (70, 3, 32), generator=g).float()
    q[..., 0] = 127
    scales = 2.0 ** -torch.randint(4, 10, (70, 3, 1), generator=g).float()  # powers of two: absmax / 127 = d exactly
    exact = (q * scales).view(70, 96)
    assert torch.equal(q8_quantize(exact).dense(), exact)
    x = torch.randn(5, 96, generator=g)
    assert torch.equal(Int8Head.quantized(w)(x), Int8Head(packed)(x))
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_quantize(torch.randn(4, 40))


def test_int8_precision_is_refused_off_the_native_stack(tiny):
    with pytest.raises(ValueError, match="model.precision"):
        SpeculativeDecoder(tiny.target("llama"), None, backend="eager", precision="int8")
    with pytest.raises(ValueError, match="must be one of"):
        SpeculativeDecoder(tiny.target("llama"), None, backend="eager", precision="fp8")


@needs_smallm
def test_the_kv_cache_element_is_chosen_once_named_and_sized(tiny):
    """``model.kv_cache_dtype``: ``auto`` is bfloat16 with int8 products and float32 with exact ones; forward_path's
    ``kv_cache`` names it, the prefill's cache holds it and ``kv_bytes_per_token`` (memory sizing) counts its bytes;
    float32 can be asked for on int8; bf16 off the native stack and an unknown name are refused naming the fix."""
    target = tiny.target("llama")
    exact = SpeculativeDecoder(target, None, backend="smallm")
    assert exact.kv_dtype == torch.float32 and exact.forward_path()["kv_cache"] == "preallocated"
    half = SpeculativeDecoder(target, None, backend="smallm", kv_dtype="bf16")
    assert half.kv_dtype == torch.bfloat16 and half.forward_path()["kv_cache"] == "preallocated bf16"
    assert 2 * half.kv_bytes_per_token == exact.kv_bytes_per_token
    prefill = half.prefill(torch.tensor([[5, 9, 14, 3, 8]]), DecodeConfig(max_new_tokens=4), want_features=False)
    assert prefill.cache.layers[0].keys.dtype == torch.bfloat16
    if int8_dot_available():
        assert SpeculativeDecoder(target, None, backend="smallm", precision="int8").kv_dtype == torch.bfloat16
        assert SpeculativeDecoder(target, None, backend="smallm", precision="int8",
                                  kv_dtype="float32").kv_dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype=auto or float32"):
        SpeculativeDecoder(target, None, backend="eager", kv_dtype="bf16")
    with pytest.raises(ValueError, match="must be one of"):
        SpeculativeDecoder(target, None, backend="smallm", kv_dtype="fp8")


needs_bf16 = pytest.mark.skipif(not (smallm_available() and bf16_dot_available()),
                                reason="the drafter's bf16 products need AVX-512 BF16 and the kernel's avx512 build")


def _bf16_reference(drafter):
    """A copy of ``drafter`` on plain PyTorch whose every linear computes bf16(x) @ bf16(W).T in float32: what
    ``model.draft_precision=bf16`` computes, summed in PyTorch's order."""
    import copy

    from torch import nn

    ref = copy.deepcopy(drafter)
    set_backend(ref, "eager")
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
                module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).float(),))
    return ref


def _int8_reference(drafter):
    """A copy of ``drafter`` on plain PyTorch whose every linear computes x' @ W'.T in float32, W' its weight rounded
    to q8 (``q8_quantize``) and x' its input rounded to int8 per row and group of 32 (round(x * 127 / max|x|), scaled
    back): what ``model.draft_precision=int8`` computes, summed in PyTorch's order."""
    import copy

    from torch import nn

    from pipeline.models.native import q8_quantize

    def rounded(x):
        groups = x.reshape(*x.shape[:-1], -1, 32)
        amax = groups.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, 127.0 / amax, 0.0)
        return (torch.round(groups * scale) * (amax / 127.0)).reshape(x.shape)

    ref = copy.deepcopy(drafter)
    set_backend(ref, "eager")
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, nn.Linear):
                packed = q8_quantize(module.weight.float())
                module.weight.copy_((packed.q.float() * packed.d.repeat_interleave(32, 1)).transpose(1, 2)
                                    .reshape(-1, module.weight.shape[1])[: module.weight.shape[0]])
                module.register_forward_pre_hook(lambda _, args: (rounded(args[0]),))
    return ref


@needs_smallm
@pytest.mark.parametrize("precision", ["exact", pytest.param("bf16", marks=needs_bf16),
                                       pytest.param("int8", marks=needs_vnni)])
def test_native_draft_matches_the_drafters_own_forward(tiny, arch, precision):
    """The drafter's forward as one ``DraftStack`` call: its block states and the context keys/values it leaves in the
    (preallocated) draft cache match ``DFlashDraftModel.forward`` on the same kernel to rounding; on bf16 / int8
    products, the drafter's own forward with every linear on rounded inputs and weights (PyTorch's products)."""
    from transformers import DynamicCache

    from pipeline.models.cache import PreallocatedCache

    drafter = tiny.drafter(arch, "random")
    dec = SpeculativeDecoder(tiny.target(arch), drafter, backend="smallm", draft_precision=precision)
    try:
        assert dec.draft_precision == precision and dec.forward_path()["drafter"] == f"native {precision}"
        assert dec.native_draft is not None and dec.native_draft.native_stack() is not None
        assert isinstance(dec.new_draft_cache(), PreallocatedCache)
        reference = {"bf16": _bf16_reference, "int8": _int8_reference}.get(precision, lambda d: d)(drafter)
        # bf16 / int8: an activation near a rounding boundary may round apart
        tolerance = {"bf16": 2e-2, "int8": 3e-2}.get(precision, 1e-4)
        g = torch.Generator().manual_seed(4)
        n_features = drafter.fc.weight.shape[1]
        for context, width in ((9, 4), (2, 8), (40, 3)):  # a first draft over a long prompt's features, then steps
            block = torch.randint(3, dec.lm_head.shape[0], (1, width), generator=g)
            features = torch.randn(1, context, n_features, generator=g)
            positions = torch.arange(0, context + width)[None]
            with torch.inference_mode():
                native_cache, own_cache = PreallocatedCache(), DynamicCache()
                got = dec.draft_forward(dec.embed(block), features, positions, native_cache)
                want = reference(dec.embed(block), features, positions, cache=own_cache)
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
            for mine, theirs in zip(native_cache.layers, own_cache.layers):
                torch.testing.assert_close(mine.keys, theirs.keys, rtol=tolerance, atol=tolerance)
                torch.testing.assert_close(mine.values, theirs.values, rtol=tolerance, atol=tolerance)
    finally:
        set_backend(tiny.target(arch).model, "eager")
        set_backend(drafter, "eager")


@needs_bf16
def test_bf16_products_match_rounded_inputs_and_each_row_is_the_same_bits_alone():
    """``linear_bf16`` (VDPBF16PS) computes bf16(x) @ bf16(W).T in float32 (PyTorch's product of the rounded inputs
    to summation order), and a row's result is the same bits alone and in a call of up to 16 rows."""
    from pipeline.models.kernel import smallm_kernel
    from pipeline.models.native import Bf16Head, bf16_pairs

    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 96, generator=g)  # 70 columns: a partial last panel
    x = torch.randn(16, 96, generator=g)
    pairs = bf16_pairs(w)
    got = smallm_kernel().linear_bf16(x, pairs, 70, None)
    want = x.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 4, 5, 8, 9, 16):
        part = smallm_kernel().linear_bf16(x[:rows], pairs, 70, None)
        for r in range(rows):
            alone = smallm_kernel().linear_bf16(x[r: r + 1], pairs, 70, None)
            assert torch.equal(alone[0], part[r]) and torch.equal(alone[0], got[r]), (rows, r)
    head = Bf16Head(w)
    assert torch.equal(head(x[None])[0], got)


@needs_smallm
@pytest.mark.parametrize("precision", ["exact", pytest.param("bf16", marks=needs_bf16),
                                       pytest.param("int8", marks=needs_vnni)])
def test_every_block_size_is_lossless_on_every_draft_precision(tiny, precision):
    """Drafts only propose: on exact, bf16 or int8 draft products every B decodes the autoregressive text."""
    target, drafter = tiny.target("llama"), tiny.drafter("llama", "trained")
    dec = SpeculativeDecoder(target, drafter, backend="smallm", draft_precision=precision)
    try:
        config = DecodeConfig(max_new_tokens=24)
        for text in ("def add(a, b):", "Count to ten."):
            ids = target.tokenizer(text, return_tensors="pt").input_ids
            ar = dec.generate(ids, 1, config).output_ids
            for B in (2, 4, 8):
                assert dec.generate(ids, B, config).output_ids == ar, (text, B)
    finally:
        set_backend(target.model, "eager")
        set_backend(drafter, "eager")


def test_draft_precision_names_the_fix_when_it_cannot_run(tiny, monkeypatch):
    from pipeline.models import native

    assert native.resolve_draft_precision("exact") == "exact"
    assert native.resolve_draft_precision("auto") == ("int8" if native.int8_dot_available() else "bf16"
                                                      if native.bf16_dot_available() else "exact")
    with pytest.raises(ValueError, match="must be one of"):
        native.resolve_draft_precision("fp8")
    if native.bf16_dot_available():  # off the native draft forward, an explicit bf16 is refused
        with pytest.raises(ValueError, match="draft_precision=bf16 runs on the native draft"):
            SpeculativeDecoder(tiny.target("llama"), tiny.drafter("llama", "random"), backend="eager",
                               draft_precision="bf16")
    monkeypatch.setattr(native, "int8_dot_available", lambda: False)
    assert native.resolve_draft_precision("auto") == ("bf16" if native.bf16_dot_available() else "exact")
    with pytest.raises(ValueError, match="AVX-512 VNNI.*use model.draft_precision=auto or exact"):
        native.resolve_draft_precision("int8")
    monkeypatch.setattr(native, "bf16_dot_available", lambda: False)
    assert native.resolve_draft_precision("auto") == "exact"
    with pytest.raises(ValueError, match="AVX-512 BF16.*use model.draft_precision=auto or exact"):
        native.resolve_draft_precision("bf16")
