"""Property-based check of the decoder against transformers' own greedy ``generate`` (issue 15 item 11).

Hypothesis draws prompts (random token ids), a block size B, ``max_new_tokens`` and stop ids (some taken from
the reference output so that stops mid-block happen) on the tiny Llama and Qwen3 targets with drafters trained on
their outputs. At T=0 the decoder's output must equal ``generate(do_sample=False)`` with the same stopping, for
every B; at T>0 (position-keyed sampling) every B must give the B=1 text. Examples are derandomized, so CI runs
the same cases every time.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.decoding import DecodeConfig

EXAMPLES = 30


def _hf_greedy(model, prompt: list[int], max_new_tokens: int, stops: list[int], pad: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stops, pad_token_id=pad)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_decoder_equals_transformers_generate_for_every_block_size(tiny, arch, data):
    decoder = tiny.decoder(arch, "trained")  # a fresh decoder: its stop ids can be set per example
    model, vocab = decoder.target.model, decoder.lm_head.shape[0]
    pad = decoder.target.tokenizer.pad_token_id
    # prompts from the drafter's own training text (drafts get accepted) or from random ids
    text = data.draw(st.sampled_from(["def add(a, b):", "Natalia sold clips to 48 of", "The quick brown fox", None]))
    if text is None:
        prompt = data.draw(st.lists(st.integers(3, vocab - 1), min_size=1, max_size=24), label="prompt")
    else:
        prompt = decoder.target.tokenizer(text)["input_ids"]
    max_new_tokens = data.draw(st.integers(1, 32), label="max_new_tokens")
    block_size = data.draw(st.integers(1, decoder.drafter.max_block_size), label="B")
    free_run = _hf_greedy(model, prompt, max_new_tokens, [vocab + 7], pad)  # an id never produced: no stop
    stops = data.draw(st.lists(st.one_of(st.sampled_from(free_run), st.integers(0, vocab - 1)), min_size=1, max_size=3,
                               unique=True), label="stop ids")
    decoder.stop_ids = set(stops)

    expected = _hf_greedy(model, prompt, max_new_tokens, stops, pad)
    ids = torch.tensor([prompt])
    got = decoder.generate(ids, block_size, DecodeConfig(max_new_tokens))
    assert got.output_ids == expected
    assert got.stopped == (expected[-1] in stops) and sum(got.taus) + 1 == len(got.output_ids)
    temperature = data.draw(st.sampled_from([0.7, 1.5]), label="T")
    seed = data.draw(st.integers(0, 1000), label="seed")
    sampled = decoder.generate(ids, block_size, DecodeConfig(max_new_tokens, temperature, seed)).output_ids
    assert sampled == decoder.generate(ids, 1, DecodeConfig(max_new_tokens, temperature, seed)).output_ids
