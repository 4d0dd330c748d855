"""Draft trees (``pipeline.decoding.trees``, method ``tree``: ``pipeline.policy.trees``).

- ``grow`` is the best-first tree: parents before children, values non-increasing, every prefix the n-node subtree
  with the most expected tokens (against brute force over all subtrees of a small case);
- a tree verify row gives the same bits as the causal row of its path (the kernel's per-row parents on the native stack
  nothing else), and close to it on transformers' forward with the dense ``tree_mask``; ``tree_mask`` against a
  mask built from the paths;
- after a verify, ``compact`` leaves the cache a causal forward over the accepted path leaves, at every depth;
- decoding with trees is lossless against ``ar`` at T=0 and gives ``ar``'s sampled text at T>0, on the tiny targets
  (eager and smallm);
- a planted drafter whose second choice is always right (and first never) doubles tau over the chain;
- a tree never verifies more rows than the cost curve pays for.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pipeline.costs import CostModel
from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.decoding import step
from pipeline.decoding.trees import DraftTree, depth_exclusive, grow
from pipeline.models.forward import tree_mask
from pipeline.models.backend import set_backend, smallm_available
from pipeline.models.cache import compact
from pipeline.models.target import new_cache
from pipeline.policy.calibration import AcceptanceCalibration
from pipeline.policy.trees import TreeSchedule
from pipeline.prompts import chat_input_ids

needs_smallm = pytest.mark.skipif(not smallm_available(), reason="the smallm kernel does not build on this CPU")
PROMPTS = ["def add(a, b):", "Natalia sold clips to 48 of her friends", "The quick brown fox"]


def flat_costs(verify=lambda q: 10.0, draft_ms: float = 1.0, widths: int = 16) -> CostModel:
    buckets = [64, 512]
    return CostModel(buckets, list(range(1, widths + 1)), {q: [verify(q)] * 2 for q in range(1, widths + 1)},
                     {q: [draft_ms] * 2 for q in range(2, widths + 1)}, [100.0, 400.0])


def calibration(bias: float = 0.0, slope: float = 1.0) -> AcceptanceCalibration:
    return AcceptanceCalibration([bias] * 16, [slope] * 16)


def random_tree(n: int, depth: int, vocab: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (depth, 4), generator=g)
    a = depth_exclusive(torch.rand(depth, 4, generator=g).sort(dim=1, descending=True).values * 0.6)
    return grow(tokens, a, n)


# ------------------------------------------------------------------------------------------------
# the tree itself
# ------------------------------------------------------------------------------------------------
def _subtrees(tree: DraftTree):
    """Every ancestor-closed node set of ``tree`` (brute force)."""
    n = len(tree)
    for size in range(n + 1):
        for nodes in itertools.combinations(range(n), size):
            chosen = set(nodes)
            if all(tree.parents[j] < 0 or tree.parents[j] in chosen for j in nodes):
                yield chosen


def test_grow_is_best_first_and_each_prefix_is_the_best_subtree():
    g = torch.Generator().manual_seed(0)
    a = depth_exclusive(torch.rand(4, 3, generator=g).sort(dim=1, descending=True).values)
    tokens = torch.arange(12).reshape(4, 3)
    full = grow(tokens, a, 9)
    assert len(full) == 9
    assert all(p < j for j, p in enumerate(full.parents))  # parents first
    assert full.values == sorted(full.values, reverse=True)
    for j, (p, d, r) in enumerate(zip(full.parents, full.depths, full.ranks)):
        parent_value = full.values[p] if p >= 0 else 1.0
        assert d == (full.depths[p] + 1 if p >= 0 else 1)
        assert full.values[j] == pytest.approx(parent_value * float(a[d - 1, r]))
        assert full.tokens[j] == int(tokens[d - 1, r])
    # the whole candidate tree of depth 4 x 3 ranks, to compare prefixes with every subtree of it
    every = grow(tokens[:3], a[:3], 100)
    assert len(every) == 3 + 9 + 27
    small = grow(tokens[:2], a[:2], 100)  # 3 + 9 nodes: brute force over its subtrees
    best = {}
    for chosen in _subtrees(small):
        best[len(chosen)] = max(best.get(len(chosen), 0.0), sum(small.values[j] for j in chosen))
    for n in range(len(small) + 1):
        assert sum(small.values[:n]) == pytest.approx(best[n])


def test_depth_exclusive_caps_a_depths_candidates_at_one():
    a = depth_exclusive(torch.tensor([[0.7, 0.5, 0.2], [0.3, 0.2, 0.1]]))
    assert a[0].tolist() == pytest.approx([0.7, 0.3, 0.0])
    assert a[1].tolist() == pytest.approx([0.3, 0.2, 0.1])


def test_walk_follows_the_targets_tokens():
    # root -> 5 (node 0) -> 6 (node 2); root -> 7 (node 1); node 0 -> 8 (node 3)
    tree = DraftTree([5, 7, 6, 8], [-1, -1, 0, 0], [1, 1, 2, 2], [0, 1, 0, 1], [0.5, 0.3, 0.2, 0.1])
    assert tree.row_parents() == [-1, 0, 0, 1, 1]
    # target tokens after rows 0..4: after the root 7 (node 1), after node 1 (row 2) 9: bonus 9
    assert tree.walk([7, 0, 9, 0, 0]) == ([1], 9)
    assert tree.walk([5, 8, 0, 0, 4]) == ([0, 3], 4)  # row 4 is node 3
    assert tree.walk([1, 0, 0, 0, 0]) == ([], 1)


def test_tree_mask_is_each_rows_path():
    tree = random_tree(10, 5, 100, 1)
    parents, context = tree.row_parents(), 6
    mask = tree_mask(parents, context)
    assert mask.shape == (1, 1, 11, context + 11)
    for r in range(11):
        path, a = set(), r
        while a >= 0:
            path.add(a)
            a = parents[a]
        allowed = [c < context or (c - context) in path for c in range(context + 11)]
        assert (mask[0, 0, r] == 0).tolist() == allowed


# ------------------------------------------------------------------------------------------------
# the verify: tree rows against the causal rows of their paths
# ------------------------------------------------------------------------------------------------
def _path_rows(tree: DraftTree, r: int) -> list[int]:
    """Verify rows from the root to row r (row 0 the pending token)."""
    parents, path = tree.row_parents(), []
    while r >= 0:
        path.append(r)
        r = parents[r]
    return path[::-1]


def _prefilled(dec, ids):
    cache = new_cache(dec.model, dec.kv_cache)
    with torch.inference_mode():
        dec.target_forward(ids, cache, 0, want_features=False)
    return cache


def _tree_against_paths(dec, exact: bool, seed: int = 3):
    vocab = dec.lm_head.shape[0]
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(3, vocab, (1, 19), generator=g)
    tree = random_tree(12, 5, vocab, seed)
    pending = 11
    rows = torch.tensor([[pending, *tree.tokens]])
    cache = _prefilled(dec, context)
    with torch.inference_mode():
        logits, _ = dec.target_forward(rows, cache, 19, want_features=False, parents=tree.row_parents())
    for r in range(len(tree) + 1):
        path = _path_rows(tree, r)
        reference = _prefilled(dec, context)
        with torch.inference_mode():
            want, _ = dec.target_forward(rows[:, path], reference, 19, want_features=False)
        if exact:
            assert torch.equal(logits[r], want[-1]), f"row {r} (path {path}) differs from its causal row"
        else:
            torch.testing.assert_close(logits[r], want[-1], rtol=1e-4, atol=1e-4)
    return tree, logits


@needs_smallm
def test_tree_rows_are_the_bits_of_their_paths_on_the_kernel(smallm_decoder):
    assert smallm_decoder.native is not None
    _tree_against_paths(smallm_decoder, exact=True)


def test_tree_rows_match_their_paths_with_the_dense_mask(tiny, arch):
    dec = tiny.decoder(arch, "random")  # eager: transformers' forward with tree_mask
    assert dec.native is None
    _tree_against_paths(dec, exact=False)


@needs_smallm
def test_compact_leaves_the_cache_of_the_accepted_path(smallm_decoder):
    dec = smallm_decoder
    vocab = dec.lm_head.shape[0]
    g = torch.Generator().manual_seed(5)
    context = torch.randint(3, vocab, (1, 17), generator=g)
    tree = random_tree(12, 5, vocab, 5)
    rows = torch.tensor([[9, *tree.tokens]])
    for last in range(len(tree) + 1):  # accept the path to every row in turn (row 0: nothing accepted)
        path = _path_rows(tree, last)
        cache = _prefilled(dec, context)
        with torch.inference_mode():
            dec.target_forward(rows, cache, 17, want_features=False, parents=tree.row_parents())
        compact(cache, 17, path)
        reference = _prefilled(dec, context)
        with torch.inference_mode():
            dec.target_forward(rows[:, path], reference, 17, want_features=False)
        assert cache.get_seq_length() == 17 + len(path)
        for mine, theirs in zip(cache.layers, reference.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@needs_smallm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_moves_rows_natively_as_slicing_keeps_them(monkeypatch, dtype):
    from pipeline.models import cache as cache_module
    from pipeline.models.kernel import smallm_kernel
    from pipeline.models.cache import PreallocatedCache

    smallm_kernel()  # loaded: compact moves rows in one native call
    g = torch.Generator().manual_seed(3)
    for rows in ([0, 2], [0, 1, 3, 6], [0, 3, 4], [0, 1, 2]):
        states = [torch.randn(2, 1, 2, 12, 16, generator=g).to(dtype) for _ in range(3)]  # per layer: keys, values
        caches = [PreallocatedCache(tokens=40), PreallocatedCache(tokens=40)]
        for cache in caches:
            for layer, kv in enumerate(states):
                cache.update(kv[0].clone(), kv[1].clone(), layer)
        with torch.inference_mode():
            compact(caches[0], 5, rows)
            monkeypatch.setattr(cache_module, "loaded_kernel", lambda: None)  # torch's indexed copies
            compact(caches[1], 5, rows)
            monkeypatch.undo()
        kept = [*range(5), *(5 + r for r in rows)]
        for cache in caches:
            assert cache.get_seq_length() == len(kept)
            for layer, kv in zip(cache.layers, states):
                assert torch.equal(layer.keys, kv[0][:, :, kept]) and torch.equal(layer.values, kv[1][:, :, kept])


# ------------------------------------------------------------------------------------------------
# decoding with trees
# ------------------------------------------------------------------------------------------------
def tree_schedule(block_size: int = 8, verify=lambda q: 10.0, top_k: int = 3, max_nodes: int = 12, bias: float = 0.0):
    return TreeSchedule(calibration(bias), flat_costs(verify), block_size, top_k=top_k, max_nodes=max_nodes,
                        skip_drafts=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("backend", ["eager", "smallm"])
def test_trees_are_lossless(trained_decoder, tiny, backend, temperature):
    if backend == "smallm" and not smallm_available():
        pytest.skip("the smallm kernel does not build on this CPU")
    decoder = SpeculativeDecoder(trained_decoder.target, trained_decoder.drafter, backend=backend)
    try:
        config = DecodeConfig(max_new_tokens=40, temperature=temperature, seed=7)
        nodes = 0
        for text in PROMPTS:
            ids = chat_input_ids(decoder.target.tokenizer, [text])
            reference = decoder.generate(ids, 1, config).output_ids
            for schedule in (tree_schedule(), tree_schedule(block_size=4, top_k=2, max_nodes=5)):
                stats = decoder.generate(ids, schedule, config)
                assert stats.output_ids == reference, f"tree diverges from ar on {text!r} ({backend}, T={temperature})"
                nodes += sum(len(t) for t, _ in stats.trees)
                assert all(len(path) + 1 == tau for (_, path), tau in zip(stats.trees, stats.taus))
        assert nodes > 50  # trees really ran
    finally:
        set_backend(trained_decoder.target.model, "eager")
        set_backend(trained_decoder.drafter, "eager")


def test_a_drafter_whose_second_choice_is_right_doubles_tau(trained_decoder, monkeypatch):
    """The drafter's first choice is always wrong and its second always the target's: the chain accepts nothing
    (tau 1), a tree of the two best candidates accepts the second-choice branch."""
    decoder = trained_decoder
    config = DecodeConfig(max_new_tokens=40)
    ids = chat_input_ids(decoder.target.tokenizer, [PROMPTS[1]])
    reference = decoder.generate(ids, 1, config).output_ids
    n = ids.shape[1]

    def planted(dec, request, logits, top_k):
        block_size = logits.shape[0] + 1
        offset = request.state.start - n + 1  # output index of position start + 1
        right = torch.tensor([reference[min(offset + j, len(reference) - 1)] for j in range(block_size - 1)])
        wrong = (right + 1) % decoder.lm_head.shape[0]
        tokens = torch.stack([wrong, right], dim=1)
        probs = torch.tensor([[0.5, 0.45]] * (block_size - 1))
        return tokens, probs

    chain = decoder.generate(ids, tree_schedule(top_k=1), config)
    monkeypatch.setattr(step, "candidates", planted)
    tree = decoder.generate(ids, tree_schedule(top_k=2, max_nodes=14), config)
    assert tree.output_ids == reference
    chain_tau = 1.0 + sum(len(p) for _, p in chain.trees) / max(1, len(chain.trees))
    assert tree.tau >= 2.0 * min(chain_tau, 1.0 + 1e-9)
    assert tree.tau >= 2.0
    assert any(tree.trees[0][0].ranks[j] == 1 for j in tree.trees[0][1])  # the second choices were the ones taken


def test_a_tree_never_verifies_more_rows_than_the_cost_curve_pays_for(trained_decoder):
    """Rows are free up to 4 and dear after: every tree has at most 3 nodes; with every row free it grows to max_nodes."""
    decoder, config = trained_decoder, DecodeConfig(max_new_tokens=32)
    ids = chat_input_ids(decoder.target.tokenizer, [PROMPTS[0]])
    steep = decoder.generate(ids, tree_schedule(verify=lambda q: 10.0 if q <= 4 else 1000.0), config)
    assert steep.trees and max(len(t) for t, _ in steep.trees) <= 3
    assert max(len(t) for t, _ in steep.trees) == 3
    free = decoder.generate(ids, tree_schedule(verify=lambda q: 10.0, max_nodes=12, bias=2.0), config)
    assert max(len(t) for t, _ in free.trees) == 12
    # the chosen size is best_count's on those costs: no other size has more expected tokens per ms
    schedule = tree_schedule(verify=lambda q: 10.0 + 3.0 * q)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 100, (7, 3), generator=g)
    probs = torch.rand(7, 3, generator=g).sort(dim=1, descending=True).values
    chosen = schedule.choose_tree(tokens, probs, 40)
    full = grow(tokens, schedule.acceptance(probs), schedule.max_nodes)
    rates = [(1 + sum(full.values[:n])) / (1.0 + 10.0 + 3.0 * (n + 1)) for n in range(len(full) + 1)]
    assert len(chosen) == max(range(len(rates)), key=lambda n: (rates[n], -n))


def test_the_tree_reads_each_ranks_own_model_when_the_calibration_has_one():
    """A calibration with rank models estimates a lower-ranked candidate with its rank's model (first choices keep the
    column's), so a second choice the labels show is often right can lead the tree; without them every rank reads the
    column's model."""
    probs, tokens = torch.tensor([[0.3, 0.2], [0.5, 0.1]]), torch.tensor([[11, 12], [13, 14]])
    plain = TreeSchedule(calibration(), flat_costs(), block_size=3, top_k=2)
    assert torch.allclose(plain.acceptance(probs), probs.double())
    ranked_calibration = AcceptanceCalibration([0.0] * 16, [1.0] * 16, rank_bias=[1.0], rank_slope=[1.0], rank_first=[0.5])
    ranked = TreeSchedule(ranked_calibration, flat_costs(), block_size=3, top_k=2)
    a = ranked.acceptance(probs)
    expected = torch.sigmoid(1.0 + torch.logit(torch.tensor([0.2, 0.1], dtype=torch.float64))
                             + 0.5 * torch.logit(torch.tensor([0.3, 0.5], dtype=torch.float64)))  # 0.357, 0.232
    assert torch.allclose(a[:, 0], probs[:, 0].double())
    assert torch.allclose(a[:, 1], torch.minimum(expected, a[:, 0]))  # never above the better rank: 0.3, 0.232
    tree, before = grow(tokens, a, 4), grow(tokens, plain.acceptance(probs), 4)
    assert tree.tokens[:2] == before.tokens[:2] == [11, 12]
    assert tree.values[1] == pytest.approx(0.3) and before.values[1] == pytest.approx(0.2)  # the sibling's worth more


def test_tree_summary_counts_shapes_and_the_rank_table():
    from pipeline.decoding.trees import step_record, tree_summary

    tree = DraftTree([5, 7, 6, 8], [-1, -1, 0, 0], [1, 1, 2, 2], [0, 1, 0, 1], [0.5, 0.3, 0.2, 0.1])
    summary = tree_summary([step_record(tree, [0, 3]), step_record(tree.prefix(1), [])])
    assert summary["steps"] == 2 and summary["nodes"] == 2.5 and summary["accepted"] == 1.0
    assert summary["shape"] == [1.5, 1.0]
    assert summary["branching"] == [1.5, 2.0, 0.0]
    # depth 1: rank 0 offered twice (taken once), rank 1 once; depth 2: both offered once (node 0 taken), rank 1 taken
    assert summary["ranks"]["offered"] == [[2, 1], [1, 1]] and summary["ranks"]["accepted"] == [[1, 0], [0, 1]]
    # estimated conditional acceptances: 0.5 (twice) and 0.3 at depth 1; 0.2 / 0.5 and 0.1 / 0.5 at depth 2
    assert [x for row in summary["ranks"]["predicted"] for x in row] == pytest.approx([1.0, 0.3, 0.4, 0.2])
