"""The one decode step: N requests' drafts verified in one target forward (N = 1 is a request decoded alone).

Every decoder of the project advances its requests here: the eval stage's one-request decode
(``SpeculativeDecoder.decode``), the batching server and ``pipeline.bench_batch`` (``BatchedDecoder``), the label
stage's timings. A step (``advance``):

1. takes each request's next block size b_i (its schedule's, capped by its token budget; the ``BatchPolicy``'s
   ``plan`` may make it 1 = no drafter); a schedule with draft sources of its own (``Schedule.proposes``: n-gram
   matches, recycled candidates; ``pipeline.policy.mixed``) proposes first and may skip the drafter (``prepare``);
2. runs ONE drafter forward over every drafting request's block (``draft``);
3. turns each request's proposal into a draft tree (``pipeline.decoding.trees.DraftTree``): a chain of its first k
   drafts (its own verify-width policy, the ``BatchPolicy``'s joint ``allocate``, or all b_i - 1), the tree its
   schedule grows from the drafter's top candidates and its other sources (``choose_tree``), or no node at all (a
   plain step);
4. verifies every request's tree in ONE target forward (``verify``: the pending token and the nodes, each row over its
   own request's cache, its ancestors and itself; a chain's rows are causal), then per request follows the target's
   own token from the root (``DraftTree.walk``: the longest accepted path plus the bonus token, position-keyed at T>0,
   so lossless at every T), moves the accepted path's keys/values behind the context and keeps their drafter features.

The forwards are ``pipeline.models.forward.Forward``'s (the native stack's rows are bit for bit those of a request's
forward alone), so a request's text does not depend on the batch it shares a step with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipeline.decoding.sampling import PositionKeyedSampler, draft_confidence
from pipeline.decoding.schedules import BatchPolicy
from pipeline.decoding.trees import DraftTree
from pipeline.models.cache import compact, crop_to
from pipeline.models.clock import now


@dataclass
class StepShape:
    """What one step ran: verified rows (every request's nodes + 1), drafted rows (the drafter's blocks), requests,
    drafting requests."""

    verified: int
    drafted: int
    requests: int
    drafting: int

    def as_tuple(self) -> tuple[int, int, int, int]:
        return self.verified, self.drafted, self.requests, self.drafting


@torch.inference_mode()
def draft(forward, states: Sequence, sizes: Sequence[int]) -> list[torch.Tensor]:
    """ONE drafter forward over the blocks of ``states`` (request i: its pending token then ``sizes[i]`` - 1 mask
    tokens, with its pending context features): each request's drafter logits [b_i - 1, V'] (float32) at positions
    start+1..start+b_i-1. Each drafter cache keeps the context's keys/values and drops the block's; the features are
    consumed."""
    dec = forward.decoder
    mask_id = dec.drafter.mask_token_id
    blocks = []
    for s, b in zip(states, sizes):
        block = torch.full((1, int(b)), mask_id, dtype=torch.long, device=dec.device)
        block[0, 0] = s.pending
        blocks.append(block)
    hidden = forward.draft_hidden(blocks, [s.pending_features() for s in states], [s.start for s in states],
                                  [s.draft_cache for s in states])
    for s in states:
        crop_to(s.draft_cache, s.start)
        s.features = s.features[:, :0]
    return forward.draft_logits([h[0, 1:] for h in hidden])


@torch.inference_mode()
def verify(forward, states: Sequence, samplers: Sequence[PositionKeyedSampler], trees: Sequence[DraftTree]
           ) -> list[tuple[list[int], list[int], tuple[torch.Tensor, list[int]]]]:
    """ONE target forward over every request's tree (the pending token, then its nodes), then each request's accepted
    path, bonus token, caches and features (module doc, step 4); advances each state.

    Returns:
        per request (new tokens in order: the accepted nodes' tokens and the bonus token, the accepted nodes, and
        (the verify's logits [rows, V], the rows of the pending token and of each accepted node)).
    """
    dec = forward.decoder
    ids = [torch.tensor([[s.pending, *t.tokens]], dtype=torch.long, device=dec.device) for s, t in zip(states, trees)]
    parents = [None if t.is_chain() else t.row_parents() for t in trees]
    outs = forward.target(ids, [s.cache for s in states], [s.start for s in states],
                          [s.draft_cache is not None for s in states], parents)
    results = []
    for s, sampler, tree, (logits, features) in zip(states, samplers, trees, outs):
        targets = sampler.pick_at(logits, [s.start + 1 + d for d in tree.row_depths()]).tolist()
        path, bonus = tree.walk(targets)
        rows = [0] + [j + 1 for j in path]
        compact(s.cache, s.start, rows)  # a chain's accepted rows are a prefix: a crop
        if s.draft_cache is not None:
            s.add_features(features[:, rows])
        s.start += len(rows)
        s.pending = bonus
        results.append(([tree.tokens[j] for j in path] + [bonus], path, (logits, rows)))
    return results


def candidates(decoder, request, logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's top ``top_k`` candidates at each drafted position of ``request``'s block from its ``logits``
    [b-1, V']: (tokens [b-1, k] long, best first: column 0 is the chain's draft; the drafter's probability of each
    [b-1, k], ``draft_confidence``)."""
    columns = request.sampler.top_columns(logits, request.state.start + 1, top_k, decoder.draft_vocab)
    tokens = columns if decoder.draft_vocab is None else decoder.draft_vocab[columns]
    return tokens, draft_confidence(logits, columns, request.sampler.temperature)


@torch.inference_mode()
def chain_step(decoder, state, sampler: PositionKeyedSampler, block_size: int, width: int | None = None
               ) -> tuple[list[int], int]:
    """One step of a bare ``DecodeState`` (no request, no schedule: the timing harness, the tests): draft
    ``block_size`` - 1 tokens, verify the first ``width`` of them (None: all; 0 or B=1: a plain step).

    Returns:
        (new tokens in order, accepted drafts among them).
    """
    drafts: list[int] = []
    if block_size > 1:
        logits = draft(decoder.forward, [state], [block_size])[0]
        columns = sampler.pick_columns(logits, state.start + 1, decoder.draft_vocab)
        tokens = columns if decoder.draft_vocab is None else decoder.draft_vocab[columns]
        k = block_size - 1 if width is None else max(0, min(int(width), block_size - 1))
        drafts = tokens[:k].tolist()
    (new, path, _), = verify(decoder.forward, [state], [sampler], [DraftTree.chain(drafts)])
    state.last_width = len(drafts)
    return new, len(path)


@torch.inference_mode()
def advance(forward, policy: BatchPolicy, reqs: Sequence) -> tuple[list[list[int]], list[int], StepShape]:
    """One step of ``reqs`` (``pipeline.decoding.requests.Request``s, none done): steps 1-4 of the module doc. Each
    state's ``last_width`` (nodes verified), ``last_confidence`` (the drafter's probability of its first choices, or
    None), ``last_tree`` / ``last_path`` (the tree and its accepted nodes; None after a chain step) are set.

    Returns:
        (per request its new tokens, per request the B it drafted at (1: no drafter), the step's shape).
    Raises:
        ValueError: for a block size the decoder cannot run.
    """
    dec = forward.decoder
    for r in reqs:
        dec.check_block_size(r.block_size)
    sizes = [r.next_block() for r in reqs]
    planned = [int(b) for b in policy.plan(reqs, sizes)]
    sizes = [max(1, min(p, b)) for p, b in zip(planned, sizes)]
    for i, r in enumerate(reqs):
        if r.schedule.proposes:  # free draft sources first: the schedule may skip the drafter
            r.schedule.load = len(reqs)
            sizes[i] = max(1, min(sizes[i], int(r.schedule.prepare(r, sizes[i]))))
    n = len(reqs)
    trees: list[DraftTree | None] = [None] * n
    drafts: list[torch.Tensor | None] = [None] * n
    confidences: list[torch.Tensor | None] = [None] * n
    drafting = [i for i, b in enumerate(sizes) if b > 1]
    if drafting:
        logits = draft(forward, [reqs[i].state for i in drafting], [sizes[i] for i in drafting])
        for j, i in enumerate(drafting):
            r = reqs[i]
            schedule, start = r.schedule, r.state.start
            if schedule.chooses_trees:
                tokens, probs = candidates(dec, r, logits[j], schedule.top_k)
                confidences[i] = probs[:, 0]
                trees[i] = schedule.choose_tree(tokens, probs, start)
            else:
                columns = r.sampler.pick_columns(logits[j], start + 1, dec.draft_vocab)
                drafts[i] = columns if dec.draft_vocab is None else dec.draft_vocab[columns]
                if policy.joint_widths or schedule.chooses_widths:
                    confidences[i] = draft_confidence(logits[j], columns, r.sampler.temperature)
    for i, r in enumerate(reqs):  # a step without the drafter: the schedule's own sources, or nothing
        if trees[i] is None and drafts[i] is None:
            trees[i] = r.schedule.choose_tree(None, None, r.state.start) if r.schedule.proposes else DraftTree()
    chains = [i for i in drafting if drafts[i] is not None]
    widths = {i: sizes[i] - 1 for i in chains}
    if policy.joint_widths and chains:
        widths.update(zip(chains, policy.allocate([reqs[i] for i in chains], [confidences[i] for i in chains])))
    else:
        for i in chains:
            schedule = reqs[i].schedule
            if schedule.chooses_widths:
                widths[i] = schedule.choose_width(confidences[i], reqs[i].state.start)
    for i in chains:
        k = max(0, min(int(widths[i]), sizes[i] - 1))
        trees[i] = DraftTree.chain(drafts[i][:k].tolist())
    pendings = [r.state.pending for r in reqs]
    start, t0 = reqs[0].state.start, now(dec.device)
    results = verify(forward, [r.state for r in reqs], [r.sampler for r in reqs], trees)
    # the verify's wall time, for a schedule that corrects its costs by what it observes (a batch's: the first's)
    reqs[0].schedule.timed_verify(sum(len(t) + 1 for t in trees), (now(dec.device) - t0) * 1e3, start, n)
    news = []
    for i, (r, (new, path, (logits, rows))) in enumerate(zip(reqs, results)):
        s = r.state
        s.last_width, s.last_confidence = len(trees[i]), confidences[i]
        tree_step = r.schedule.chooses_trees
        s.last_tree, s.last_path = (trees[i], path) if tree_step else (None, None)
        if r.schedule.proposes:
            taken = logits[: len(rows)] if rows[-1] == len(rows) - 1 else logits[rows]  # a prefix: a view, no copy
            r.schedule.verified(trees[i], path, [pendings[i], *new[:-1]], taken)
        news.append(new)
    shape = StepShape(sum(len(t) + 1 for t in trees), sum(sizes[i] for i in drafting), n, len(drafting))
    return news, sizes, shape
