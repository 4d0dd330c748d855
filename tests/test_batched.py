"""The batched step (``pipeline.decoding.batched``, ``pipeline.models.forward``): every request's rows bit
for bit those of its decode alone, and every request's text its autoregressive text, whatever shares the step.

- the smallm kernel's rows are invariant at every row count 1..64 in every packed form; ``packed_linear`` is not
  beyond ``SMALLM_MAX_ROWS`` (it hands those to PyTorch's GEMM), so the batched forward chunks at that limit;
- the batched target and draft forwards give each request's logits, features, drafter hidden states and caches
  exactly (``torch.equal``) as its solo forward, for mixes of widths and contexts (long prompts' first drafts too);
- property test (hypothesis): random prompts, arrival steps, block sizes (1 = a plain step, no drafter), forced
  verify widths, stop ids taken from the reference output (stops mid-block), max_new_tokens caps and T in {0, 0.7}:
  each request's output equals its solo autoregressive decode (T=0: also its solo speculative decode);
- on ``eager`` (not row-invariant) the batched step runs each request's forward alone and is still exact;
- a request cancelled mid-decode leaves the batch and the others are unaffected;
- slow: the real SmolLM2 target with the shipped drafter, four HumanEval prompts batched under every method.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import require
from pipeline import PROJECT_ROOT
from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.decoding.batched import BatchedDecoder
from pipeline.decoding.scheduler import decode_all
from pipeline.decoding.schedules import BatchPolicy
from pipeline.decoding.schedules import FixedSchedule
from pipeline.models.backend import EXACT_FORMATS, SMALLM_MAX_ROWS, PackedLinear, pack_smallm, set_backend, smallm_available
from pipeline.models.forward import by_rows
from pipeline.models.target import new_cache

needs_smallm = pytest.mark.skipif(not smallm_available(), reason="the smallm kernel does not build on this CPU")


def _exact_weight(fmt: str, n: int = 80, k: int = 64) -> torch.Tensor:
    """A weight whose values a smallm form ``fmt`` holds exactly (f32: any)."""
    g = torch.Generator().manual_seed(1)
    if fmt == "f32":
        return torch.randn(n, k, generator=g)
    if fmt == "bf16":
        return torch.randn(n, k, generator=g).bfloat16().float()
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
    if fmt == "q8":
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
        q[..., 0] = 127  # every block's absmax is 127 d
        return (d * q).reshape(n, k)
    m = (torch.rand(n, k // 32, 1, generator=g) * 0.01).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # every block spans 0..15: its minimum is m, its range 15 d
    return ((d * q) + m).reshape(n, k)


@needs_smallm
@pytest.mark.parametrize("fmt", ["f32", *EXACT_FORMATS])
def test_smallm_rows_invariant(fmt):
    """Each row of a smallm product is the same bits alone or with up to 63 others (every packed form, both sides
    of the exact/float32 crossover, row tiles of 1-6); a PackedLinear (packed_linear) is too once chunked at
    the row limit; zero rows give an empty product."""
    w = _exact_weight(fmt)
    packed = pack_smallm(w, () if fmt == "f32" else EXACT_FORMATS, exact_rows=3)  # f32 panels beyond 3 rows
    assert packed.fmt == fmt
    x = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(2))
    alone = torch.cat([packed(x[i: i + 1], None) for i in range(64)])
    for rows in range(1, 65):
        assert torch.equal(packed(x[:rows], None), alone[:rows]), rows
    assert packed(x[:0], None).shape == (0, w.shape[0])  # no rows (a drafter's empty context): an empty product
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    set_backend(linear, "smallm")
    assert type(linear) is PackedLinear
    with torch.inference_mode():
        single = torch.cat([linear(x[i: i + 1]) for i in range(64)])
        for rows in (1, 5, 32, 33, 48, 64):
            assert torch.equal(by_rows(linear, x[:rows]), single[:rows]), rows


def test_head_calls_stay_on_the_row_invariant_path():
    """Every call ``by_rows`` hands a head has at most ``SMALLM_MAX_ROWS`` rows (``packed_linear`` sends wider calls to
    PyTorch's GEMM, which is not row-invariant); the outputs are each row's own, in order."""
    calls: list[int] = []

    def head(x):
        calls.append(x.shape[0])
        return x * 2

    g = torch.Generator().manual_seed(0)
    for rows in (1, SMALLM_MAX_ROWS, SMALLM_MAX_ROWS + 1, 3 * SMALLM_MAX_ROWS + 5):
        calls.clear()
        x = torch.randn(rows, 4, generator=g)
        assert torch.equal(by_rows(head, x), x * 2)
        assert max(calls) <= SMALLM_MAX_ROWS and sum(calls) == rows, (rows, calls)


@needs_smallm
def test_kernel_attention_rows_invariant_and_equal_to_sdpa():
    """``attend``: each row's output is the same bits alone, in its request's verify, or among other requests' rows
    (up to 40 rows, past the row limit), whatever the cache's layout (the filled part of a larger buffer), with GQA; its
    in-call append (``k_new``/``v_new`` written into the buffers) gives the same bits as appending first and leaves the
    buffers holding exactly the cache; and it is causal attention: equal to PyTorch's SDPA with the causal mask to
    float32 rounding."""
    from pipeline.models.kernel import smallm_kernel

    def attend(q, keys, values, rows, scale, k_new=None, v_new=None, lengths=None):
        lengths = [k.shape[1] for k in keys] if lengths is None else lengths
        return smallm_kernel().attend(q, k_new, v_new, keys, values, rows, lengths, scale)

    g = torch.Generator().manual_seed(5)
    hq, hkv, d = 6, 2, 64
    lengths, rows = [9, 50, 23, 31, 2], [4, 16, 1, 17, 2]  # cache lengths after the new rows; 40 query rows
    keys = [torch.randn(hkv, n, d, generator=g) for n in lengths]
    values = [torch.randn(hkv, n, d, generator=g) for n in lengths]
    q = torch.randn(sum(rows), hq, d, generator=g)
    together = attend(q, keys, values, rows, 0.125)
    assert together.shape == (sum(rows), hq * d)
    # the same call appending the new rows itself: buffers with spare room, holding only the old positions
    buffers_k = [torch.full((hkv, n + 5, d), float("nan")) for n in lengths]
    buffers_v = [torch.full((hkv, n + 5, d), float("nan")) for n in lengths]
    for bk, bv, k, v, r in zip(buffers_k, buffers_v, keys, values, rows):
        bk[:, : k.shape[1] - r] = k[:, : k.shape[1] - r]
        bv[:, : v.shape[1] - r] = v[:, : v.shape[1] - r]
    k_new = torch.cat([k[:, k.shape[1] - r:] for k, r in zip(keys, rows)], dim=1).transpose(0, 1)  # [R, Hkv, D] strided
    v_new = torch.cat([v[:, v.shape[1] - r:].transpose(0, 1) for v, r in zip(values, rows)])  # [R, Hkv, D] contiguous
    assert torch.equal(attend(q, buffers_k, buffers_v, rows, 0.125, k_new, v_new, lengths), together)
    for bk, bv, k, v in zip(buffers_k, buffers_v, keys, values):
        assert torch.equal(bk[:, : k.shape[1]], k) and torch.equal(bv[:, : v.shape[1]], v)
        assert bk[:, k.shape[1]:].isnan().all()  # nothing written past each length
    start = 0
    for k, v, r in zip(keys, values, rows):
        qi = q[start: start + r]
        alone = attend(qi, [k], [v], [r], 0.125)
        assert torch.equal(alone, together[start: start + r])
        for j in range(r):  # each row alone over the keys it may see
            assert torch.equal(attend(qi[j: j + 1], [k[:, : k.shape[1] - r + j + 1]], [v[:, : k.shape[1] - r + j + 1]],
                                      [1], 0.125), alone[j: j + 1])
        n = k.shape[1]
        mask = torch.ones(r, n, dtype=torch.bool).tril(diagonal=n - r)
        ref = torch.nn.functional.scaled_dot_product_attention(qi.transpose(0, 1), k.repeat_interleave(hq // hkv, 0),
                                                               v.repeat_interleave(hq // hkv, 0), attn_mask=mask,
                                                               scale=0.125)
        torch.testing.assert_close(alone, ref.transpose(0, 1).reshape(r, -1), rtol=1e-5, atol=1e-5)
        start += r
    with pytest.raises(RuntimeError, match="rows do not add up"):
        attend(q, keys, values, [rows[0] - 1, *rows[1:]], 0.125)
    with pytest.raises(RuntimeError, match="more query rows than keys"):
        attend(q[:3], [keys[4]], [values[4]], [3], 0.125)
    with pytest.raises(RuntimeError, match="exceeds its keys' capacity"):
        attend(q[:3], [keys[4]], [values[4]], [3], 0.125, lengths=[5])


@needs_smallm
def test_kernel_attention_over_a_bf16_cache_is_its_float32_attention_over_the_rounded_values():
    """A bfloat16 KV cache (``model.kv_cache_dtype=bf16``, the int8 default): ``attend`` widens each key and value
    exactly, so its output is the same bits as over a float32 cache holding the rounded values (decode rows, a
    verify's 12 paired queries, a draft tree, a prompt's chunk), each row the same bits alone and batched; its in-call
    append rounds the new rows to nearest even (torch's ``.bfloat16()``); and it is causal attention over the rounded
    values to float32 rounding (SDPA)."""
    from pipeline.models.kernel import smallm_kernel

    attend = smallm_kernel().attend
    g = torch.Generator().manual_seed(7)
    hq, hkv, d = 9, 3, 64
    lengths, rows = [300, 40, 16, 7], [4, 1, 16, 3]  # a verify, a decode row, a prompt chunk, a tree
    parents = [-1, 0, 1, 2, -1, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, -1, 0, 0]
    q = torch.randn(sum(rows), hq, d, generator=g)
    k_new, v_new = torch.randn(sum(rows), hkv, d, generator=g), torch.randn(sum(rows), hkv, d, generator=g)
    rounded_k = [torch.randn(hkv, n + 3, d, generator=g).bfloat16() for n in lengths]
    rounded_v = [torch.randn(hkv, n + 3, d, generator=g).bfloat16() for n in lengths]
    for tree in ([], parents):
        k16, v16 = [k.clone() for k in rounded_k], [v.clone() for v in rounded_v]
        k32, v32 = [k.float() for k in rounded_k], [v.float() for v in rounded_v]
        got = attend(q, k_new, v_new, k16, v16, rows, lengths, 0.125, tree)
        want = attend(q, k_new.bfloat16().float(), v_new.bfloat16().float(), k32, v32, rows, lengths, 0.125, tree)
        assert torch.equal(got, want)
        assert all(torch.equal(a.float(), b) for a, b in zip(k16 + v16, k32 + v32))  # the append rounded alike
        start = 0
        for i, (n, r) in enumerate(zip(lengths, rows)):  # each request alone: the same bits
            sub = [p for p in tree[start: start + r]] if tree else []
            alone = attend(q[start: start + r], None, None, [k16[i]], [v16[i]], [r], [n], 0.125, sub)
            assert torch.equal(alone, got[start: start + r]), i
            if not tree:
                mask = torch.ones(r, n, dtype=torch.bool).tril(diagonal=n - r)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q[start: start + r].transpose(0, 1), k32[i][:, :n].repeat_interleave(hq // hkv, 0),
                    v32[i][:, :n].repeat_interleave(hq // hkv, 0), attn_mask=mask, scale=0.125)
                torch.testing.assert_close(alone, ref.transpose(0, 1).reshape(r, -1), rtol=1e-5, atol=1e-5)
            start += r
    with pytest.raises(RuntimeError, match="every request's alike"):
        attend(q[:5], None, None, [rounded_k[0], rounded_k[1].float()], [rounded_v[0], rounded_v[1].float()], [4, 1],
               [300, 40], 0.125)


def _contexts(decoder, lengths, seed=0):
    """Caches and features of prompts of the given lengths (random ids), prefilled alone."""
    g = torch.Generator().manual_seed(seed)
    vocab = decoder.lm_head.shape[0]
    out = []
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(3, vocab, (1, n), generator=g)
            cache = new_cache(decoder.model, decoder.kv_cache)
            _, features = decoder.target_forward(ids, cache, 0, want_features=True)
            out.append((ids, cache, features))
    return out


@needs_smallm
def test_batched_forwards_are_bit_identical_to_solo(tiny, arch, restore_eager):
    decoder = SpeculativeDecoder(tiny.target(arch), tiny.drafter(arch, "random"), backend="smallm")
    batched = decoder.forward
    assert batched.exact and decoder.native_draft is not None
    lengths, widths = [3, 40, 7, 12, 25, 9], [1, 4, 16, 9, 2, 12]  # 44 verified rows in all: two chunks
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randint(3, decoder.lm_head.shape[0], (1, q), generator=g) for q in widths]
    solo, together = _contexts(decoder, lengths), _contexts(decoder, lengths)
    with torch.inference_mode():
        expected = [decoder.target_forward(b, c, n, want_features=True) for b, (_, c, _), n in zip(blocks, solo, lengths)]
        got = batched.target(blocks, [c for _, c, _ in together], lengths, [True, False, True, True, True, False])
    for i, ((el, ef), (gl, gf)) in enumerate(zip(expected, got)):
        assert torch.equal(el, gl), i
        assert (gf is None) if i in (1, 5) else torch.equal(ef, gf), i
        for layer in range(len(solo[i][1].layers)):
            assert torch.equal(solo[i][1].layers[layer].keys, together[i][1].layers[layer].keys)
    # the drafter: each block with its pending context features (a whole prompt's on a first draft: 40 > 32 rows)
    pending = [n if n > 30 else min(2, n) for n in lengths]
    sizes = [4, 8, 2, 16, 3, 5]
    drafts = [torch.randint(3, decoder.lm_head.shape[0], (1, b), generator=g) for b in sizes]

    def caches():
        out = []
        for (_, _, f), n, p in zip(solo, lengths, pending):
            dc = decoder.new_draft_cache()
            if n > p:
                decoder.draft_forward(decoder.embed(drafts[0][:, :1]), f[:, : n - p], torch.arange(0, n - p + 1)[None], dc)
                dc.crop(-1)
            out.append(dc)
        return out

    with torch.inference_mode():
        solo_caches, batch_caches = caches(), caches()
        alone = [decoder.draft_forward(decoder.embed(b), f[:, n - p:], torch.arange(n - p, n + b.shape[1])[None], dc)
                 for b, (_, _, f), n, p, dc in zip(drafts, solo, lengths, pending, solo_caches)]
        hidden = batched.draft_hidden(drafts, [f[:, n - p:] for (_, _, f), n, p in zip(solo, lengths, pending)], lengths,
                                      batch_caches)
        heads = batched.draft_logits([h[0, 1:] for h in hidden])
    for i in range(len(sizes)):
        assert torch.equal(alone[i], hidden[i]), i
        assert torch.equal(decoder.drafter_head(alone[i][0, 1:]).float(), heads[i]), i
        assert torch.equal(solo_caches[i].layers[0].keys, batch_caches[i].layers[0].keys), i


class ForcedWidths(BatchPolicy):
    """A batch policy giving every drafting request a random k in 0..b-1 (seeded) and sometimes skipping the drafter
    (b = 1), and admitting a request as autoregressive now and then."""

    joint_widths = True

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def admit(self, schedule, load):
        return FixedSchedule(1) if self.rng.random() < 0.1 else schedule

    def plan(self, requests, sizes):
        return [1 if self.rng.random() < 0.2 else b for b in sizes]

    def allocate(self, requests, confidences):
        return [self.rng.randint(0, len(c)) for c in confidences]


def _workload(decoder, data, n_max=6):
    vocab = decoder.lm_head.shape[0]
    texts = ["def add(a, b):", "Natalia sold clips to 48 of", "The quick brown fox", "def fib(n):"]
    n = data.draw(st.integers(1, n_max), label="requests")
    prompts, configs, schedules, arrivals = [], [], [], []
    for _ in range(n):
        text = data.draw(st.sampled_from(texts + [None]))
        if text is None:
            prompt = data.draw(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=40))
        else:
            prompt = decoder.target.tokenizer(text)["input_ids"]
        prompts.append(torch.tensor([prompt]))
        configs.append(DecodeConfig(data.draw(st.integers(1, 30)), data.draw(st.sampled_from([0.0, 0.0, 0.7])),
                                    data.draw(st.integers(0, 50))))
        schedules.append(data.draw(st.integers(1, decoder.drafter.max_block_size)))
        arrivals.append(data.draw(st.integers(0, 6)))
    return prompts, configs, schedules, arrivals


@needs_smallm
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batched_decode_equals_each_request_alone(tiny, arch, data, restore_eager):
    decoder = SpeculativeDecoder(tiny.target(arch), tiny.drafter(arch, "trained"), backend="smallm")
    prompts, configs, schedules, arrivals = _workload(decoder, data)
    # stop ids taken from a free-running output: stops mid-block
    free = decoder.generate(prompts[0], 1, DecodeConfig(30)).output_ids
    decoder.stop_ids = set(data.draw(st.lists(st.sampled_from(free), max_size=2, unique=True), label="stops"))
    ar = [decoder.generate(p, 1, c).output_ids for p, c in zip(prompts, configs)]
    spec = [decoder.generate(p, b, c).output_ids for p, b, c in zip(prompts, schedules, configs)]
    assert spec == ar  # the solo decoder's own losslessness (the reference for what follows)
    max_batch = data.draw(st.sampled_from([None, 2]), label="max_batch")
    got = decode_all(decoder, prompts, schedules, configs, arrivals, max_batch=max_batch)
    assert [r.stats.output_ids for r in got] == ar
    assert all(r.done and (r.stats.stopped or r.stats.new_tokens == c.max_new_tokens) for r, c in zip(got, configs))
    policy = ForcedWidths(data.draw(st.integers(0, 100), label="width seed"))
    forced = decode_all(decoder, prompts, schedules, configs, arrivals, policy=policy)
    assert [r.stats.output_ids for r in forced] == ar
    for r in forced:  # every step's tokens are its accepted drafts (<= k) plus one
        assert sum(r.stats.taus) + 1 == len(r.stats.output_ids)
        assert all(t <= k + 1 for t, k in zip(r.stats.taus, r.stats.verify_widths))


@needs_smallm
def test_plain_steps_and_skipped_drafts(trained_decoder, tiny, restore_eager):
    """B = 1 for everyone (batched ar: one row each, no drafter call) and a mix of drafting and skipping requests."""
    decoder = SpeculativeDecoder(tiny.target("llama"), tiny.drafter("llama", "trained"), backend="smallm")
    tok = decoder.target.tokenizer
    prompts = [torch.tensor([tok(t)["input_ids"]]) for t in ["def add(a, b):", "The quick brown fox", "def fib(n):"]]
    configs = [DecodeConfig(24), DecodeConfig(17), DecodeConfig(9)]
    ar = [decoder.generate(p, 1, c).output_ids for p, c in zip(prompts, configs)]
    batch = BatchedDecoder(decoder)
    reqs = [batch.add(p, 1, c) for p, c in zip(prompts, configs)]
    assert all(r.state.draft_cache is None for r in reqs)
    batch.run()
    assert [r.stats.output_ids for r in reqs] == ar
    assert batch.rows[0] == (3, 0, 3, 0)  # one row per request, no drafter forward
    assert all(v[1] == 0 and v[0] == v[2] for v in batch.rows)
    assert all(set(r.stats.verify_widths) == {0} for r in reqs)
    class OddDraft(BatchPolicy):
        def plan(self, requests, sizes):
            return [b if i % 2 else 1 for i, b in enumerate(sizes)]

    mixed = decode_all(decoder, prompts, [8, 1, 4], configs, policy=OddDraft())
    assert [r.stats.output_ids for r in mixed] == ar
    assert set(mixed[0].stats.block_sizes) == {1} and max(mixed[2].stats.block_sizes) == 1


def test_eager_runs_each_request_alone_and_exactly(tiny):
    decoder = tiny.decoder("llama", "trained")  # eager: GEMMs are not row-invariant
    assert not decoder.forward.exact
    tok = decoder.target.tokenizer
    prompts = [torch.tensor([tok(t)["input_ids"]]) for t in ["def add(a, b):", "Natalia sold clips to 48 of"]]
    configs = [DecodeConfig(20, 0.7, 3), DecodeConfig(20)]
    got = decode_all(decoder, prompts, [4, 8], configs, arrivals=[0, 2])
    assert [r.stats.output_ids for r in got] == [decoder.generate(p, 1, c).output_ids for p, c in zip(prompts, configs)]


def test_cancel_frees_the_slot(tiny):
    decoder = tiny.decoder("llama", "trained")
    tok = decoder.target.tokenizer
    prompts = [torch.tensor([tok(t)["input_ids"]]) for t in ["def add(a, b):", "The quick brown fox"]]
    seen: list[int] = []
    batch = BatchedDecoder(decoder)
    stopper = batch.add(prompts[0], 4, DecodeConfig(30), on_tokens=lambda new: seen.extend(new) or len(seen) >= 5)
    other = batch.add(prompts[1], 4, DecodeConfig(30))
    cancelled = batch.add(prompts[1], 4, DecodeConfig(30))
    batch.step()
    batch.cancel(cancelled)
    assert cancelled.done and cancelled.halted and cancelled not in batch.active
    batch.run()
    assert stopper.halted and stopper.stats.output_ids == seen and len(seen) >= 5
    full = decoder.generate(prompts[0], 1, DecodeConfig(30)).output_ids
    assert seen == full[: len(seen)]
    assert other.stats.output_ids == decoder.generate(prompts[1], 1, DecodeConfig(30)).output_ids
    with pytest.raises(ValueError, match="max_batch"):
        decode_all(decoder, prompts, [4, 4], [DecodeConfig(4)] * 2, max_batch=0)


@pytest.mark.slow
def test_real_target_batched_methods_equal_batch1_ar(compose_config):
    from pipeline.decoding.build import build_decoder
    from pipeline.policy import setup
    from pipeline.prompts import chat_input_ids, load_prompt_set

    drafter_dir = PROJECT_ROOT / "data" / "drafters" / "smollm2-135m-instruct-dflash-b8"
    require((drafter_dir / "config.json").exists(), "the shipped drafter is not there (make draft)")
    decoder = build_decoder(compose_config("evaluate", ["model.precision=exact"]).model)
    assert decoder.backend == "smallm" and decoder.forward.exact
    prompts = [chat_input_ids(decoder.target.tokenizer, p.turns) for p in load_prompt_set("humaneval", limit=4)]
    configs = [DecodeConfig(24), DecodeConfig(16), DecodeConfig(24, 0.8, 5), DecodeConfig(20)]
    ar = [decoder.generate(p, 1, c).output_ids for p, c in zip(prompts, configs)]
    cfg = compose_config("bench_batch", ["policy.budget.costs.rows=[1,4,16,32]", "policy.budget.costs.repeats=1",
                                         "policy.budget.costs.context=64", "policy.budget.costs.cache=null",
                                         "policy.verify_width.latency.cache=null", "policy.verify_width.latency.repeats=1",
                                         "policy.verify_width.latency.context_buckets=[64]", "bench.concurrency=[4]"])
    methods = ["ar", "fixed", "verify_width", "budget"]
    src = setup.Sources("bench", None, max_requests=4)
    inputs = setup.load_inputs(cfg, decoder, methods, src)
    for method, factory in setup.build_methods(cfg, decoder, inputs, methods, src).items():
        got = decode_all(decoder, prompts, [factory() for _ in prompts], configs, arrivals=[0, 0, 1, 3],
                         policy=factory.batch)
        assert [r.stats.output_ids for r in got] == ar, method


# ---------------------------------------------------------------------------------------------------
# continuous batching in the server (pipeline.serving.engine)
# ---------------------------------------------------------------------------------------------------
def test_batch_engine_serves_each_request_its_ar_text_and_frees_cancelled_slots(trained_decoder):
    import asyncio
    import json

    import httpx

    from pipeline.prompts import messages_input_ids
    from pipeline.serving.app import create_app
    from pipeline.serving.engine import Engine, Job, QueueFull
    from policy_fixtures import served_method

    texts = ["def add(a, b):", "Natalia sold clips to 48 of her friends.", "Write a function that sums a list."]
    tok = trained_decoder.target.tokenizer
    ids = {t: messages_input_ids(tok, [{"role": "user", "content": t}]) for t in texts}
    references = {t: trained_decoder.generate(ids[t], 1, DecodeConfig(10)).output_ids for t in texts}
    engine = Engine(trained_decoder, served_method("fixed", trained_decoder), "tiny", max_queue=2, default_max_tokens=10,
                    max_batch=4)
    app = create_app(engine)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=120) as c:
            bodies = [{"model": "tiny", "messages": [{"role": "user", "content": texts[i % 3]}], "max_tokens": 10,
                       "return_token_ids": True, "stream": i % 2 == 1} for i in range(6)]
            served = await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))
        # direct jobs: two cancel themselves after their first text, one runs to the end, the rest are refused
        jobs = [Job(f"j{i}", ids[texts[i % 3]], DecodeConfig(40)) for i in range(9)]
        for job in jobs[:2]:
            job.on_text = lambda text, job=job: job.cancelled.set()
        tasks = [asyncio.ensure_future(engine.run(j)) for j in jobs]
        return served, await asyncio.gather(*tasks, return_exceptions=True)

    try:
        served, direct = asyncio.run(scenario())
        assert not engine.batch.active and engine.in_flight == 0
        assert max(v[2] for v in engine.batch.rows) > 1  # requests did share steps
    finally:
        engine.close()
    for i, response in enumerate(served):
        assert response.status_code == 200
        body = [json.loads(e.removeprefix("data: ")) for e in response.text.splitlines()
                if e.startswith("data: ") and e != "data: [DONE]"][-1] if i % 2 else response.json()
        assert body["blockpilot"]["token_ids"] == references[texts[i % 3]]
    assert [type(d) for d in direct[6:]] == [QueueFull] * 3  # 4 running + 2 waiting = 6 slots
    assert all(d.finish_reason == "abort" for d in direct[:2])
    full = trained_decoder.generate(ids[texts[2]], 1, DecodeConfig(40)).output_ids
    assert direct[2].output_ids == full and direct[2].finish_reason in ("length", "stop")
    assert engine.served == 6 + 6 and engine.failed == 0
