"""The speculative decoder: lossless at T=0 for every B, B-invariant sampling at T>0, stop tokens,
the max_new_tokens cap, input errors, schedules and multi-turn requests."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.decoding import DecodeConfig, EMASchedule, FixedSchedule
from pipeline.decoding.conversation import decode_prompt
from pipeline.decoding.sampling import PositionKeyedSampler, argmax_rows, top_indices
from pipeline.prompts import Prompt, chat_input_ids

# Prompts in the tiny drafter's training distribution (accepted drafts) and outside it (tau ~ 1).
PROMPTS = [
    "def add(a, b):",
    "Natalia sold clips to 48 of her friends",
    "The quick brown fox",
    "Write a function that returns the sum",
]
ALL_B = range(2, 17)


def ids_of(decoder, text: str) -> torch.Tensor:
    return chat_input_ids(decoder.target.tokenizer, [text])


def step_spans(stats) -> list[tuple[int, int]]:
    """Output-index range [start, end) of each draft-verify step (index 0 is the prefill's token)."""
    spans, start = [], 1
    for tau in stats.taus:
        spans.append((start, start + tau))
        start += tau
    return spans


# ------------------------------------------------------------------------------------------------
# losslessness at T=0
# ------------------------------------------------------------------------------------------------
def test_lossless_for_every_block_size_with_a_trained_drafter(trained_decoder):
    decoder, config = trained_decoder, DecodeConfig(max_new_tokens=40)
    best_tau, accepted_steps = 0.0, 0
    for text in PROMPTS:
        ids = ids_of(decoder, text)
        reference = decoder.generate(ids, 1, config)
        assert reference.new_tokens == 40 and reference.taus == [1] * 39  # B=1: one token per step
        for B in ALL_B:
            stats = decoder.generate(ids, B, config)
            assert stats.output_ids == reference.output_ids, f"B={B} diverges from ar on {text!r}"
            assert max(stats.block_sizes) <= B and all(1 <= t <= b for t, b in zip(stats.taus, stats.block_sizes))
            assert stats.new_tokens == 1 + sum(stats.taus)
            best_tau = max(best_tau, stats.tau)
            accepted_steps += sum(t > 1 for t in stats.taus)
    # acceptance is really exercised: many steps kept drafted tokens, some requests average tau > 1.5
    assert best_tau > 1.5, best_tau
    assert accepted_steps > 50, accepted_steps


def test_lossless_with_a_random_drafter(tiny, arch):
    decoder, config = tiny.decoder(arch, "random", block_size=4), DecodeConfig(max_new_tokens=24)
    for text in PROMPTS[:2]:
        ids = ids_of(decoder, text)
        reference = decoder.generate(ids, 1, config).output_ids
        for B in ALL_B:
            stats = decoder.generate(ids, B, config)
            assert stats.output_ids == reference, f"{arch}: B={B} diverges from ar on {text!r}"
            assert stats.tau >= 1.0


def test_lossless_with_a_per_step_schedule(trained_decoder):
    decoder, config = trained_decoder, DecodeConfig(max_new_tokens=40)
    ids = ids_of(decoder, PROMPTS[1])
    reference = decoder.generate(ids, 1, config).output_ids
    stats = decoder.generate(ids, EMASchedule([2, 4, 8, 12, 16], alpha=0.5, margin=1.0, start=2), config)
    assert stats.output_ids == reference
    assert stats.block_sizes[0] == 2 and len(set(stats.block_sizes)) >= 2  # B really changed between steps


def test_prefill_can_be_reused_through_deepcopy(trained_decoder):
    decoder, config = trained_decoder, DecodeConfig(max_new_tokens=30)
    ids = ids_of(decoder, PROMPTS[0])
    prefill = decoder.prefill(ids, config)
    assert prefill.last_logits.shape == (decoder.lm_head.shape[0],) and prefill.last_logits.dtype == torch.float32
    assert prefill.features.shape == (1, ids.shape[1], 2 * 64)
    assert prefill.first_token == int(prefill.last_logits.argmax())
    for B in (1, 5, 16):
        stats = decoder.decode(copy.deepcopy(prefill), B, config)
        assert stats.output_ids == decoder.generate(ids, B, config).output_ids


def _with_draft_vocab(decoder, token_ids):
    """A decoder over the same target with a copy of the drafter restricted to ``token_ids``."""
    from pipeline.decoding import SpeculativeDecoder

    drafter = copy.deepcopy(decoder.drafter)
    drafter.set_draft_vocab(torch.tensor(sorted(set(token_ids))))
    return SpeculativeDecoder(decoder.target, drafter)


def test_lossless_with_a_draft_vocabulary(trained_decoder):
    """A drafter restricted to a sub-vocabulary still gives the ar output; covering the output keeps tau."""
    config = DecodeConfig(max_new_tokens=40)
    ids = ids_of(trained_decoder, PROMPTS[1])
    reference = trained_decoder.generate(ids, 1, config).output_ids
    full = trained_decoder.generate(ids, 8, config)
    covering = _with_draft_vocab(trained_decoder, reference + list(range(20)))
    missing = _with_draft_vocab(trained_decoder, [t for t in range(40) if t not in reference] or [0])
    for B in (2, 8, 16):
        assert covering.generate(ids, B, config).output_ids == reference
        assert missing.generate(ids, B, config).output_ids == reference
    assert full.tau > 1.5 and covering.generate(ids, 8, config).tau > 1.5  # drafts still accepted
    assert missing.generate(ids, 8, config).tau == 1.0  # no proposal can match the output


def test_draft_vocabulary_sampling_is_coupled(trained_decoder):
    """At T>0 the restricted drafter uses the same noise columns: outputs stay identical for every B."""
    ids = ids_of(trained_decoder, PROMPTS[1])
    config = DecodeConfig(max_new_tokens=24, temperature=0.7, seed=3)
    reference = trained_decoder.generate(ids, 1, config).output_ids
    decoder = _with_draft_vocab(trained_decoder, reference + list(range(50)))
    for B in (2, 5, 8, 16):
        assert decoder.generate(ids, B, config).output_ids == reference
    logits = torch.randn(3, 60, generator=torch.Generator().manual_seed(1))
    vocab = torch.tensor([3, 7, 11, 50, 59])
    sampler = PositionKeyedSampler(0.7, 3, 60)
    restricted = sampler.pick(logits[:, vocab], 5, vocab)
    noisy = logits / 0.7 + torch.stack([sampler.gumbel(5 + i) for i in range(3)])
    assert restricted.tolist() == vocab[noisy[:, vocab].argmax(-1)].tolist()
    assert PositionKeyedSampler(0.0, 3, 60).pick(logits[:, vocab], 5, vocab).tolist() == vocab[logits[:, vocab].argmax(-1)].tolist()


# ------------------------------------------------------------------------------------------------
# sampling at T>0
# ------------------------------------------------------------------------------------------------
def test_same_seed_same_text_for_every_block_size(trained_decoder):
    decoder = trained_decoder
    ids = ids_of(decoder, PROMPTS[1])
    outputs = {}
    for seed in (0, 1):
        config = DecodeConfig(max_new_tokens=24, temperature=0.7, seed=seed)
        reference = decoder.generate(ids, 1, config).output_ids
        for B in ALL_B if seed == 0 else (3, 8, 16):
            assert decoder.generate(ids, B, config).output_ids == reference, f"seed {seed}: B={B} differs from ar"
        outputs[seed] = reference
    assert outputs[0] != outputs[1], "different seeds should sample different text"
    greedy = decoder.generate(ids, 1, DecodeConfig(max_new_tokens=24)).output_ids
    assert greedy not in outputs.values(), "T=0.7 sampled exactly the greedy text for both seeds"


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_position_keyed_sampler_matches_softmax(temperature):
    """Empirical frequencies over 4000 seeds follow softmax(logits / T); a sampler with the wrong T fails."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])
    n = 4000
    counts = torch.zeros(6)
    for seed in range(n):
        counts[int(PositionKeyedSampler(temperature, seed, 6).pick(logits[None], 7)[0])] += 1
    critical = 20.52  # chi-square, 5 degrees of freedom, p = 0.001
    assert _chi_square(counts, torch.softmax(logits / temperature, -1)) < critical
    for wrong in (temperature / 2, temperature * 2):
        assert _chi_square(counts, torch.softmax(logits / wrong, -1)) > 5 * critical


def test_sampler_noise_depends_only_on_seed_and_position():
    sampler = PositionKeyedSampler(1.0, 3, 50)
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    together = sampler.pick(logits, 10)
    one_by_one = torch.stack([PositionKeyedSampler(1.0, 3, 50).pick(logits[i : i + 1], 10 + i)[0] for i in range(5)])
    assert torch.equal(together, one_by_one)
    assert torch.equal(PositionKeyedSampler(0.0, 3, 50).pick(logits, 10), logits.argmax(-1))
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        PositionKeyedSampler(-0.1, 0, 50)


def test_the_greedy_pick_is_the_first_maximum_as_argmax_takes_it():
    g = torch.Generator().manual_seed(1)
    for case in range(200):
        rows, vocab = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 60000, (1,), generator=g))
        scores = torch.randint(-3, 3, (rows, vocab), generator=g).float()  # many ties per row
        if case % 3 == 0:
            scores[0, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
        if case % 7 == 0:
            scores[-1] = float("-inf")
        assert torch.equal(argmax_rows(scores), scores.argmax(dim=-1))



def test_top_indices_ranks_every_row_as_a_sort_does():
    """``top_indices`` (the drafter's candidates, the recycled candidates and the label stage's shortlists) against a
    plain sort of each row by (NaN first, larger value first, lower column first): rows of the LM head's width and
    small ones, k from 1 to the whole row, with ties, infinities and NaNs; where the k + 1 best are distinct it is
    ``torch.topk``'s."""
    g = torch.Generator().manual_seed(0)

    def reference(row: list[float], k: int) -> list[int]:
        return sorted(range(len(row)), key=lambda j: (row[j] == row[j], -row[j] if row[j] == row[j] else 0.0, j))[:k]

    for case in range(60):
        rows, width = 1 + case % 3, (49152, 8192, 17, 40, 5)[case % 5]
        scores = torch.randn(rows, width, generator=g)
        if case % 4 == 1:  # many ties: a few distinct values
            scores = torch.randint(0, 4, (rows, width), generator=g).float()
        if case % 6 == 2:
            scores[0, int(torch.randint(0, width, (1,), generator=g))] = float("nan")
            scores[-1, :3] = float("-inf")
        if case % 10 == 3:
            scores[0] = float("inf")
        for k in sorted({1, 4, 8, width} & set(range(1, width + 1))):
            got = top_indices(scores, k)
            assert got.shape == (rows, k) and got.dtype == torch.long
            assert got.tolist() == [reference(r, k) for r in scores.tolist()], (case, k)
            distinct = case % 4 != 1 and case % 6 != 2 and case % 10 != 3
            if distinct and k < width:
                assert torch.equal(got, scores.topk(k, dim=-1).indices), (case, k)

def test_decoder_samples_the_first_token_from_the_target_distribution(tiny):
    decoder = tiny.decoder("llama", None)
    ids = ids_of(decoder, "hello world")
    temperature, n = 0.08, 400
    logits = decoder.prefill(ids, DecodeConfig(4)).last_logits
    probs = torch.softmax(logits / temperature, -1)
    counts = torch.zeros_like(probs)
    for seed in range(n):
        counts[decoder.prefill(ids, DecodeConfig(4, temperature, seed)).first_token] += 1
    freq = counts / n
    bound = 0.09  # > 3 standard deviations of a frequency over 400 draws
    assert float((freq - probs).abs().max()) < bound
    # the bound separates the right distribution from a greedy or a temperature-1 sampler
    greedy = torch.nn.functional.one_hot(logits.argmax(), probs.numel()).float()
    assert float((greedy - probs).abs().max()) > 2 * bound
    assert float((torch.softmax(logits, -1) - probs).abs().max()) > 2 * bound


# ------------------------------------------------------------------------------------------------
# stop tokens and the max_new_tokens cap
# ------------------------------------------------------------------------------------------------
def _mid_block_stop(decoder, config):
    """Find (ids, B, reference output, stats without stop, k, step j): the first occurrence of token o[k]
    falls inside step j with accepted tokens after it, so stopping on o[k] cuts that step short."""
    for text in PROMPTS:
        ids = ids_of(decoder, text)
        reference = decoder.generate(ids, 1, config).output_ids
        for B in (8, 12, 16):
            stats = decoder.generate(ids, B, config)
            for j, (start, end) in enumerate(step_spans(stats)):
                for k in range(start, end - 1):
                    if reference.index(reference[k]) == k:
                        return ids, B, reference, stats, k, j
    raise AssertionError("no step accepted a first-occurring token followed by more accepted tokens")


def test_stop_accepted_mid_block_ends_the_output(trained_decoder):
    decoder, config = copy.copy(trained_decoder), DecodeConfig(max_new_tokens=40)
    ids, B, reference, free, k, j = _mid_block_stop(decoder, config)
    decoder.stop_ids = {reference[k]}
    stats = decoder.generate(ids, B, config)
    assert stats.output_ids == reference[: k + 1]
    assert stats.stopped
    assert stats.taus[:-1] == free.taus[:j] and len(stats.taus) == j + 1
    start, end = step_spans(free)[j]
    assert stats.taus[-1] == k + 1 - start < end - start  # tokens accepted after the stop are not counted
    assert stats.new_tokens == k + 1 == 1 + sum(stats.taus) == stats.as_row()["new_tokens"]


def test_stop_beats_the_cap_in_the_same_step(trained_decoder):
    decoder, config = copy.copy(trained_decoder), DecodeConfig(max_new_tokens=40)
    ids, B, reference, _, k, _ = _mid_block_stop(decoder, config)
    decoder.stop_ids = {reference[k]}
    cut_by_cap = False
    for cap in range(k + 1, k + 1 + B):
        stats = decoder.generate(ids, B, DecodeConfig(max_new_tokens=cap))
        assert stats.output_ids == reference[: k + 1] and stats.stopped, f"cap {cap}"
        before_last = 1 + sum(stats.taus[:-1])
        cut_by_cap |= stats.block_sizes[-1] == cap - before_last < B  # the last block was shortened by the cap
    assert cut_by_cap
    stats = decoder.generate(ids, B, DecodeConfig(max_new_tokens=k))  # the cap comes first
    assert stats.output_ids == reference[:k] and not stats.stopped


def test_stop_as_the_first_token(trained_decoder):
    decoder, config = copy.copy(trained_decoder), DecodeConfig(max_new_tokens=20)
    ids = ids_of(decoder, PROMPTS[0])
    first = decoder.generate(ids, 1, config).output_ids[0]
    decoder.stop_ids = {first}
    for B in (1, 8):
        stats = decoder.generate(ids, B, config)
        assert stats.output_ids == [first] and stats.stopped and stats.taus == [] and stats.tau == 0.0


def test_stop_ids_come_from_the_target(tiny):
    decoder = tiny.decoder("llama", "random", block_size=4)
    assert decoder.stop_ids == {decoder.target.tokenizer.eos_token_id} == set(decoder.target.stop_token_ids())


def test_max_new_tokens_is_never_exceeded(trained_decoder):
    decoder = copy.copy(trained_decoder)
    decoder.stop_ids = set()  # only the cap ends these requests
    ids = ids_of(decoder, PROMPTS[1])
    reference = decoder.generate(ids, 1, DecodeConfig(33)).output_ids
    for B in range(1, 17):
        for cap in (1, 2, 5, 16, 33):
            stats = decoder.generate(ids, B, DecodeConfig(cap))
            assert stats.new_tokens == cap and stats.output_ids == reference[:cap], (B, cap)
            assert not stats.stopped and 1 + sum(stats.taus) == cap
            assert all(b <= B for b in stats.block_sizes)


# ------------------------------------------------------------------------------------------------
# input errors
# ------------------------------------------------------------------------------------------------
def test_block_size_errors(trained_decoder, tiny):
    ids = ids_of(trained_decoder, PROMPTS[0])
    for bad in (0, -3):
        with pytest.raises(ValueError, match="block size must be >= 1"):
            trained_decoder.generate(ids, bad, DecodeConfig(8))
    with pytest.raises(ValueError, match=r"beyond this drafter's limit 16 \(trained at B=8\); pick B in 1..16"):
        trained_decoder.generate(ids, 17, DecodeConfig(8))
    with pytest.raises(ValueError, match=r"needs a drafter; load one \(model.drafter=...\) or use B=1"):
        tiny.decoder("llama", None).generate(ids, 4, DecodeConfig(8))
    prefill = trained_decoder.prefill(ids, DecodeConfig(8), want_features=False)
    with pytest.raises(ValueError, match=r"prefill\(want_features=True\)"):
        trained_decoder.decode(prefill, 4, DecodeConfig(8))


def test_a_schedule_going_past_the_limit_is_caught_at_that_step(trained_decoder):
    from pipeline.decoding import Schedule

    class Growing(Schedule):
        max_block_size = 4  # claims 4, then asks for more

        def first(self, last_logits):
            return 2

        def next(self, tau, block_size):
            return 40

    with pytest.raises(ValueError, match="block size 40 is beyond this drafter's limit 16"):
        trained_decoder.generate(ids_of(trained_decoder, PROMPTS[0]), Growing(), DecodeConfig(16))


def test_prompt_errors(trained_decoder):
    with pytest.raises(ValueError, match="prompt is empty"):
        trained_decoder.generate(torch.zeros(1, 0, dtype=torch.long), 4, DecodeConfig(8))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        trained_decoder.generate(ids_of(trained_decoder, PROMPTS[0]), 4, DecodeConfig(0))
    long_prompt = torch.full((1, 500), 42, dtype=torch.long)  # the tiny target has 512 positions
    with pytest.raises(ValueError, match=r"500 tokens \+ max_new_tokens 20 exceeds the target's context of 512 tokens; "
                                         r"shorten the prompt or lower decode.max_new_tokens"):
        trained_decoder.generate(long_prompt, 4, DecodeConfig(20))
    assert trained_decoder.generate(long_prompt, 4, DecodeConfig(12)).new_tokens == 12  # exactly fits


# ------------------------------------------------------------------------------------------------
# schedules, stats, multi-turn
# ------------------------------------------------------------------------------------------------
def test_ema_schedule():
    schedule = EMASchedule([8, 4, 6], alpha=0.5, margin=1.0)
    assert schedule.candidates == [4, 6, 8] and schedule.max_block_size == 8
    assert schedule.first(torch.zeros(3)) == 6  # the middle candidate
    assert schedule.next(6, 6) == 8  # ema 6.0 -> goal 7.0 -> smallest candidate >= 7
    assert schedule.next(1, 8) == 6  # ema 3.5 -> goal 4.5
    assert schedule.next(1, 6) == 4  # ema 2.25 -> goal 3.25
    assert schedule.next(16, 4) == 8  # ema 9.125 -> none >= 10.125 -> the largest
    assert schedule.first(torch.zeros(3)) == 6 and schedule.ema == 6.0  # reset per request
    with pytest.raises(ValueError, match="at least one candidate"):
        EMASchedule([])
    fixed = FixedSchedule(5)
    assert fixed.first(torch.zeros(3)) == fixed.next(1, 5) == fixed.max_block_size == 5


def test_request_stats(trained_decoder):
    stats = trained_decoder.generate(ids_of(trained_decoder, PROMPTS[0]), 8, DecodeConfig(30))
    assert stats.tau == pytest.approx(sum(stats.taus) / len(stats.taus))
    assert stats.tpot_ms == pytest.approx(stats.decode_ms / (stats.new_tokens - 1))
    assert stats.prefill_ms > 0 and stats.decode_ms > 0 and stats.schedule_ms >= 0
    row = stats.as_row()
    assert row["steps"] == len(stats.taus) and row["block_sizes"] == [b for b in sorted(set(stats.block_sizes))]
    assert row["prompt_tokens"] == ids_of(trained_decoder, PROMPTS[0]).shape[1]


def test_multi_turn_prompt(trained_decoder):
    decoder, config = trained_decoder, DecodeConfig(max_new_tokens=20)
    tokenizer = decoder.target.tokenizer
    prompt = Prompt("mt-1", ["def add(a, b):", "Natalia sold clips to 48 of her friends"], "test")
    calls = []

    def make_schedule():
        calls.append(1)
        return FixedSchedule(8)

    stats = decode_prompt(decoder, prompt, make_schedule, config)
    assert len(stats) == 2 and len(calls) == 2  # one fresh schedule per turn
    reply = tokenizer.decode(stats[0].output_ids, skip_special_tokens=True)
    second = chat_input_ids(tokenizer, prompt.turns, [reply])
    assert stats[1].prompt_tokens == second.shape[1] > stats[0].prompt_tokens
    text = tokenizer.decode(second[0])
    assert text.count("<|im_start|>user\n") == 2 and f"<|im_start|>assistant\n{reply}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ar = decode_prompt(decoder, prompt, lambda: FixedSchedule(1), config)
    assert [s.output_ids for s in ar] == [s.output_ids for s in stats]  # lossless across turns
