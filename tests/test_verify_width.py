"""The verify-width policy: the replay's calibration samples are the decoder's own, the calibration recovers a planted
relation, the width choice on constructed costs, draft skipping, and lossless decoding for every choice."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.step import candidates, draft, verify
from pipeline.decoding.trees import DraftTree, grow
from pipeline.labeling.replay import replay, target_trace
from pipeline.labeling.store import LabelStore, read_labels
from pipeline import PROJECT_ROOT
from pipeline.costs import CostModel
from pipeline.policy.calibration import (AcceptanceCalibration, calibration_samples, export_calibration, find_calibration,
                                         fit_from_labels, load_calibration, reliability)
from pipeline.policy.setup import run_folder
from pipeline.policy.verify_width import VerifyWidthSchedule, foresight_bound, step_acceptances
from pipeline.policy.widths import best_width, expected_tokens
from pipeline.prompts import chat_input_ids

PROMPTS = ["def add(a, b):", "Natalia sold clips to 48 of her friends", "Write a function that returns the sum",
           "The quick brown fox"]


def constant_calibration(bias: float, columns: int = 16) -> AcceptanceCalibration:
    """a_j = sigmoid(bias) whatever the drafter's probability."""
    return AcceptanceCalibration([bias] * columns, [0.0] * columns)


def linear_latency(verify_slope: float = 5.0, draft_ms: float = 10.0, base: float = 50.0, widths: int = 16) -> CostModel:
    """verify_ms(q) = base + slope * (q - 1), draft_ms flat, the same at every context length."""
    buckets = [64, 512]
    return CostModel(buckets, list(range(1, widths + 1)),
                     {q: [base + verify_slope * (q - 1)] * 2 for q in range(1, widths + 1)},
                     {q: [draft_ms] * 2 for q in range(2, widths + 1)}, [100.0, 400.0])


def manual_decode(decoder: SpeculativeDecoder, ids: torch.Tensor, block_size: int, config: DecodeConfig, top_k: int = 4):
    """``decode``'s loop with a fixed B, keeping every step's draft probabilities and accepted count, and the step's
    top ``top_k`` draft candidates and their probabilities (the step verifies the whole chain of first choices, drafted
    by ``pipeline.decoding.step.candidates``) and its new tokens: ``(b, confidence, accepted, candidates, candidate probabilities, new)``."""
    sampler = PositionKeyedSampler(config.temperature, config.seed, decoder.lm_head.shape[0])
    with torch.inference_mode():
        state = decoder.new_state(decoder.prefill(ids, config), use_drafter=True)
        produced, steps = 1, []
        stopped = state.pending in decoder.stop_ids
        while not stopped and produced < config.max_new_tokens:
            b = min(block_size, config.max_new_tokens - produced)
            if b > 1:
                logits = draft(decoder.forward, [state], [b])[0]
                tokens, probs = candidates(decoder, SimpleNamespace(sampler=sampler, state=state), logits, top_k)
                chain = DraftTree.chain(tokens[:, 0].tolist())  # every first choice
                (new, path, _), = verify(decoder.forward, [state], [sampler], [chain])
                steps.append((b, probs[:, 0], len(path), tokens, probs, list(new)))
            else:
                (new, _, _), = verify(decoder.forward, [state], [sampler], [DraftTree()])
                steps.append((b, None, 0, None, None, list(new)))
            for i, token in enumerate(new):
                if token in decoder.stop_ids:
                    new, stopped = new[: i + 1], True
                    break
            produced += len(new)
    return steps


@pytest.mark.parametrize("temperature,seed,lm_head,vocab", [(0.0, 0, "lazy", False), (0.0, 0, "full", False),
                                                            (1.0, 3, "lazy", False), (0.0, 0, "lazy", True),
                                                            (0.8, 1, "lazy", True)])
def test_replay_confidence_samples_are_the_decoders(trained_decoder, temperature, seed, lm_head, vocab):
    """Each replayed step records (j, the drafter's probability, accepted, its top 4 candidates' probabilities, the
    rank among them of the target's token) for columns 1..first rejection, equal to what the decoder computes in the
    same step of a real decode (its ``candidates``, and the token the target emitted there)."""
    decoder = trained_decoder
    if vocab:  # a draft vocabulary: the lazy path decides each chunk with the draft head
        drafter = copy.deepcopy(decoder.drafter)
        drafter.set_draft_vocab(torch.arange(0, decoder.lm_head.shape[0], 2))
        decoder = SpeculativeDecoder(decoder.target, drafter)
    config = DecodeConfig(28, temperature, seed)
    checked = rejected = lower = 0
    for text in PROMPTS:
        ids = chat_input_ids(decoder.target.tokenizer, [text])
        trace = target_trace(decoder, decoder.prefill(ids, config), config)
        for B in (4, 8, 13):
            result = replay(decoder, trace, [B], config, lm_head=lm_head, record_confidence=True)[B]
            steps = manual_decode(decoder, ids, B, config)
            assert len(steps) == len(result.confidence) == len(result.taus)
            for (b, confidence, accepted, tokens, probs, new), samples in zip(steps, result.confidence):
                if b == 1:
                    assert samples == []
                    continue
                assert [sample[0] for sample in samples] == list(range(1, len(samples) + 1))
                assert len(samples) in (min(accepted + 1, b - 1), accepted)  # the last column may lie past the trace
                for j, p, ok, top_p, rank in samples:
                    assert ok == (j <= accepted)
                    assert math.isclose(p, float(confidence[j - 1]), rel_tol=1e-4, abs_tol=1e-6)
                    assert np.allclose(top_p, probs[j - 1].tolist(), rtol=1e-4, atol=1e-6)
                    candidates = tokens[j - 1].tolist()
                    assert rank == (candidates.index(new[j - 1]) if new[j - 1] in candidates else -1)
                    checked += 1
                    rejected += not ok
                    lower += rank > 0
    assert checked > 50 and 0 < rejected < checked and (lower > 0 or vocab)  # half a vocabulary: rarely a lower rank


def test_step_acceptances_read_back_the_decoders_steps(trained_decoder):
    """The foresight bound's per-step acceptance, read from a replay's flattened samples (as the label store keeps
    them), equals the accepted drafts of every drafting step of a real decode."""
    config = DecodeConfig(28, 0.0, 0)
    compared = 0
    for text in PROMPTS:
        ids = chat_input_ids(trained_decoder.target.tokenizer, [text])
        trace = target_trace(trained_decoder, trained_decoder.prefill(ids, config), config)
        for B in (4, 8):
            result = replay(trained_decoder, trace, [B], config, record_confidence=True)[B]
            flat = [(j, ok) for step in result.confidence for j, _, ok, _, _ in step]
            steps = manual_decode(trained_decoder, ids, B, config)
            expected = [accepted for b, _, accepted, *_ in steps if b > 1]
            got = step_acceptances([j for j, _ in flat], [ok for _, ok in flat])
            assert got[:-1] == expected[:-1] and got[-1] in (expected[-1], expected[-1] - 1)  # the trace's end
            compared += len(got)
    assert compared > 10
    with pytest.raises(ValueError, match="column 1"):
        step_acceptances([2, 1], [True, False])


def test_foresight_bound_on_constructed_replays():
    """Known steps, known costs: verify_ms(q) = 50 + 5 (q - 1), draft 10, prefill 100 ms (64 prompt tokens)."""
    rows = pd.DataFrame([
        # steps at B=4 accept 3, 0, 2 drafts; 9 tokens, so the last block is clipped to 3 (the budget)
        {"id": "a", "source_set": "code", "prompt_tokens": 64, "candidates": [4], "new_tokens": [9.0],
         "conf_block": [4] * 7, "conf_column": [1, 2, 3, 1, 1, 2, 3], "conf_ok": [True, True, True, False, True, True, False]},
        # at B=4: 1 then 0 accepted, then two plain steps (b = 1 records nothing); the B=2 samples are another replay
        {"id": "b#turn2", "source_set": "chat", "prompt_tokens": 64, "candidates": [2, 4], "new_tokens": [5.0, 6.0],
         "conf_block": [2, 2, 4, 4, 4], "conf_column": [1, 1, 1, 2, 1], "conf_ok": [True, True, True, False, False]},
    ])
    latency = linear_latency()
    bound = foresight_bound(rows, latency, 4)
    # ar: 100 + 8 x 50 = 500 and 100 + 5 x 50 = 350
    # fixed: 100 + 75 + 75 + 70 = 320 and 100 + 75 + 70 + 2 x 50 = 345
    # foresight: 100 + 75 + 50 + 70 = 295 and 100 + 65 + 50 + 100 = 315; drafting every step: 305 and 325
    assert bound["block_size"] == 4
    assert bound["per_set"]["code"] == pytest.approx({"requests": 1, "fixed": 500 / 320, "foresight": 500 / 295,
                                                      "foresight_drafting": 500 / 305})
    assert bound["per_set"]["chat"] == pytest.approx({"requests": 1, "fixed": 350 / 345, "foresight": 350 / 315,
                                                      "foresight_drafting": 350 / 325})
    assert bound["all"] == pytest.approx({"requests": 2, "fixed": 850 / 665, "foresight": 850 / 610,
                                          "foresight_drafting": 850 / 630})
    assert set(foresight_bound(rows, latency, 4, ids={"a"})["per_set"]) == {"code"}
    with pytest.raises(ValueError, match="B=8"):
        foresight_bound(rows, latency, 8)


def test_calibration_fit_recovers_a_planted_relation():
    rng = np.random.default_rng(0)
    n = 40000
    p = rng.uniform(0.01, 0.99, n)
    column = rng.integers(1, 5, n)
    bias, slope = np.array([0.5, 0.0, -0.5, -1.0]), np.array([1.0, 1.5, 2.0, 1.0])
    z = bias[column - 1] + slope[column - 1] * np.log(p / (1 - p))
    accepted = rng.random(n) < 1 / (1 + np.exp(-z))
    calibration = AcceptanceCalibration.fit(p, column, accepted, max_column=16)
    assert calibration.max_column == 4  # only the columns seen
    np.testing.assert_allclose(calibration.bias, bias, atol=0.1)
    np.testing.assert_allclose(calibration.slope, slope, atol=0.1)
    table = reliability(calibration, p, column, accepted)
    assert sum(r["count"] for r in table) == n
    assert all(abs(r["predicted"] - r["observed"]) < 0.03 for r in table if r["count"] > 1000)
    # columns past the fitted ones share the last column's parameters
    assert float(calibration.predict(torch.tensor([0.7]), torch.tensor([9]))[0]) == \
        float(calibration.predict(torch.tensor([0.7]), torch.tensor([4]))[0])
    with pytest.raises(ValueError, match="every calibration sample"):
        AcceptanceCalibration.fit([0.5, 0.6], [1, 2], [True, True])
    with pytest.raises(ValueError, match="record_confidence"):
        AcceptanceCalibration.fit([], [], [])


def test_rank_calibration_recovers_a_planted_relation_and_falls_back_without_one():
    """Candidates of rank 1 and 2 taken with planted per-rank logistic relations on their own probability and the first
    choice's: ``with_ranks`` recovers them, a rank-0 candidate still reads its column's model, ranks past the fitted
    ones share the last, and a calibration without rank models reads every rank with the column's."""
    rng = np.random.default_rng(1)
    n = 80000
    top_p = np.sort(rng.dirichlet([1.0, 0.6, 0.4, 0.3, 2.0], n)[:, :4], axis=1)[:, ::-1].clip(1e-4, None)
    logit = lambda q: np.log(q / (1 - q))
    planted = {1: (-1.0, 1.0, 0.3), 2: (-1.5, 0.8, 0.2)}  # rank: (bias, slope on logit(p_r), slope on logit(p_0))
    rank = np.full(n, -1)
    u = rng.random(n)
    lo = 0.0
    for r, (b, s, f) in planted.items():  # one uniform draw splits [0, 1) into disjoint events: at most one rank
        a = 1 / (1 + np.exp(-(b + s * logit(top_p[:, r]) + f * logit(top_p[:, 0]))))
        rank[(u >= lo) & (u < lo + a)] = r
        lo = lo + a
    base = AcceptanceCalibration([0.1, -0.2], [1.0, 2.0])
    ranked = base.with_ranks(top_p, rank)
    assert ranked.max_rank == 3 and ranked.bias == base.bias and ranked.slope == base.slope
    for r, (b, s, f) in planted.items():  # the fitted probabilities are the planted ones (not each weight: bias and
        # slope trade off over the narrow range of logit(p_r))
        truth = 1 / (1 + np.exp(-(b + s * logit(top_p[:, r]) + f * logit(top_p[:, 0]))))
        got = ranked.predict(torch.as_tensor(top_p[:, r]), torch.ones(n, dtype=torch.long), torch.full((n,), r),
                             torch.as_tensor(top_p[:, 0])).numpy()
        assert np.abs(got - truth).max() < 0.04 and np.abs(got - truth).mean() < 0.003, r
        assert ranked.rank_first[r - 1] == pytest.approx(f, abs=0.1)
    info = {row["rank"]: row for row in ranked.info["ranks"]}
    assert info[1]["samples"] == n and abs(info[1]["taken"] - (rank == 1).mean()) < 1e-12
    assert abs(info[1]["predicted"] - info[1]["taken"]) < 0.005
    p, column, first = torch.tensor([0.3] * 4), torch.tensor([2] * 4), torch.tensor([0.5] * 4)
    a = ranked.predict(p, column, torch.tensor([0, 1, 3, 7]), first)
    assert float(a[0]) == float(base.predict(p[:1], column[:1])[0])  # rank 0: the column's model
    assert float(a[2]) == float(a[3]) and float(a[1]) != float(a[0])  # rank 7 shares rank 3's
    never = ranked.predict(torch.tensor([0.2, 0.2]), torch.tensor([1, 1]), torch.tensor([3, 2]), torch.tensor([0.4, 0.4]))
    assert float(never[0]) < 0.05 and float(never[0]) < float(never[1])  # rank 3 was never taken
    assert torch.equal(base.predict(p, column, torch.tensor([0, 1, 3, 7]), first), base.predict(p, column))
    with pytest.raises(ValueError, match="first="):
        ranked.predict(p, column, torch.tensor([0, 1, 3, 7]))
    loaded = AcceptanceCalibration.from_dict(json.loads(json.dumps(ranked.to_dict())))
    assert (loaded.rank_bias, loaded.rank_slope, loaded.rank_first) == (ranked.rank_bias, ranked.rank_slope, ranked.rank_first)
    assert "rank_bias" not in base.to_dict()
    with pytest.raises(ValueError, match="tree_top_k"):
        base.with_ranks(top_p[:, :1], rank)
    with pytest.raises(ValueError, match="no candidate of rank >= 1"):
        base.with_ranks(top_p, np.zeros(n, dtype=int))
    with pytest.raises(ValueError, match="equal lengths"):
        AcceptanceCalibration.from_dict({**ranked.to_dict(), "rank_first": [0.0]})


def test_calibration_round_trips_and_names_the_fix(tmp_path):
    calibration = AcceptanceCalibration([0.1, -0.2], [1.0, 2.0], {"samples": 3})
    fitted = {"calibration": calibration, "reliability": [], "reliability_split": "train"}
    path = export_calibration(tmp_path / "vw", fitted)
    loaded = load_calibration(tmp_path / "vw")
    assert loaded.bias == calibration.bias and loaded.slope == calibration.slope and load_calibration(path).info == {"samples": 3}
    with pytest.raises(FileNotFoundError, match="make train"):
        load_calibration(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text('{"kind": "other"}')
    with pytest.raises(ValueError, match="refit"):
        load_calibration(tmp_path / "bad.json")


def test_expected_tokens_and_best_width_on_constructed_costs():
    torch.testing.assert_close(expected_tokens(torch.tensor([0.5, 0.5])), torch.tensor([1.0, 1.5, 1.75], dtype=torch.float64))
    # a cheap draft then an unlikely one: stop before it (rates 1/60, 1.9/62, 2.71/64, 2.7505/66, 2.787/68)
    assert best_width(torch.tensor([0.9, 0.9, 0.05, 0.9]), 10.0, [50, 52, 54, 56, 58])[0] == 2
    # a flat verify cost (a GPU) verifies everything
    assert best_width(torch.tensor([0.3, 0.3]), 5.0, [50, 50, 50])[0] == 2
    # a steep one with a hopeless draft verifies nothing
    k, rate = best_width(torch.tensor([0.01]), 0.0, [50, 80])
    assert k == 0 and rate == pytest.approx(1 / 50)
    with pytest.raises(ValueError, match="verify costs"):
        best_width(torch.tensor([0.5, 0.5]), 0.0, [1.0, 2.0])


def test_schedule_skips_drafts_that_do_not_pay_and_looks_again():
    latency = linear_latency()
    hopeless = VerifyWidthSchedule(constant_calibration(-12.0), latency, 8, max_skip=4)
    assert hopeless.first(torch.zeros(5)) == 8
    seen = []
    b = 8
    for _ in range(14):
        if b > 1:
            assert hopeless.choose_width(torch.full((b - 1,), 0.5), 100) == 0
        seen.append(b)
        b = hopeless.next(1, b)
    # drafts at 8, skip 1, draft, skip 2, draft, skip 4, draft, skip 4 (max_skip), ...
    assert seen == [8, 1, 8, 1, 1, 8, 1, 1, 1, 1, 8, 1, 1, 1]
    sure = VerifyWidthSchedule(constant_calibration(12.0), latency, 8)
    sure.first(torch.zeros(5))
    assert sure.choose_width(torch.full((7,), 0.5), 100) == 7 and sure.next(8, 8) == 8
    never_skip = VerifyWidthSchedule(constant_calibration(-12.0), latency, 8, skip_drafts=False)
    never_skip.first(torch.zeros(5))
    never_skip.choose_width(torch.full((7,), 0.5), 100)
    assert never_skip.next(1, 8) == 8
    with pytest.raises(ValueError, match="B >= 2"):
        VerifyWidthSchedule(constant_calibration(0.0), latency, 1)


@pytest.mark.slow  # ~35 s per case (24 decodes x 4 calibrations x 3 B), make test-fast skips it
@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 5)])
def test_verify_width_decoding_is_lossless(trained_decoder, temperature, seed):
    """Every width the policy picks, and every skipped draft, leaves the output equal to B=1's."""
    decoder, config = trained_decoder, DecodeConfig(32, temperature, seed)
    # fit a calibration on this drafter's own replays, so the choices vary between 0 and B-1
    samples = {"p": [], "column": [], "accepted": []}
    for text in PROMPTS:
        ids = chat_input_ids(decoder.target.tokenizer, [text])
        trace = target_trace(decoder, decoder.prefill(ids, config), config)
        for step in replay(decoder, trace, [8], config, record_confidence=True)[8].confidence:
            for j, p, ok, _, _ in step:
                samples["p"].append(p), samples["column"].append(j), samples["accepted"].append(ok)
    fitted = AcceptanceCalibration.fit(samples["p"], samples["column"], samples["accepted"])
    widths = set()
    for calibration, latency in [(fitted, linear_latency(8.0)), (fitted, linear_latency(0.5)),
                                 (constant_calibration(-12.0), linear_latency()), (constant_calibration(12.0), linear_latency())]:
        for B in (4, 8, 16):
            for text in PROMPTS:
                ids = chat_input_ids(decoder.target.tokenizer, [text])
                reference = decoder.generate(ids, 1, config).output_ids
                stats = decoder.generate(ids, VerifyWidthSchedule(calibration, latency, B, max_skip=3), config)
                assert stats.output_ids == reference, (B, text)
                assert len(stats.verify_widths) == len(stats.taus) == len(stats.confidences)
                assert all(t <= k + 1 for t, k in zip(stats.taus, stats.verify_widths))
                widths |= set(stats.verify_widths)
    assert 0 in widths and 7 in widths and len(widths) >= 4


def test_label_rows_without_samples_read_as_null_and_fit_names_the_fix(tmp_path):
    store = LabelStore(tmp_path / "labels")
    row = {"id": "a", "source_set": "s", "prompt_tokens": 3, "candidates": [2], "tau": [1.0], "new_tokens": [4.0],
           "decode_ms": [1.0], "tokens_per_s": [1.0], "label_tau": 2, "label_speed": 2, "topk_ids": [1],
           "topk_logprobs": [0.0], "full_logits": None, "vocab_size": 8, "entropy": 0.0, "prefill_ms": 1.0, "shard": 0,
           "num_shards": 1}
    pd.DataFrame([row]).to_parquet(tmp_path / "labels" / "shard-00000.parquet")  # an older shard: no conf_* columns
    store.write([dict(row, id="b", conf_block=[2, 2], conf_column=[1, 1], conf_p=[0.9, 0.2], conf_ok=[True, False])])
    labels = read_labels(tmp_path / "labels")
    assert labels.loc[labels["id"] == "a", "conf_p"].iloc[0] is None
    samples = calibration_samples(labels)
    assert samples["p"].tolist() == [0.9, 0.2] and samples["accepted"].tolist() == [True, False]
    assert len(calibration_samples(labels, ids={"a"})["p"]) == 0
    with pytest.raises(ValueError, match="record_confidence"):
        fit_from_labels(labels, {"a"})


def test_calibration_lookup_order_and_the_shipped_one(tmp_path):
    """An explicit path wins, then the run's train-stage export, then the drafter folder's shipped calibration."""
    shipped = PROJECT_ROOT / "data" / "drafters" / "smollm2-135m-instruct-dflash-b8"
    calibration = load_calibration(find_calibration(None, tmp_path / "run" / "verify_width", str(shipped)))
    assert calibration.info["samples"] > 10_000 and calibration.info["exclude_sets"] == ["humaneval"]
    a = calibration.predict(torch.tensor([0.05, 0.5, 0.95]))  # more confident drafts are more often accepted
    assert 0 < float(a[0]) < float(a[1]) < float(a[2]) < 1
    fitted = {"calibration": constant_calibration(1.0), "reliability": [], "reliability_split": "train"}
    run_file = export_calibration(tmp_path / "run" / "verify_width", fitted)
    assert find_calibration(None, tmp_path / "run" / "verify_width", str(shipped)) == run_file
    assert find_calibration(str(shipped / "calibration.json"), tmp_path / "run" / "verify_width", None) == shipped / "calibration.json"
    with pytest.raises(FileNotFoundError, match="make label/dataset/train"):
        find_calibration(None, tmp_path / "other", None)
    assert find_calibration(None, None, str(shipped)) == shipped / "calibration.json"  # no run: the drafter's
    # the run behind serve.predictor_dir / eval.predictor_dir: the run's predictors folder itself, or, for a predictor
    # folder given directly, the folder above it (whose verify_width/ holds the run's calibration)
    (tmp_path / "run" / "mlp").mkdir()
    (tmp_path / "run" / "mlp" / "predictor.json").write_text("{}")
    assert run_folder(tmp_path / "run") == tmp_path / "run" and run_folder(tmp_path / "run" / "mlp") == tmp_path / "run"
    assert run_folder(None) is None


def test_the_train_stage_fits_on_the_train_split_and_checks_on_the_test_split(tmp_path):
    """``train.calibration`` (``export_verify_width_calibration``): fits on the train split's samples and tabulates
    reliability on the test split's (labels read from the label stage's folder, splits from the feature dataset)."""
    from datasets import Dataset, DatasetDict
    from omegaconf import OmegaConf

    from pipeline.policy.training import export_verify_width_calibration

    rng = np.random.default_rng(0)
    row = {"source_set": "s", "prompt_tokens": 3, "candidates": [4], "tau": [2.0], "new_tokens": [4.0],
           "decode_ms": [1.0], "tokens_per_s": [1.0], "label_tau": 4, "label_speed": 4, "topk_ids": [1],
           "topk_logprobs": [0.0], "full_logits": None, "vocab_size": 8, "entropy": 0.0, "prefill_ms": 1.0, "shard": 0,
           "num_shards": 1}
    rows, samples = [], {}
    for i in range(8):
        p = rng.uniform(0.05, 0.95, 30)
        ok = (rng.random(30) < p).tolist()
        samples[f"p{i}"] = len(p)
        # the drafter's 3 best candidates and the target's token's rank among them (p0 on an older shard: none)
        top_p = np.stack([p, (1 - p) * 0.6, (1 - p) * 0.2], axis=1)
        rank = np.where(ok, 0, np.where(rng.random(30) < 0.4, 1 + (rng.random(30) < 0.3), -1))
        rows.append(dict(row, id=f"p{i}", conf_block=[4] * 30, conf_column=[1 + j % 3 for j in range(30)],
                         conf_p=p.tolist(), conf_ok=ok,
                         conf_top_p=None if i == 0 else top_p.tolist(), conf_rank=None if i == 0 else rank.tolist()))
    LabelStore(tmp_path / "labels").write(rows)
    (tmp_path / "labels" / "meta.json").write_text(json.dumps({"candidates": [4], "mode": "replay"}))
    splits = {"train": [f"p{i}" for i in range(5)], "test": [f"p{i}" for i in range(5, 8)]}
    dd = DatasetDict({s: Dataset.from_dict({"id": ids}) for s, ids in splits.items()})
    ccfg = OmegaConf.create({"labels_dir": str(tmp_path / "labels"), "out": str(tmp_path / "vw")})
    path = export_verify_width_calibration(ccfg, dd, {"target": "t", "drafter": "d"})
    assert path == tmp_path / "vw" / "calibration.json"
    stored = json.loads(path.read_text())
    assert stored["reliability_split"] == "test"
    assert stored["info"]["samples"] == sum(samples[i] for i in splits["train"])
    assert stored["info"]["test_samples"] == sum(samples[i] for i in splits["test"])
    assert load_calibration(tmp_path / "vw").info["samples"] == stored["info"]["samples"]
    # the rank models: fitted on the train split's candidate records (p0 has none), tabulated on the test split's
    assert len(stored["rank_bias"]) == 2 and stored["info"]["rank_table_split"] == "test"
    assert {r["rank"]: r["samples"] for r in stored["info"]["ranks"]} == {1: 4 * 30, 2: 4 * 30}
    table = stored["info"]["rank_table"]
    assert {(r["column"], r["rank"]) for r in table} == {(j, r) for j in (1, 2, 3) for r in (0, 1, 2)}
    assert sum(r["offered"] for r in table if r["rank"] == 0) == 3 * 30
    taken = {(r["column"], r["rank"]): r["taken"] for r in table}
    test_rows = [r for r in rows if r["id"] in splits["test"]]
    col1 = np.concatenate([np.asarray(r["conf_rank"])[np.asarray(r["conf_column"]) == 1] for r in test_rows])
    assert taken[(1, 1)] == pytest.approx((col1 == 1).mean())


def test_the_loaded_calibration_is_logged(tmp_path, caplog):
    """Issue 23 item 7: which calibration verify_width loaded was not logged (eval and serve load it through here)."""
    from pipeline.policy.registry import PolicyInputs
    from pipeline.policy.setup import load_verify_width

    fitted = {"calibration": constant_calibration(1.0), "reliability": [], "reliability_split": "train"}
    path = export_calibration(tmp_path / "mine", fitted)
    inputs = PolicyInputs()
    with caplog.at_level("INFO", logger="pipeline.policy.setup"):
        load_verify_width(inputs, None, {"verify_width": {"calibration": str(path)}}, tmp_path / "run", None, [])
    assert inputs.calibration_path == str(path) and inputs.latency is None
    assert any(str(path) in r.getMessage() and "calibration" in r.getMessage() for r in caplog.records)
