"""Draft sources and the ``mixed`` method (``pipeline.decoding.sources``, ``pipeline.policy.mixed``), and the one decode
step that runs them (``pipeline.decoding.step``).

- the n-gram index's proposals against a brute-force scan of the same sequences (longest suffix match, latest places
  first, distinct next tokens, the match length measured backwards), and its memory bound: eviction takes the dropped
  segments' places out (the index then equals a fresh one of what it kept) without indexing the others again;
- a merged tree holds each source's chain as a path, parents first, values along a path non-increasing, siblings'
  estimates summing to at most 1;
- the recycled candidates are the target's own top-k after each token;
- ``mixed`` is lossless against ``ar`` at T=0 and gives ``ar``'s sampled text at T=1, every source on, alone and in a
  batched step; trees and ``mixed`` in a batched step equal each request decoded alone;
- (``tests/test_real_model.py``) a request that copies code from its prompt accepts >= 4 tokens a step over the copy;
- the observed acceptance per source converges to the observed rates; bad options are refused before any model loads;
- a suffix cache seeded from an earlier run's rows.jsonl (``policy.mixed.cache_seed``) drafts that run's responses,
  losslessly; a seed of another target, a missing one or one holding the eval's own prompts is refused.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.decoding.scheduler import decode_all
from pipeline.decoding.sources import MATCH_CAP, NgramIndex
from pipeline.decoding.trees import DraftTree, depth_exclusive, grow
from pipeline.models.backend import set_backend, smallm_available
from pipeline.policy.checks import check_cache_seed_disjoint, check_policy_options
from pipeline.policy.mixed import (MixedSchedule, RecycledTokens, SharedSources, SourceStats, merge_paths,
                                   read_responses)
from pipeline.prompts import chat_input_ids

from test_trees import PROMPTS, calibration, flat_costs, tree_schedule

needs_smallm = pytest.mark.skipif(not smallm_available(), reason="the smallm kernel does not build on this CPU")


# ------------------------------------------------------------------------------------------------
# the n-gram index
# ------------------------------------------------------------------------------------------------
def brute_lookup(seq: list[int], max_n: int, keep: int, max_len: int, branches: int) -> list[tuple[list[int], int]]:
    """What ``NgramIndex.lookup`` over one segment ``seq`` (its own last token the query) should return."""
    end_now = len(seq) - 1
    out, firsts = [], set()
    for n in range(min(max_n, len(seq)), 0, -1):
        key = seq[-n:]
        ends = [e for e in range(n - 1, len(seq)) if seq[e - n + 1: e + 1] == key][-keep:]
        for e in reversed(ends):
            if e == end_now or e + 1 >= len(seq):
                continue
            tokens = seq[e + 1: e + 1 + max_len]
            if tokens[0] in firsts:
                continue
            firsts.add(tokens[0])
            m = n
            while m < MATCH_CAP and m < len(seq) and e - m >= 0 and seq[-1 - m] == seq[e - m]:
                m += 1
            out.append((tokens, m))
            if len(out) >= branches:
                return out
    return out


@settings(max_examples=200, deadline=None, derandomize=True)
@given(seq=st.lists(st.integers(0, 5), min_size=1, max_size=60), max_n=st.integers(1, 4), keep=st.integers(1, 3),
       max_len=st.integers(1, 8), branches=st.integers(1, 3), split=st.integers(0, 60))
def test_ngram_lookup_is_the_brute_force_scan(seq, max_n, keep, max_len, branches, split):
    index = NgramIndex(max_n, keep)
    sid = index.new_segment(seq[:split])  # indexed in two appends: the result does not depend on how
    index.extend(sid, seq[split:])
    got = index.lookup(seq, max_len, branches, exclude=(sid, len(seq) - 1))
    assert [(c.tokens, c.match) for c in got] == brute_lookup(seq, max_n, keep, max_len, branches)


def test_ngram_segments_do_not_match_across_and_the_bound_holds():
    index = NgramIndex(3, keep=2, max_tokens=50)
    a = index.new_segment([1, 2, 3])
    b = index.new_segment([4, 5, 6])
    assert [(c.tokens, c.match) for c in index.lookup([3, 4], 4)] == [([5, 6], 1)]  # 3, 4 spans two segments: no match
    assert all(c.tokens[0] != 4 for c in index.lookup([2, 3], 4))  # 3 ends segment a: nothing after it
    for i in range(20):
        index.new_segment(list(range(100 + 10 * i, 110 + 10 * i)))
    assert index.tokens_held <= 50 and a not in index.segments and b not in index.segments
    last = max(index.segments)
    assert index.lookup([290, 291], 3)[0].tokens == [292, 293, 294] and last in index.segments
    with pytest.raises(ValueError, match="max_tokens >= 1"):
        NgramIndex(3, 2, max_tokens=0)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(segments=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=30), min_size=1, max_size=12),
       max_n=st.integers(1, 4), keep=st.integers(1, 3), bound=st.integers(1, 60))
def test_an_evicting_index_holds_what_a_fresh_index_of_its_segments_holds(segments, max_n, keep, bound):
    """Evicting takes the dropped segments' places out of the tables: the index then equals one built afresh from
    the segments it kept (their tokens in order), and each segment's own tokens are what it was given (a segment
    longer than the bound: its tail)."""
    index = NgramIndex(max_n, keep, max_tokens=bound)
    given_tokens = {}
    for seq in segments:
        half = len(seq) // 2
        sid = index.new_segment(seq[:half])
        index.extend(sid, seq[half:])
        given_tokens[sid] = seq
        assert index.tokens_held == sum(len(t) for t in index.segments.values()) <= bound
        fresh = NgramIndex(max_n, keep)
        for kept, tokens in index.segments.items():
            assert tokens == given_tokens[kept][len(given_tokens[kept]) - len(tokens):]
            fresh.segments[kept] = []
            fresh.extend(kept, tokens)
        assert index._tables == fresh._tables


def test_evicting_a_segment_does_not_index_the_others_again(monkeypatch):
    index = NgramIndex(4, keep=3, max_tokens=100)
    for i in range(10):
        index.new_segment(range(10 * i, 10 * i + 10))
    indexed = []
    extend = NgramIndex.extend
    monkeypatch.setattr(NgramIndex, "extend", lambda self, sid, tokens: (indexed.append(len(list(tokens))),
                                                                         extend(self, sid, tokens))[1])
    sid = index.new_segment()
    index.extend(sid, [7, 8, 9])  # 103 tokens: the oldest segment goes, nothing else is indexed again
    assert indexed == [0, 3] and index.tokens_held == 93 and 0 not in index.segments
    assert index.lookup([15, 16], 2)[0].tokens == [17, 18]


# ------------------------------------------------------------------------------------------------
# the merged tree
# ------------------------------------------------------------------------------------------------
def _paths(tree: DraftTree) -> set[tuple[int, ...]]:
    out = set()
    for j in range(len(tree)):
        path, p = [], j
        while p >= 0:
            path.append(tree.tokens[p])
            p = tree.parents[p]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_a_merged_tree_holds_each_source_chain(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    candidates = torch.stack([torch.randperm(9, generator=g)[:4] + 3 for _ in range(4)])  # distinct at each depth
    drafted = grow(candidates, depth_exclusive(torch.rand(4, 4, generator=g).sort(dim=1, descending=True).values), 8)
    chains = []
    for _ in range(3):
        tokens = [rng.randrange(3, 12) for _ in range(rng.randrange(1, 6))]
        if rng.random() < 0.5 and len(drafted):  # one that shares the drafter's first branch
            tokens[0] = drafted.tokens[0]
        chains.append((tokens, [rng.uniform(0.1, 0.9) for _ in tokens], [("ngram", 3, d) for d in range(len(tokens))]))
    merged, tags = merge_paths(drafted, chains, 64)
    paths = _paths(merged)
    for tokens, _, _ in chains:
        assert tuple(tokens) in paths  # each chain is a path from the root
    assert _paths(drafted) <= paths  # and so is every branch of the drafter's tree
    assert len(paths) == len(merged)  # one node per distinct path: shared prefixes merged
    for j, p in enumerate(merged.parents):
        assert p < j  # parents first
        assert merged.depths[j] == (1 if p < 0 else merged.depths[p] + 1)
        if p >= 0:
            assert merged.values[j] <= merged.values[p] + 1e-12
    assert merged.values == sorted(merged.values, reverse=True)
    conds = {}
    for j, p in enumerate(merged.parents):
        conds.setdefault(p, 0.0)
        conds[p] += merged.values[j] / (1.0 if p < 0 else merged.values[p])
    assert all(v <= 1.0 + 1e-9 for v in conds.values())
    assert sum(len(t) for t in tags) == sum(len(c[0]) for c in chains)  # every chain node tagged once
    # each node's sources: "ngram" where a chain's path runs through it, "drafter" where the drafter's tree does
    for j in range(len(merged)):
        path, p = [], j
        while p >= 0:
            path.append(merged.tokens[p])
            p = merged.parents[p]
        path = tuple(reversed(path))
        expected = ({"ngram"} if any(tuple(c[0][: len(path)]) == path for c in chains) else set()) | (
            {"drafter"} if path in _paths(drafted) else set())
        assert set(merged.sources[j]) == expected, (j, path)
    counts = merged.source_counts([0]) if len(merged) else {}
    assert sum(v[1] for v in counts.values()) == len(merged.sources[0]) if len(merged) else counts == {}
    small, _ = merge_paths(drafted, chains, 5)
    assert len(small) <= 5 and all(p < j for j, p in enumerate(small.parents))


def test_source_stats_converge_to_the_observed_rate():
    stats = SourceStats()
    rng = random.Random(0)
    for _ in range(4000):
        stats.observe("ngram", 4, 1, rng.random() < 0.7)
        stats.observe("ngram", 1, 2, rng.random() < 0.2)
    assert abs(stats.estimate("ngram", 4, 1) - 0.7) < 0.05
    assert abs(stats.estimate("ngram", 1, 2) - 0.2) < 0.05
    assert stats.estimate("cache", 2, 1) == pytest.approx(SourceStats.prior("cache", 2))  # nothing seen: the prior


def test_a_requests_own_rate_moves_its_estimate_off_the_methods():
    method, own = SourceStats(), SourceStats(prior_weight=8.0)
    for _ in range(400):
        method.observe("ngram", 1, 1, True), method.observe("ngram", 1, 1, False)  # the method: half taken
    shared = method.estimate("ngram", 1, 1)
    assert own.estimate("ngram", 1, 1, prior=shared) == pytest.approx(shared)  # nothing of its own yet
    for _ in range(24):
        own.observe("ngram", 1, 1, False)  # this request's matches are never taken
    assert own.estimate("ngram", 1, 1, prior=shared) == pytest.approx(8 * shared / 32)  # 24 misses over 8 pseudo-counts


def test_recycled_candidates_are_the_targets_top_k():
    recycled = RecycledTokens(10, k=2)
    logits = torch.tensor([[0.0, 5, 1, 0, 0, 0, 0, 0, 0, 4], [9.0, 0, 0, 0, 0, 0, 8, 0, 0, 0]])
    recycled.update([3, 1], logits)
    assert recycled.table[3].tolist() == [1, 9] and recycled.table[1].tolist() == [0, 6]
    chains = recycled.chains(3, (2, 1), room=4)  # 3 -> {1, 9}; 1 -> 0; 9 -> nothing yet
    assert sorted(chains) == [([1, 0], [0, 0]), ([9], [1])]


# ------------------------------------------------------------------------------------------------
# the method on a real decoder
# ------------------------------------------------------------------------------------------------
def mixed_schedule(shared: SharedSources, sources=("drafter", "ngram", "cache", "recycle"), block_size: int = 8):
    return MixedSchedule(calibration(), flat_costs(lambda q: 10.0 + 0.1 * q), block_size, shared, sources=sources,
                         skip_drafts=True, max_nodes=12)


def test_in_a_batched_step_a_tree_is_sized_on_what_its_rows_add_to_the_step():
    """With the batched cost model, a request in a step of ``load`` requests prices n nodes at its share of the others'
    plain step plus what its rows add (the throughput rule: a node pays where its acceptance beats that ms at the step's
    rate); alone, the batch-1 model as before. The same chains keep fewer nodes under load."""
    from pipeline.costs.batched import BatchCostModel

    batch = BatchCostModel([1, 64], [6.0, 6.0 + 0.8 * 63], [8], [2.0], verify_per_request_ms=0.1)  # a row: 0.8 ms
    schedule = MixedSchedule(calibration(), flat_costs(lambda q: 6.0 + 0.8 * (q - 1)), 1, SharedSources(0, 4),
                             sources=("ngram",), max_nodes=8, batch_costs=batch)
    assert schedule._verify_ms(64, 3) == pytest.approx([6.0, 6.8, 7.6, 8.4])  # alone: the batch-1 model
    schedule.load = 16
    plain = batch.step_ms(16, 0, 16)
    assert schedule._verify_ms(64, 3) == pytest.approx([plain / 16 + 0.8 * k for k in range(4)])
    values = torch.tensor([0.9, 0.6, 0.4, 0.2, 0.1], dtype=torch.float64)  # a chain's path acceptances
    counts = {}
    for load in (1, 16):
        schedule.load = load
        counts[load] = schedule.choose_count(values, 0.0, schedule._verify_ms(64, len(values)))
        by_hand = max(range(len(values) + 1), key=lambda k: (1 + float(values[:k].sum())) / schedule._verify_ms(64, k)[k])
        assert counts[load] == by_hand
    assert counts[16] < counts[1] and counts[16] >= 1  # under load only the likely nodes pay
    for n in range(4, 20):  # the batched steps measure a row at 1.5 ms: the curve under load prices it so
        schedule.timed_verify(n + n % 5, 2.0 + 1.5 * (n + n % 5) + 0.1 * n, 64, requests=n)
    assert schedule.shared.row_cost.per_row() == pytest.approx(1.5)
    schedule.load = 16
    assert schedule._verify_ms(64, 3) == pytest.approx([plain / 16 + 1.5 * k for k in range(4)])
    schedule.load = 1
    assert schedule._verify_ms(64, 3) == pytest.approx([6.0, 6.8, 7.6, 8.4])  # alone: still the batch-1 model


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("backend", ["eager", "smallm"])
def test_mixed_is_lossless(trained_decoder, backend, temperature):
    if backend == "smallm" and not smallm_available():
        pytest.skip("the smallm kernel does not build on this CPU")
    decoder = SpeculativeDecoder(trained_decoder.target, trained_decoder.drafter, backend=backend)
    shared = SharedSources(1000, 4, decoder.lm_head.shape[0])
    try:
        config = DecodeConfig(max_new_tokens=40, temperature=temperature, seed=7)
        nodes = 0
        for text in PROMPTS * 2:  # the second round reads the suffix cache of the first
            ids = chat_input_ids(decoder.target.tokenizer, [text])
            reference = decoder.generate(ids, 1, config).output_ids
            for sources in (("drafter", "ngram", "cache", "recycle"), ("ngram", "cache")):
                stats = decoder.generate(ids, mixed_schedule(shared, sources), config)
                assert stats.output_ids == reference, f"mixed {sources} diverges from ar on {text!r} ({backend}, T={temperature})"
                nodes += sum(len(t) for t, _ in stats.trees)
                assert all(len(path) + 1 == tau for (_, path), tau in zip(stats.trees, stats.taus))
                recount = {}  # the per-source split, counted again from the verified trees and their accepted paths
                for tree, path in stats.trees:
                    for j, names in enumerate(tree.sources if tree.sources is not None else [("drafter",)] * len(tree)):
                        for name in names:
                            row = recount.setdefault(name, [0, 0])
                            row[0], row[1] = row[0] + 1, row[1] + (j in path)
                assert stats.sources == recount and set(recount) <= set(sources)
        assert nodes > 50  # trees really ran
        assert set(shared.stats.summary()) >= {"ngram", "recycle"}
    finally:
        set_backend(trained_decoder.target.model, "eager")
        set_backend(trained_decoder.drafter, "eager")


@needs_smallm
def test_trees_and_mixed_in_a_batched_step_equal_each_request_alone(tiny, restore_eager):
    """The one step with N requests: every request's tree (the drafter's, and every source's merged) verified in one
    target forward with per-row ancestors, each request's text its ``ar`` text."""
    decoder = SpeculativeDecoder(tiny.target("llama"), tiny.drafter("llama", "trained"), backend="smallm")
    tok = decoder.target.tokenizer
    prompts = [torch.tensor([tok(t)["input_ids"]]) for t in PROMPTS + ["def fib(n): return fib(n - 1) + fib(n - 2)"]]
    configs = [DecodeConfig(30), DecodeConfig(21), DecodeConfig(17, 1.0, 3), DecodeConfig(26)]
    ar = [decoder.generate(p, 1, c).output_ids for p, c in zip(prompts, configs)]
    shared = SharedSources(1000, 4, decoder.lm_head.shape[0])
    for make in (lambda: tree_schedule(), lambda: mixed_schedule(shared)):
        got = decode_all(decoder, prompts, [make() for _ in prompts], configs, [0.0] * len(prompts))
        assert [r.stats.output_ids for r in got] == ar
        assert sum(len(t) for r in got for t, _ in r.stats.trees) > 20
    assert len(shared.row_cost.steps) > 0  # each batched step's time went to its first request's schedule


def test_bad_mixed_options_are_refused_before_any_model_loads():
    def check(**mixed):
        check_policy_options(OmegaConf.create({"policy": {"mixed": mixed}}))

    check(sources=["ngram", "cache"], max_n=4, branches=2, cache_tokens=0 + 1)
    for bad, match in ((dict(sources=["ngrams"]), "choose one or more of"), (dict(sources=[]), "choose one or more"),
                       (dict(max_n=0), "max_n=0"), (dict(branches=0), "branches=0"),
                       (dict(cache_tokens=-1), "cache_tokens=-1"),
                       (dict(sources=["cache"], cache_tokens=0), "bound of >= 1 token"),
                       (dict(max_nodes=40), "1..15"), (dict(max_skip=-2), "max_skip=-2")):
        with pytest.raises(ValueError, match=match):
            check(**bad)


def _rows_jsonl(path, target: str, responses: dict) -> str:
    """An eval run's rows.jsonl as ``pipeline.evaluate`` writes it: a settings line, then one line per request."""
    lines = [{"settings": {"model": {"target": target}, "methods": ["ar", "mixed"]}}]
    lines += [{"id": rid, "rows": {"mixed": {"output_ids": [0]}, "ar": {"output_ids": ids}}} for rid, ids in responses.items()]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_seed_files_are_read_and_bad_ones_refused(tmp_path):
    good = _rows_jsonl(tmp_path / "rows.jsonl", "smollm2", {"mbpp-1": [5, 6, 7], "mbpp-2": [8, 9]})
    assert read_responses([good], "smollm2") == {"mbpp-1": [5, 6, 7], "mbpp-2": [8, 9]}  # the ar rows
    check_policy_options(OmegaConf.create({"policy": {"mixed": {"cache_seed": good}}}))  # one path or a list
    empty = _rows_jsonl(tmp_path / "empty.jsonl", "smollm2", {})
    for paths, target, match in (([good], "qwen3-4b", "another tokenizer"), ([str(tmp_path / "none.jsonl")], None,
                                 "is not a file"), ([empty], None, "holds no response")):
        with pytest.raises(ValueError, match=match):
            read_responses(paths, target)
    with pytest.raises(ValueError, match="is not a file"):
        check_policy_options(OmegaConf.create({"policy": {"mixed": {"cache_seed": [str(tmp_path / "none.jsonl")]}}}))
    policy = OmegaConf.create({"mixed": {"cache_seed": [good]}})
    check_cache_seed_disjoint(policy, ["HumanEval/0", "mbpp-3"])
    with pytest.raises(ValueError, match="responses to 1 prompts this run decodes"):
        check_cache_seed_disjoint(policy, ["HumanEval/0", "mbpp-2"])


def test_a_seeded_suffix_cache_drafts_an_earlier_response_losslessly(trained_decoder, tmp_path):
    """A response seeded from an earlier run is in the suffix cache before the first request: decoding the same prompt
    again drafts it from there (cache nodes taken), the text still ``ar``'s; a cold cache takes none of them."""
    decoder = SpeculativeDecoder(trained_decoder.target, None)
    config = DecodeConfig(max_new_tokens=40, temperature=0.0, seed=7)
    ids = chat_input_ids(decoder.target.tokenizer, [PROMPTS[0]])
    reference = decoder.generate(ids, 1, config).output_ids
    seed = _rows_jsonl(tmp_path / "rows.jsonl", decoder.target.name, {"earlier-0": reference})
    runs = {}
    for name in ("cold", "seeded"):
        shared = SharedSources(1000, 4)
        if name == "seeded":
            assert shared.seed(read_responses([seed], decoder.target.name).values()) == len(reference)
        stats = decoder.generate(ids, mixed_schedule(shared, ("ngram", "cache"), block_size=1), config)
        assert stats.output_ids == reference, name
        runs[name] = stats
    taken = {name: stats.sources.get("cache", (0, 0))[1] for name, stats in runs.items()}
    assert taken["cold"] == 0 and taken["seeded"] > 0, taken
    assert sum(runs["seeded"].taus) / len(runs["seeded"].taus) > sum(runs["cold"].taus) / len(runs["cold"].taus)


def test_labels_seed_the_cache_with_the_train_splits_replies_only():
    """``policy.mixed.cache_seed=labels``: the label stage's replies to the train split's requests (a second turn's
    too), never another split's; labels without replies, or a run that decodes the train split, are refused."""
    import pandas as pd

    from pipeline.policy.registry import PolicyInputs, train_replies

    labels = pd.DataFrame({"id": ["a", "a#turn2", "b", "c"], "reply_ids": [[1, 2], [3], [4, 5], [6]]})
    inputs = PolicyInputs(labels=labels, splits={"train": ["a", "a#turn2"], "test": ["b"], "validation": ["c"]})
    assert train_replies(inputs) == [[1, 2], [3]]
    with pytest.raises(ValueError, match="keep no replies"):
        train_replies(PolicyInputs(labels=labels.drop(columns=["reply_ids"]), splits=inputs.splits))
    with pytest.raises(ValueError, match="no labelled request of the train split"):
        train_replies(PolicyInputs(labels=labels, splits={"train": ["z"]}))
    policy = OmegaConf.create({"mixed": {"cache_seed": "labels"}})
    check_policy_options(OmegaConf.create({"policy": policy}))  # no file to read
    check_cache_seed_disjoint(policy, ["b"], "test")
    for split in (None, "train"):
        with pytest.raises(ValueError, match="decode the test or validation split"):
            check_cache_seed_disjoint(policy, ["b"], split)
