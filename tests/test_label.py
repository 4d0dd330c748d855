"""The label stage: label picking (ties -> smaller B), the prefill distribution columns, the store
(atomic shards, meta checks, de-duplication, merge), end-to-end runs in both modes, resume after a
kill, shard merges (Hydra joblib multirun and torchrun ranks) equal to one worker, a Qwen3 target."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from conftest import composed
from pipeline import PROJECT_ROOT
from pipeline.costs import CostModel
from pipeline.labeling.oracle import (LabelSettings, candidate_window, decode_full_logits, distribution_features,
                                      label_prompt, pick_label)
from pipeline.labeling.runner import effective_shard, run_label, shard_prompts
from pipeline.labeling.store import LabelStore, merge_labels, read_labels
from pipeline.prompts import Prompt, chat_input_ids, request_id

TEXTS = ["def add(a, b):", "Natalia sold clips to 48 of her friends", "Write a function that returns the sum",
         "The quick brown fox", "for i in range(10): print(i)"]
CANDIDATES = [2, 4, 8, 12]
TIMING_COLUMNS = ["prefill_ms", "shard", "num_shards"]  # measured or worker-dependent


# ------------------------------------------------------------------------------------------------
# label picking and the prefill distribution
# ------------------------------------------------------------------------------------------------
def test_pick_label_takes_the_argmax_and_breaks_ties_towards_the_smaller_b():
    candidates = [6, 7, 8, 9, 10]
    assert pick_label(candidates, [2.0, 3.5, 3.1, 2.0, 1.0]) == 7
    assert pick_label(candidates, [2.0, 3.5, 3.1, 3.5, 1.0]) == 7  # tie 7/9 -> 7
    assert pick_label(candidates, [4.0, 4.0, 4.0, 4.0, 4.0]) == 6
    assert pick_label(candidates, [1.0, 2.0, 3.0, 4.0, 4.0 + 1e-12]) == 9  # equal up to float noise
    assert pick_label([10, 8, 6], [5.0, 5.0, 1.0]) == 8  # unsorted candidates: still the smaller B
    assert pick_label([4, 5], [math.nan, 2.0]) == 5
    with pytest.raises(ValueError, match="one value per candidate"):
        pick_label([4, 5], [1.0])
    with pytest.raises(ValueError, match="NaN"):
        pick_label([4], [math.nan])


def test_a_fake_tau_table_through_the_labeller(trained_decoder, monkeypatch):
    """label_tau / label_speed come from the per-B table: here a table where the best B is known."""
    import pipeline.labeling.oracle as oracle
    from pipeline.labeling.brute import BruteResult
    from pipeline.decoding.requests import RequestStats

    table = {2: [2, 2], 4: [4, 3], 8: [4, 3], 12: [3, 3, 1]}  # mean tau 2, 3.5, 3.5, 2.33 -> tie 4/8 -> 4
    decode_ms = {2: 40.0, 4: 30.0, 8: 20.0, 12: 20.0}  # fastest: 8 and 12 tie -> 8

    def fake_brute(decoder, prefill, candidates, config, consume=False):
        stats = {b: RequestStats(prompt_tokens=5, output_ids=[1] * 7, taus=table[b], decode_ms=decode_ms[b]) for b in candidates}
        return BruteResult(stats, {b: 0.0 for b in candidates})

    monkeypatch.setattr(oracle, "brute_force", fake_brute)
    ids = chat_input_ids(trained_decoder.target.tokenizer, [TEXTS[0]])
    row = label_prompt(trained_decoder, ids, LabelSettings(CANDIDATES, mode="brute", max_new_tokens=8)).row
    assert row["tau"] == pytest.approx([2.0, 3.5, 3.5, 7 / 3])
    assert row["label_tau"] == 4
    assert row["label_speed"] == 8
    prefill = row["prefill_ms"]
    assert row["tokens_per_s"] == pytest.approx([7 / ((prefill + decode_ms[b]) / 1e3) for b in CANDIDATES])


def test_candidate_window():
    assert candidate_window(8, 5, 16) == [6, 7, 8, 9, 10]
    assert candidate_window(8, 9, 16) == [4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert candidate_window(4, 9, 16) == list(range(2, 11))
    assert candidate_window(16, 5, 16) == [12, 13, 14, 15, 16]
    with pytest.raises(ValueError, match="cannot pick"):
        candidate_window(4, 20, 16)


def test_distribution_features():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0, -2.0])
    out = distribution_features(logits, topk=3, store_full_logits=True)
    logp = torch.log_softmax(logits, -1)
    assert out["topk_ids"][0] in (1, 3) and sorted(out["topk_ids"]) == [1, 2, 3]
    assert out["topk_logprobs"] == pytest.approx(sorted(logp[[1, 3, 2]].tolist(), reverse=True))
    assert out["entropy"] == pytest.approx(float(-(logp.exp() * logp).sum()))
    assert out["vocab_size"] == 5
    np.testing.assert_array_equal(decode_full_logits(out["full_logits"]), logits.half().numpy())
    assert distribution_features(logits, topk=99)["topk_ids"].__len__() == 5
    assert distribution_features(logits, topk=2)["full_logits"] is None
    assert distribution_features(torch.zeros(8), topk=1)["entropy"] == pytest.approx(math.log(8))
    with pytest.raises(ValueError, match="label.topk"):
        distribution_features(logits, topk=0)


# ------------------------------------------------------------------------------------------------
# store
# ------------------------------------------------------------------------------------------------
def fake_row(prompt_id: str, shard: int = 0, label: int = 4) -> dict:
    return {"id": prompt_id, "source_set": "s", "prompt_tokens": 3, "candidates": [2, 4], "tau": [1.0, 2.0],
            "new_tokens": [8.0, 8.0], "decode_ms": [5.0, 4.0], "tokens_per_s": [100.0, 120.0], "label_tau": label,
            "label_speed": 4, "topk_ids": [1, 0], "topk_logprobs": [-0.1, -2.0], "full_logits": None, "vocab_size": 10,
            "entropy": 0.5, "prefill_ms": 1.0, "shard": shard, "num_shards": 2}


def test_store_writes_atomic_shards_reads_sorted_and_deduplicated(tmp_path):
    store = LabelStore(tmp_path / "run")
    assert store.write([]) is None
    first = store.write([fake_row("b"), fake_row("a")])
    second = LabelStore(tmp_path / "run").write([fake_row("c", 1), fake_row("a", 1, label=2)])  # "a" again
    assert (first.name, second.name) == ("shard-00000.parquet", "shard-00001.parquet")
    assert not list((tmp_path / "run").glob(".tmp-*"))
    assert store.done_ids() == {"a", "b", "c"}
    frame = read_labels(tmp_path / "run")
    assert frame["id"].tolist() == ["a", "b", "c"]
    assert frame.loc[0, "label_tau"] == 4  # the first file's row wins
    assert frame.loc[0, "candidates"].tolist() == [2, 4]
    with pytest.raises(FileNotFoundError, match="make label"):
        read_labels(tmp_path / "empty")
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        store.write([{**fake_row("d"), "tau": "not a list"}])
    assert len(store.shard_files()) == 2


def test_meta_first_writer_wins_and_mismatches_name_the_fix(tmp_path):
    store = LabelStore(tmp_path / "run")
    meta = {"target": "t", "drafter": "d", "candidates": [2, 4], "mode": "replay", "latency_model": {"x": 1}}
    assert store.ensure_meta(meta) == meta
    assert store.ensure_meta({**meta, "latency_model": {"x": 2}})["latency_model"] == {"x": 1}
    with pytest.raises(ValueError, match="run_name=") as err:
        store.ensure_meta({**meta, "candidates": [2, 3]})
    assert "candidates" in str(err.value)


def test_merge_labels(tmp_path):
    meta = {"target": "t", "candidates": [2, 4], "mode": "brute", "latency_model": None}
    for name, ids in (("w0", ["a", "c"]), ("w1", ["b", "c"])):
        store = LabelStore(tmp_path / name)
        store.ensure_meta(meta)
        store.write([fake_row(i) for i in ids])
    out = merge_labels([tmp_path / "w0", tmp_path / "w1"], tmp_path / "merged")
    merged = read_labels(out)
    assert merged["id"].tolist() == ["a", "b", "c"]
    assert len(LabelStore(out).shard_files()) == 1 and LabelStore(out).read_meta()["mode"] == "brute"
    with pytest.raises(ValueError, match="new directory"):
        merge_labels([tmp_path / "w0"], out)
    LabelStore(tmp_path / "w2").ensure_meta({**meta, "mode": "replay"})
    LabelStore(tmp_path / "w2").write([fake_row("z")])
    with pytest.raises(ValueError, match="other settings"):
        merge_labels([tmp_path / "w0", tmp_path / "w2"], tmp_path / "merged2")


# ------------------------------------------------------------------------------------------------
# the stage, end to end on tiny models
# ------------------------------------------------------------------------------------------------
def write_prompts(path: Path, texts=TEXTS) -> Path:
    path.write_text("".join(json.dumps({"id": f"tiny-{i}", "turns": [t]}) + "\n" for i, t in enumerate(texts)))
    return path


def synthetic_latency(path: Path) -> Path:
    """A fixed latency model (verify cost grows fast with b, so label_speed prefers smaller B than label_tau)."""
    model = CostModel(context_buckets=[16, 128], block_sizes=[1, 2, 16],
                      verify_points={1: [1.0, 1.5], 2: [1.2, 1.8], 16: [12.0, 16.0]},
                      draft_points={2: [0.5, 0.6], 16: [1.0, 1.2]}, prefill_points=[2.0, 6.0])
    path.write_text(json.dumps(model.to_dict()))
    return path


@pytest.fixture
def label_setup(tiny, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    latency = synthetic_latency(tmp_path / "latency.json")

    def overrides(out: Path, *extra: str) -> list[str]:
        return [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'trained')}",
                f"data.sets=[{{name:tiny,source:'{prompts}'}}]", "data.limit=null", "data.seed=null",
                "decode.max_new_tokens=24", f"label.block_sizes={CANDIDATES}".replace(" ", ""),
                f"label.out_dir={out}", f"label.latency.path={latency}", "label.flush_every=2", "label.warmup=false",
                "logger.enabled=false", *extra]

    return overrides


def run(overrides: list[str], decoder=None, on_prompt=None) -> dict:
    with composed("label", overrides) as cfg:
        return run_label(cfg, decoder=decoder, on_prompt=on_prompt)


def comparable(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=TIMING_COLUMNS)


def test_label_stage_replay_and_brute_agree(label_setup, trained_decoder, tmp_path):
    replay_dir, brute_dir = tmp_path / "replay", tmp_path / "brute"
    summary = run(label_setup(replay_dir, "label.store_full_logits=true", "label.topk=16"), trained_decoder)
    assert summary["labelled"] == len(TEXTS) and summary["already_done"] == 0
    run(label_setup(brute_dir, "label.mode=brute", "label.store_full_logits=true", "label.topk=16"), trained_decoder)
    replayed, brute = read_labels(replay_dir), read_labels(brute_dir)
    assert replayed["id"].tolist() == [f"tiny-{i}" for i in range(len(TEXTS))]
    for column in ("tau", "new_tokens", "label_tau", "topk_ids", "topk_logprobs", "full_logits", "entropy",
                   "prompt_tokens", "vocab_size", "reply_ids"):
        pd.testing.assert_series_equal(replayed[column], brute[column], check_names=False)
    vocab = trained_decoder.lm_head.shape[0]
    for _, row in replayed.iterrows():
        assert row["candidates"].tolist() == CANDIDATES and row["source_set"] == "tiny"
        assert row["label_tau"] == pick_label(CANDIDATES, row["tau"])
        assert row["label_speed"] == pick_label(CANDIDATES, row["tokens_per_s"])
        assert len(row["topk_ids"]) == 16 and row["vocab_size"] == vocab
        assert len(decode_full_logits(row["full_logits"])) == vocab
        assert np.all(np.diff(row["topk_logprobs"]) <= 0) and row["entropy"] > 0
        assert all(t >= 1 for t in row["tau"]) and row["new_tokens"].tolist() == [row["new_tokens"][0]] * 4
    assert max(max(t) for t in replayed["tau"]) > 2  # accepted drafts, not only bonus tokens
    # replay's tokens/s come from the (fixed) latency model: recompute one by hand
    meta = LabelStore(replay_dir).read_meta()
    model = CostModel.from_dict(meta["latency_model"])
    assert meta["mode"] == "replay" and meta["candidates"] == CANDIDATES and meta["training_block_size"] == 8
    assert LabelStore(brute_dir).read_meta()["latency_model"] is None
    ids = chat_input_ids(trained_decoder.target.tokenizer, [TEXTS[0]])
    ar = trained_decoder.generate(ids, 1, LabelSettings(CANDIDATES, max_new_tokens=24).decode_config(0)).output_ids
    assert replayed.loc[0, "reply_ids"].tolist() == ar and len(ar) == replayed.loc[0, "new_tokens"][0]  # its reply
    settings = LabelSettings(CANDIDATES, "replay", 24)
    again = label_prompt(trained_decoder, ids, settings, model, keep_runs=True)
    trace, results = again.runs[0]
    expected = [model.tokens_per_s(ids.shape[1], results[b].block_sizes, results[b].starts, results[b].new_tokens, 0.0)
                for b in CANDIDATES]
    assert replayed.loc[0, "tokens_per_s"].tolist() == pytest.approx(expected)
    # with verify cost growing fast in b, the fastest B is not the longest-accepting one for some prompt
    assert (replayed["label_speed"] < replayed["label_tau"]).any()


def test_temperature_repeats_average_seeds(label_setup, trained_decoder, tmp_path):
    short = ["decode.temperature=0.8", "decode.max_new_tokens=12", "data.limit=3"]
    run(label_setup(tmp_path / "r", *short, "label.repeats=2"), trained_decoder)
    run(label_setup(tmp_path / "b", *short, "label.repeats=2", "label.mode=brute"), trained_decoder)
    replayed, brute = read_labels(tmp_path / "r"), read_labels(tmp_path / "b")
    assert len(replayed) == 3
    pd.testing.assert_series_equal(replayed["tau"], brute["tau"])
    assert LabelStore(tmp_path / "r").read_meta()["repeats"] == 2
    # the mean over seeds 0 and 1 of single-seed runs
    single = []
    for seed in (0, 1):
        run(label_setup(tmp_path / f"s{seed}", *short, f"decode.seed={seed}"), trained_decoder)
        single.append(read_labels(tmp_path / f"s{seed}"))
    assert any((single[0].loc[i, "tau"] != single[1].loc[i, "tau"]).any() for i in range(3))  # seeds differ
    for i in range(3):
        np.testing.assert_allclose(replayed.loc[i, "tau"], (single[0].loc[i, "tau"] + single[1].loc[i, "tau"]) / 2)


def test_resume_after_a_kill(label_setup, trained_decoder, tmp_path):
    out = tmp_path / "killed"
    seen = []

    def kill_after_three(row):
        seen.append(row["id"])
        if len(seen) == 3:
            raise KeyboardInterrupt("simulated kill")

    with pytest.raises(KeyboardInterrupt):
        run(label_setup(out), trained_decoder, on_prompt=kill_after_three)
    assert LabelStore(out).done_ids() == set(seen)  # the finished prompts were kept
    summary = run(label_setup(out), trained_decoder)
    assert (summary["labelled"], summary["already_done"]) == (len(TEXTS) - 3, 3)
    assert run(label_setup(out), trained_decoder)["labelled"] == 0  # nothing left
    resumed = read_labels(out)
    run(label_setup(tmp_path / "clean"), trained_decoder)
    clean = read_labels(tmp_path / "clean")
    rows = pd.concat([pd.read_parquet(f) for f in LabelStore(out).shard_files()])
    assert sorted(rows["id"]) == sorted(clean["id"])  # no prompt lost, none duplicated
    pd.testing.assert_frame_equal(comparable(resumed), comparable(clean))
    # another configuration in the same directory is refused
    with pytest.raises(ValueError, match="other settings"):
        run(label_setup(out, "label.block_sizes=[2,4]"), trained_decoder)


def test_every_turn_of_a_multi_turn_prompt_is_a_request_with_its_own_label(label_setup, trained_decoder, tmp_path):
    """label.turns=all: turn 2 is labelled on turn 1 + the target's own reply + turn 2; a first-turns-only run
    resumes into the same rows as a clean all-turns run."""
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"id": "chat-0", "turns": [TEXTS[1], TEXTS[2]]}) + "\n"
                       + json.dumps({"id": "solo-0", "turns": [TEXTS[0]]}) + "\n")

    def overrides(out, *extra):
        return label_setup(out, f"data.sets=[{{name:chat,source:'{prompts}'}}]", *extra)

    partial = tmp_path / "first-then-all"
    assert run(overrides(partial, "label.turns=first"), trained_decoder)["labelled"] == 2
    assert LabelStore(partial).done_ids() == {"chat-0", "solo-0"}
    summary = run(overrides(partial), trained_decoder)  # turns=all (default): only the second turn is new
    assert (summary["labelled"], summary["already_done"]) == (1, 2)
    run(overrides(tmp_path / "all"), trained_decoder)
    resumed, clean = read_labels(partial), read_labels(tmp_path / "all")
    assert clean["id"].tolist() == ["chat-0", "chat-0#turn2", "solo-0"]
    pd.testing.assert_frame_equal(comparable(resumed), comparable(clean))
    # the second request is the conversation a serving engine would see after the target's first reply
    tokenizer = trained_decoder.target.tokenizer
    first = chat_input_ids(tokenizer, [TEXTS[1], TEXTS[2]])
    reply = trained_decoder.generate(first, 1, LabelSettings(CANDIDATES, max_new_tokens=24).decode_config(0)).output_ids
    second = chat_input_ids(tokenizer, [TEXTS[1], TEXTS[2]], [tokenizer.decode(reply, skip_special_tokens=True)])
    row = clean.set_index("id").loc[request_id("chat-0", 1)]
    assert row["prompt_tokens"] == second.shape[1] > first.shape[1]
    again = label_prompt(trained_decoder, second, LabelSettings(CANDIDATES, max_new_tokens=24),
                         CostModel.from_dict(LabelStore(partial).read_meta()["latency_model"]))
    assert again.row["tau"] == row["tau"].tolist() and again.row["label_tau"] == row["label_tau"]
    with pytest.raises(ValueError, match="label.turns"):
        run(overrides(tmp_path / "bad", "label.turns=second"), trained_decoder)


def test_rank_sharding_merges_to_one_worker(label_setup, trained_decoder, tmp_path, monkeypatch):
    for rank in (1, 0):  # ranks may finish in any order
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        summary = run(label_setup(tmp_path / "ranks"), trained_decoder)
        assert (summary["shard"], summary["num_shards"]) == (rank, 2)
        assert summary["labelled"] == len(range(rank, len(TEXTS), 2))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    run(label_setup(tmp_path / "one"), trained_decoder)
    sharded, one = read_labels(tmp_path / "ranks"), read_labels(tmp_path / "one")
    assert sharded["shard"].tolist() == [i % 2 for i in range(len(TEXTS))]
    pd.testing.assert_frame_equal(comparable(sharded), comparable(one))


def test_sharding_rules():
    prompts = [Prompt(f"p{i}", ["x"], "s") for i in range(7)]
    assert [p.id for p in shard_prompts(prompts, 1, 3)] == ["p1", "p4"]
    assert effective_shard(1, 2, {"RANK": "3", "WORLD_SIZE": "4"}) == (7, 8)
    assert effective_shard(0, 1, {}) == (0, 1)
    with pytest.raises(ValueError, match="label.shard"):
        effective_shard(2, 2, {})
    with pytest.raises(ValueError, match="unique"):
        shard_prompts(prompts + [Prompt("p1", ["y"], "t")], 0, 1)


def test_bad_label_settings_name_the_fix(label_setup, trained_decoder, tmp_path):
    with pytest.raises(ValueError, match="label.block_sizes.*beyond this drafter's limit"):
        run(label_setup(tmp_path / "x", "label.block_sizes=[4,40]"), trained_decoder)
    with pytest.raises(ValueError, match="duplicates"):
        run(label_setup(tmp_path / "x", "label.block_sizes=[4,4]"), trained_decoder)
    with pytest.raises(ValueError, match="label.mode"):
        run(label_setup(tmp_path / "x", "label.mode=guess"), trained_decoder)
    with pytest.raises(FileNotFoundError, match="label.latency.path"):
        run(label_setup(tmp_path / "x", f"label.latency.path={tmp_path}/none.json"), trained_decoder)


def test_replay_measures_its_latency_model_once_per_run_dir(label_setup, trained_decoder, tmp_path, steady_clock):
    """Timed on the steady clock (conftest): the spot check's verdict on the cached model (reuse) and a fresh
    measurement's difference from it do not depend on how busy the machine is."""
    out = tmp_path / "measured"
    cache = f"label.latency.cache={tmp_path}/latency-cache"
    run(label_setup(out, "label.latency.path=null", "label.latency.context_buckets=[8,32]", "label.latency.repeats=1",
                    "data.limit=1", cache), trained_decoder)
    meta = LabelStore(out).read_meta()
    model = meta["latency_model"]
    assert model["context_buckets"] == [8, 32] and sorted(map(int, model["verify_ms"])) == list(range(1, 13))
    run(label_setup(out, "label.latency.path=null", "label.latency.context_buckets=[8,32]", cache), trained_decoder)
    assert LabelStore(out).read_meta()["latency_model"] == model  # reused, not re-measured
    assert len(read_labels(out)) == len(TEXTS)
    # a new run on the same machine and models reuses the stored model after its spot check (measured timings never
    # repeat exactly: a re-measured model would differ)
    other = tmp_path / "another-run"
    run(label_setup(other, "label.latency.path=null", "label.latency.context_buckets=[8,32]", "label.latency.repeats=1",
                    "data.limit=1", cache), trained_decoder)
    assert LabelStore(other).read_meta()["latency_model"] == model
    assert len(list((tmp_path / "latency-cache").glob("latency-*.json"))) == 1
    fresh = tmp_path / "fresh"
    run(label_setup(fresh, "label.latency.path=null", "label.latency.context_buckets=[8,32]", "label.latency.repeats=1",
                    "data.limit=1", "label.latency.cache=null"), trained_decoder)
    assert LabelStore(fresh).read_meta()["latency_model"]["verify_ms"] != model["verify_ms"]
    assert steady_clock.reads  # every measurement and spot check above read the injected clock


def test_qwen3_target_label_path(tiny, tmp_path):
    """The label code path on a tiny random Qwen3 target (the qwen3_4b preset's architecture)."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", TEXTS[:2])
    common = [f"model.target={tiny.target_dir('qwen3')}", f"model.drafter={tiny.drafter_dir('qwen3')}",
              "model.dtype=float32", "model.device=cpu", f"data.sets=[{{name:q,source:'{prompts}'}}]",
              "decode.max_new_tokens=12", "label.block_sizes=[2,3,4,5]", "logger.enabled=false", "label.warmup=false",
              f"label.latency.path={synthetic_latency(tmp_path / 'lat.json')}"]
    run(["model=qwen3_4b", *common, f"label.out_dir={tmp_path / 'r'}"])
    run(["model=qwen3_4b", *common, f"label.out_dir={tmp_path / 'b'}", "label.mode=brute"])
    replayed, brute = read_labels(tmp_path / "r"), read_labels(tmp_path / "b")
    assert len(replayed) == 2 and LabelStore(tmp_path / "r").read_meta()["target"] == str(tiny.target_dir("qwen3"))
    pd.testing.assert_series_equal(replayed["tau"], brute["tau"])
    assert replayed["label_tau"].tolist() == brute["label_tau"].tolist()


def test_joblib_multirun_shards_equal_one_worker(label_setup, tmp_path):
    """``python -m pipeline.label -m label.shard=0,1 label.num_shards=2 hydra/launcher=joblib`` == one worker."""
    out = tmp_path / "multirun"
    args = label_setup(out)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "BLOCKPILOT_TEST_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pipeline.label", "-m", "label.shard=0,1", "label.num_shards=2",
           "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "label.num_threads=1",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", *args]
    result = subprocess.run(cmd, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["shard0-of-2", "shard1-of-2"]
    # the one worker decodes on the decoder its config builds, as each shard does (the same backend and draft
    # precision: a fixture's eager decoder drafts on other products)
    run(label_setup(tmp_path / "one"))
    sharded, one = read_labels(out), read_labels(tmp_path / "one")
    assert sorted(set(sharded["shard"])) == [0, 1]
    pd.testing.assert_frame_equal(comparable(sharded), comparable(one))


# ------------------------------------------------------------------------------------------------
# issue 15: a request too long for the context, bad shard files
# ------------------------------------------------------------------------------------------------
def test_a_request_longer_than_the_context_is_skipped_named_and_recorded(label_setup, trained_decoder, tmp_path, caplog):
    """Item 2: one prompt beyond the tiny target's 512-token context used to stop every run of the stage, unnamed,
    and the prompts after it were never labelled."""
    too_long = "The quick brown fox jumps over the lazy dog. " * 120
    assert chat_input_ids(trained_decoder.target.tokenizer, [too_long]).shape[1] > 512
    prompts = write_prompts(tmp_path / "long.jsonl", [TEXTS[0], too_long, TEXTS[1]])
    out = tmp_path / "long"
    overrides = label_setup(out, f"data.sets=[{{name:tiny,source:'{prompts}'}}]")
    with caplog.at_level("WARNING", logger="pipeline.labeling.runner"):
        summary = run(overrides, trained_decoder)
    assert summary["labelled"] == 2 and [s["id"] for s in summary["skipped"]] == ["tiny-1"]
    assert "exceeds the target's context of 512 tokens" in summary["skipped"][0]["reason"]
    assert any("tiny-1" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert read_labels(out)["id"].tolist() == ["tiny-0", "tiny-2"]  # the prompt after it was labelled
    assert LabelStore(out).read_skipped() == summary["skipped"]
    again = run(overrides, trained_decoder)  # a rerun no longer raises; the skip is recorded once
    assert (again["labelled"], again["already_done"], [s["id"] for s in again["skipped"]]) == (0, 2, ["tiny-1"])
    assert LabelStore(out).read_skipped() == summary["skipped"]


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _drop_column(file: Path) -> None:
    pd.read_parquet(file).drop(columns=["entropy"]).to_parquet(file)


@pytest.mark.parametrize("damage, problem", [
    (_truncate, "is not a readable Parquet file"),
    (lambda f: f.write_bytes(b""), "is not a readable Parquet file"),
    (lambda f: f.write_bytes(b"PAR1" + os.urandom(64) + b"PAR1"), "is not a readable Parquet file"),
    (_drop_column, r"lacks columns \['entropy'\]"),
])
def test_a_bad_shard_is_named_and_resume_relabels_its_requests(damage, problem, label_setup, trained_decoder, tmp_path):
    """Item 3: a truncated, empty or garbled shard made resume, read_labels and the dataset stage raise ArrowInvalid;
    one missing a column raised a bare KeyError."""
    from pipeline.policy.data import read_label_table
    from pipeline.labeling.store import BadShardError

    out = tmp_path / "damaged"
    run(label_setup(out), trained_decoder)
    clean = read_labels(out)
    bad = LabelStore(out).shard_files()[1]
    lost = set(pd.read_parquet(bad)["id"])
    damage(bad)
    for read in (read_labels, read_label_table):
        with pytest.raises(BadShardError, match=problem) as err:
            read(out)
        assert str(bad) in str(err.value) and "python -m pipeline.label" in str(err.value)
    summary = run(label_setup(out), trained_decoder)  # resume: the bad shard is set aside, its requests labelled again
    assert summary["labelled"] == len(lost) == 2 and summary["already_done"] == len(TEXTS) - 2
    assert [p.name for p in (out / "bad-shards").iterdir()][0].startswith(bad.stem)
    pd.testing.assert_frame_equal(comparable(read_labels(out)), comparable(clean))
