"""Replay labelling agrees exactly with brute force: the trace is the decoder's B=1 output, and replayed
tau(B) equals what ``SpeculativeDecoder.decode`` records for every B, at T=0 and T>0, with the
max_new_tokens cap and stop tokens, on every draft precision this CPU runs (the replay drafts on the decoder's own
draft forward and head); plus the rank agreement of modelled speed."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import require
from pipeline import PROJECT_ROOT
from pipeline.costs import steps_of
from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.labeling.brute import brute_force, reseed
from pipeline.labeling.oracle import kendall, rank_agreement, spearman
from pipeline.labeling.replay import first_divergence, replay, target_trace
from pipeline.models.backend import smallm_available
from pipeline.models.native import bf16_dot_available, int8_dot_available
from pipeline.prompts import chat_input_ids

# in the tiny drafter's training distribution (long accepted runs) and outside it (tau ~ 1)
PROMPTS = ["def add(a, b):", "Natalia sold clips to 48 of her friends", "Write a function that returns the sum",
           "The quick brown fox"]
ALL_B = list(range(1, 17))
# every draft precision (``model.draft_precision``), each where this CPU runs it (else skipped with the reason)
_SMALLM = smallm_available()
_BF16, _INT8 = _SMALLM and bf16_dot_available(), _SMALLM and int8_dot_available()
DRAFT_PRECISIONS = [
    pytest.param("exact", marks=pytest.mark.skipif(not _SMALLM, reason="the smallm kernel does not build here")),
    pytest.param("bf16", marks=pytest.mark.skipif(not (_SMALLM and _BF16), reason="bf16 draft products need "
                                                  "AVX-512 BF16 and the kernel's avx512 build")),
    pytest.param("int8", marks=pytest.mark.skipif(not (_SMALLM and _INT8), reason="int8 draft products need "
                                                  "AVX-512 VNNI and the kernel's avx512 build")),
]


def ids_of(decoder, text: str) -> torch.Tensor:
    return chat_input_ids(decoder.target.tokenizer, [text])


def brute_and_replay(decoder, text: str, config: DecodeConfig, candidates=ALL_B, lm_head="auto", record_gaps=False):
    prefill = decoder.prefill(ids_of(decoder, text), config)
    brute = brute_force(decoder, prefill, candidates, config)
    trace = target_trace(decoder, reseed(prefill, config), config, record_gaps=record_gaps)
    return brute, trace, replay(decoder, trace, candidates, config, lm_head=lm_head, record_gaps=record_gaps)


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 1), (1.0, 7)])
def test_trace_is_the_autoregressive_decode_with_features(trained_decoder, temperature, seed):
    decoder = trained_decoder
    for text in PROMPTS[:2]:
        config = DecodeConfig(20, temperature, seed)
        ids = ids_of(decoder, text)
        expected = decoder.generate(ids, 1, config).output_ids
        prefill = decoder.prefill(ids, config)
        trace = target_trace(decoder, prefill, config)
        assert trace.tokens == expected
        n = ids.shape[1]
        assert trace.prompt_tokens == n
        assert trace.features.shape == (1, n + len(expected) - 1, prefill.features.shape[-1])
        assert trace.stopped == (expected[-1] in decoder.stop_ids)
        # the features of the fed tokens are the decoder's: a B=2 verify of y[0] returns the same row
        cache = copy.deepcopy(decoder.prefill(ids, config).cache)
        block = torch.tensor([[expected[0]]])
        _, feats = decoder.target_forward(block, cache, n, want_features=True)
        torch.testing.assert_close(trace.features[:, n], feats[:, 0])


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 1)])
@pytest.mark.parametrize("max_new_tokens", [5, 24])
def test_replay_equals_brute_force_for_every_block_size(trained_decoder, temperature, seed, max_new_tokens):
    decoder = trained_decoder
    accepted_drafts = 0
    for text in PROMPTS[:3]:
        config = DecodeConfig(max_new_tokens, temperature, seed)
        brute, trace, replayed = brute_and_replay(decoder, text, config)
        assert trace.tokens == brute.stats[1].output_ids
        for b in ALL_B:
            stats = brute.stats[b]
            assert replayed[b].taus == stats.taus, (text, b)
            assert replayed[b].block_sizes == stats.block_sizes, (text, b)
            assert replayed[b].new_tokens == stats.new_tokens == len(trace.tokens)
            assert replayed[b].tau == pytest.approx(stats.tau, abs=0)
            widths, starts = steps_of(stats)
            assert replayed[b].starts == starts
            accepted_drafts += sum(t - 1 for t in stats.taus)
    assert accepted_drafts >= max_new_tokens  # the trained drafter gets drafts accepted: the test is not vacuous


def test_replay_honours_stop_tokens_like_the_decoder(trained_decoder):
    decoder = trained_decoder
    original = set(decoder.stop_ids)
    try:
        for temperature in (0.0, 0.8):
            config = DecodeConfig(40, temperature, 0)
            y = decoder.generate(ids_of(decoder, PROMPTS[0]), 1, config).output_ids
            for k in (0, 6, 17, 39):  # stop as the first token, mid-output, inside long accepted runs, at the cap
                decoder.stop_ids = original | {y[k]}
                brute, trace, replayed = brute_and_replay(decoder, PROMPTS[0], config)
                assert trace.stopped and trace.tokens == y[: y.index(y[k]) + 1]
                for b in ALL_B:
                    assert (replayed[b].taus, replayed[b].block_sizes) == (brute.stats[b].taus, brute.stats[b].block_sizes)
                    assert replayed[b].new_tokens == brute.stats[b].new_tokens
    finally:
        decoder.stop_ids = original


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lazy_and_full_lm_head_and_batching_agree(trained_decoder, monkeypatch, temperature):
    decoder = trained_decoder
    config = DecodeConfig(30, temperature, 3)
    prefill = decoder.prefill(ids_of(decoder, PROMPTS[2]), config)
    trace = target_trace(decoder, reseed(prefill, config), config)
    assert trace.shortlist.shape == (len(trace.tokens), 32)
    rows = []
    real = decoder.forward.draft_logits  # replay scores draft rows on the decoder's own draft head
    monkeypatch.setattr(decoder.forward, "draft_logits", lambda hidden: rows.append(sum(h.shape[0] for h in hidden))
                        or real(hidden))
    lazy = replay(decoder, trace, ALL_B, config, lm_head="lazy")
    lazy_rows, rows[:] = sum(rows), []
    full = replay(decoder, trace, ALL_B, config, lm_head="full")
    full_rows = sum(rows)
    # proven rejections skip the full LM head: only (about) the accepted drafts pay for it
    accepted = sum(t - 1 for r in full.values() for t in r.taus)
    assert accepted <= lazy_rows < full_rows / 2
    for b in ALL_B:
        alone = replay(decoder, trace, [b], config, lm_head="full")[b]
        assert lazy[b].taus == full[b].taus == alone.taus
    with pytest.raises(ValueError, match="lm_head must be one of"):
        replay(decoder, trace, [4], config, lm_head="fast")
    with pytest.raises(ValueError, match="beyond this drafter's limit"):
        replay(decoder, trace, [17], config)


def test_first_divergence_points_at_the_step_and_gaps(trained_decoder):
    decoder = trained_decoder
    config = DecodeConfig(24, 0.0, 0)
    brute, trace, replayed = brute_and_replay(decoder, PROMPTS[0], config, candidates=[8], record_gaps=True)
    result = replayed[8]
    assert result.taus[0] >= 2  # drafts accepted at the first step
    assert first_divergence(brute.stats[8].taus, result, trace) is None
    assert len(trace.gaps) == len(trace.tokens) and all(g >= 0 for g in trace.gaps)
    assert len(result.gaps) == len(result.taus)
    # pretend brute force accepted one draft fewer at the first step
    taus = list(result.taus)
    taus[0] -= 1
    where = first_divergence(taus, result, trace)
    column = taus[0]
    assert (where["step"], where["brute_tau"], where["replay_tau"]) == (0, taus[0], result.taus[0])
    assert where["position"] == result.starts[0] + column
    assert where["target_gap"] == trace.gaps[where["position"] - trace.prompt_tokens]
    assert where["draft_gap"] == result.gaps[0][column]
    # the draft gap is the drafter's own top-2 margin at that column: its first draft, as the decoder runs it
    n = trace.prompt_tokens
    block = torch.full((1, 8), decoder.drafter.mask_token_id)
    block[0, 0] = trace.tokens[0]
    hidden = decoder.forward.draft_hidden([block], [trace.features[:, :n]], [n], [decoder.new_draft_cache()])[0][0]
    top = decoder.forward.draft_logits([hidden[1:]])[0][column - 1].topk(2).values  # the block's 7 drafts in one call
    assert where["draft_gap"] == float(top[0] - top[1])


# ------------------------------------------------------------------------------------------------
# the cost model's tokens/s against measured ones (the cost model itself: tests/test_costs.py)
# ------------------------------------------------------------------------------------------------
def test_rank_agreement():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert kendall([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    result = rank_agreement([[1, 2, 3], [3, 2, 1]], [[1, 2, 3], [1, 2, 3]], [[4, 5, 6], [4, 5, 6]])
    assert result["spearman"] == pytest.approx(0.0) and result["kendall"] == pytest.approx(0.0)
    assert result["best_agreement"] == pytest.approx(0.5) and result["n_prompts"] == 2
    with pytest.raises(ValueError, match="equal-length"):
        rank_agreement([[1, 2]], [[1, 2, 3]])


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.8, 1)])
def test_replay_equals_brute_force_with_a_draft_vocabulary(trained_decoder, temperature, seed):
    """A drafter restricted to a draft vocabulary proposes argmax over those tokens only; replay must too."""
    from pipeline.decoding import SpeculativeDecoder

    drafter = copy.deepcopy(trained_decoder.drafter)
    vocab_size = trained_decoder.lm_head.shape[0]
    config = DecodeConfig(24, temperature, seed)
    seen = set()
    for text in PROMPTS[:3]:
        seen |= set(trained_decoder.generate(ids_of(trained_decoder, text), 1, config).output_ids)
    # half of the vocabulary, keeping only some of the tokens the target emits: drafts both hit and miss
    keep = sorted(set(range(0, vocab_size, 2)) | set(sorted(seen)[::2]))
    drafter.set_draft_vocab(torch.tensor(keep))
    decoder = SpeculativeDecoder(trained_decoder.target, drafter)
    accepted = 0
    for text in PROMPTS[:3]:
        brute, trace, replayed = brute_and_replay(decoder, text, config, candidates=[1, 2, 4, 8, 12])
        for b in [1, 2, 4, 8, 12]:
            assert replayed[b].taus == brute.stats[b].taus, (text, b)
            accepted += sum(t - 1 for t in brute.stats[b].taus)
    assert accepted > 0


# ------------------------------------------------------------------------------------------------
# every draft precision: the replay drafts on the decoder's own draft forward and head (issue 51)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", DRAFT_PRECISIONS)
@pytest.mark.parametrize("vocab", ["full", "draft"])
def test_replay_equals_brute_force_on_every_draft_precision(tiny, restore_eager, precision, vocab):
    """On the native draft stack with exact, bf16 or int8 products (and the matching LMHead / Bf16Head / Int8Head),
    with a full-vocabulary head (the shortlist screen, where exact) and with a draft vocabulary, the replay's taus are
    brute force's for every B, T and LM-head mode: the drafts it scores are the decoder's, bit for bit."""
    drafter = tiny.drafter("llama", "trained")
    config = DecodeConfig(24, 0.0, 0)
    if vocab == "draft":  # half of the vocabulary, keeping some of the tokens the target emits: drafts hit and miss
        seen = set()
        base = tiny.decoder("llama", "trained")
        for text in PROMPTS[:3]:
            seen |= set(base.generate(ids_of(base, text), 1, config).output_ids)
        drafter = copy.deepcopy(drafter)
        drafter.set_draft_vocab(torch.tensor(sorted(set(range(0, base.lm_head.shape[0], 2)) | set(sorted(seen)[::2]))))
    decoder = SpeculativeDecoder(tiny.target("llama"), drafter, backend="smallm", draft_precision=precision)
    assert decoder.draft_precision == precision and decoder.native_draft.native_stack() is not None
    accepted = 0
    for temperature, seed in ((0.0, 0), (0.8, 1)):
        config = DecodeConfig(24, temperature, seed)
        for text in PROMPTS[:3]:
            brute, trace, lazy = brute_and_replay(decoder, text, config, lm_head="lazy")
            full = replay(decoder, trace, ALL_B, config, lm_head="full")
            confident = replay(decoder, trace, ALL_B, config, lm_head="lazy", record_confidence=True)
            for b in ALL_B:
                stats = brute.stats[b]
                assert lazy[b].taus == full[b].taus == confident[b].taus == stats.taus, (text, temperature, b)
                assert lazy[b].block_sizes == stats.block_sizes
                accepted += sum(t - 1 for t in stats.taus)
    assert accepted > 0  # drafts were accepted: the test is not vacuous
    # the drafter's probabilities it records are the decoder's own, to the bit, at every step of a real decode (the
    # replay's former per-layer float32 drafter moved them: by ~1e-6 on exact products, by ~1e-3 on int8 ones)
    from test_verify_width import manual_decode

    checked = 0
    for temperature, seed in ((0.0, 0), (0.8, 1)):
        config = DecodeConfig(24, temperature, seed)
        ids = ids_of(decoder, PROMPTS[0])
        trace = target_trace(decoder, decoder.prefill(ids, config), config)
        for b in (4, 8):
            result = replay(decoder, trace, [b], config, record_confidence=True)[b]
            steps = manual_decode(decoder, ids, b, config)
            assert len(steps) == len(result.confidence)
            for (_, confidence, _, _, probs, _), samples in zip(steps, result.confidence):
                for j, p, _, top_p, _ in samples:
                    assert p == float(confidence[j - 1])
                    assert top_p == probs[j - 1].tolist()
                    checked += 1
    assert checked > 10


def test_replay_drafts_are_the_decoders_own_draft_call(trained_decoder, monkeypatch):
    """The replay asks the decoder for its draft forward and head (``decoder.forward.draft_hidden`` /
    ``draft_logits``) instead of re-implementing them: a precision added to the decoder reaches the labels."""
    decoder = trained_decoder
    calls = {"hidden": 0, "logits": 0}
    real_hidden, real_logits = decoder.forward.draft_hidden, decoder.forward.draft_logits

    def counted(name, real):
        return lambda *args: calls.__setitem__(name, calls[name] + 1) or real(*args)

    monkeypatch.setattr(decoder.forward, "draft_hidden", counted("hidden", real_hidden))
    monkeypatch.setattr(decoder.forward, "draft_logits", counted("logits", real_logits))
    config = DecodeConfig(12, 0.0, 0)
    trace = target_trace(decoder, decoder.prefill(ids_of(decoder, PROMPTS[0]), config), config)
    result = replay(decoder, trace, [1, 4, 8], config, lm_head="full")
    drafting_steps = max(sum(w > 1 for w in result[b].block_sizes) for b in (4, 8))
    assert calls["hidden"] == drafting_steps and 0 < calls["logits"] <= drafting_steps  # one of each per step


SHIPPED_DRAFTER = PROJECT_ROOT / "data" / "drafters" / "smollm2-135m-instruct-dflash-b8"


@pytest.mark.slow
@pytest.mark.parametrize("precision", DRAFT_PRECISIONS)
def test_replay_equals_brute_force_on_smollm2_on_every_draft_precision(compose_config, precision):
    """The embedded SmolLM2 target with the shipped drafter (a draft vocabulary of 8192 ids), on each draft precision:
    replay's taus are brute force's for every candidate of the label stage's K=9 window (issue 51: on int8 drafts the
    replay once scored float32 drafts, and ``bench_label check=true`` agreed on 0.53 to 0.69 of the pairs)."""
    from pipeline.decoding.build import build_decoder
    from pipeline.prompts import load_prompt_set

    require((SHIPPED_DRAFTER / "config.json").exists(), f"{SHIPPED_DRAFTER.relative_to(PROJECT_ROOT)} is missing")
    decoder = build_decoder(compose_config("evaluate", [f"model.draft_precision={precision}"]).model)
    assert decoder.draft_precision == precision and decoder.native_draft.native_stack() is not None
    candidates = list(range(4, 13))
    accepted = 0
    for k, prompt in enumerate(load_prompt_set("humaneval", limit=3)):
        config = DecodeConfig(48, 0.0 if k < 2 else 0.8, k)
        ids = chat_input_ids(decoder.target.tokenizer, prompt.turns[:1])
        prefill = decoder.prefill(ids, config)
        brute = brute_force(decoder, prefill, candidates, config)
        trace = target_trace(decoder, reseed(prefill, config), config)
        replayed = replay(decoder, trace, candidates, config, record_confidence=True)
        for b in candidates:
            assert replayed[b].taus == brute.stats[b].taus, (prompt.id, b)
            accepted += sum(t - 1 for t in brute.stats[b].taus)
    assert accepted > 0
