"""Draft from everything a request holds (method ``mixed``): n-gram matches over its prompt and its own output, a
suffix cache of earlier responses, the target's recycled top-k next tokens and the DFlash drafter, merged in one draft
tree sized by the cost model.

Each step (``pipeline.decoding.step``):

1. ``prepare``: the request's new tokens go into its n-gram index (``pipeline.decoding.sources.NgramIndex``); the
   continuations of the longest suffix match of its tokens (over its own tokens, then the shared suffix cache of
   earlier responses) and the recycled candidates' small tree (``RecycledTokens``) become chains of nodes, each
   node's conditional acceptance estimated by ``SourceStats`` (observed acceptance by source, match length or rank,
   and depth, shared by the requests of one method, with a prior; then the request's own, with the method's as its
   prior); the free tree's best size and expected tokens per ms are taken on the measured verify costs, corrected by
   the verifies' observed times (``pipeline.costs.ObservedCosts``; no draft cost). The drafter runs when its drafted
   steps have yielded more tokens per ms (realized: tokens taken over the step's predicted cost, a running mean per
   request seeded by the method's) than this free tree promises, else it looks again after 1, 2, 4, ... ``max_skip`` steps: where a
   long match already fills the tree the cost model wants, or where the drafter does not pay, its draft is saved;
2. ``choose_tree``: the drafter's best-first tree (``TreeSchedule``: its calibrated top-k candidates) and the free
   chains merged into one trie (``merge_paths``: a token proposed at the same place by two sources is one node, its
   acceptance the larger estimate, siblings' estimates capped to share at most 1), ordered by path acceptance, and cut
   where expected tokens per ms peak (``widths.best_count`` on draft cost + verify cost by rows), so "verify nothing"
   stays a choice;
3. ``verified``: every offered free node (its parent taken) counts toward its bucket; the recycled table takes the
   target's top-k at the accepted rows; a drafted step's realized rate updates the drafter's.

Lossless at every T like every tree: the target's own (position-keyed) token decides each node.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.costs import CostModel, ObservedCosts
from pipeline.costs.monitor import ObservedRowCost
from pipeline.decoding.sampling import top_indices
from pipeline.decoding.sources import Continuation, NgramIndex
from pipeline.decoding.trees import DraftTree, grow
from pipeline.policy.calibration import AcceptanceCalibration
from pipeline.policy.core import BackOff
from pipeline.policy.trees import TreeSchedule
from pipeline.policy.widths import best_count

SOURCES = ("drafter", "ngram", "cache", "recycle")
"""The draft sources ``policy.mixed.sources`` may name."""

MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 13)
"""Lower bounds of the match-length buckets of the free nodes' acceptance estimate."""
DEPTH_BUCKETS = 8
"""Depths 1..8 estimated apart; deeper nodes share depth 8's estimate."""
MIN_PATH_VALUE = 0.02
"""A free chain ends where its path acceptance falls below this, and in a batched step also below what one more verified
row adds over the request's share of the step (0.8 x, ``prepare``; ~45% at 16 requests on two cores): such a node
never raises the step's tokens per ms, so it is neither estimated nor merged."""
REQUEST_PRIOR_WEIGHT = 8.0
"""A request's own observed acceptance per bucket, over the method's estimate as a prior of this many observations: a
request whose matches fare worse than the method's (chat, role play: few long matches) stops verifying them."""


_BUCKET_OF = tuple(max([0] + [i for i, lo in enumerate(MATCH_BUCKETS) if m >= lo]) for m in range(MATCH_BUCKETS[-1] + 1))


def _bucket(match: int) -> int:
    return _BUCKET_OF[min(max(int(match), 0), MATCH_BUCKETS[-1])]


class SourceStats:
    """Observed acceptance of the free sources' nodes, by (source, match-length bucket, depth): P(the target takes the
    node | it took the node's parent), with a Beta prior of ``prior_weight`` pseudo-observations at ``prior(match)``.
    Shared by every request of one method (one eval run's, one server's), kept current while decoding.

    Attributes:
        offered, accepted: {(source, bucket, depth): count}.
    """

    def __init__(self, prior_weight: float = 4.0):
        self.prior_weight = float(prior_weight)
        self.offered: dict[tuple[str, int, int], int] = {}
        self.accepted: dict[tuple[str, int, int], int] = {}

    @staticmethod
    def prior(source: str, feature: int) -> float:
        """The prior acceptance of a node: after an n-gram match of ``feature`` tokens 0.3 (one token) rising to 0.8; a
        recycled candidate of rank ``feature`` - 1, 0.3 / rank."""
        if source == "recycle":
            return 0.3 / max(1, feature)
        return min(0.8, 0.2 + 0.1 * feature)

    def key(self, source: str, feature: int, depth: int) -> tuple[str, int, int]:
        return source, _bucket(feature), min(int(depth), DEPTH_BUCKETS)

    def estimate(self, source: str, feature: int, depth: int, prior: float | None = None) -> float:
        """P(taken | parent taken) of a node of ``source`` with ``feature`` (match length, or rank + 1) at ``depth``;
        ``prior``: the prior mean instead of ``prior(source, feature)`` (a request's own stats over the method's)."""
        k = self.key(source, feature, depth)
        w = self.prior_weight
        mean = self.prior(source, feature) if prior is None else prior
        return (self.accepted.get(k, 0) + w * mean) / (self.offered.get(k, 0) + w)

    def observe(self, source: str, match: int, depth: int, taken: bool) -> None:
        k = self.key(source, match, depth)
        self.offered[k] = self.offered.get(k, 0) + 1
        self.accepted[k] = self.accepted.get(k, 0) + int(taken)

    def summary(self) -> dict:
        """{source: (offered, accepted)} over all buckets."""
        out: dict[str, list[int]] = {}
        for (source, _, _), n in self.offered.items():
            row = out.setdefault(source, [0, 0])
            row[0] += n
        for (source, _, _), n in self.accepted.items():
            out[source][1] += n
        return {s: tuple(v) for s, v in out.items()}


class RecycledTokens:
    """The target's own next-token candidates, recycled (Token Recycling, arXiv 2408.08696): for every token id, the
    top ``k`` tokens the target's logits gave after it the last time it was verified on an accepted path ([vocab, k]
    ids, -1 where none yet). Refreshed from every verify; read to draft a small tree from the pending token.
    """

    def __init__(self, vocab: int, k: int = 4):
        self.k = int(k)
        self.table = torch.full((int(vocab), self.k), -1, dtype=torch.long)

    def update(self, tokens: list[int], logits: torch.Tensor) -> None:
        """``logits`` [r, V] are the target's at the rows whose input tokens are ``tokens`` (r ids)."""
        self.table[torch.tensor(tokens)] = top_indices(logits.float(), self.k)

    def chains(self, pending: int, widths: tuple[int, ...], room: int) -> list[tuple[list[int], list[int]]]:
        """The tree of candidates from ``pending``: ``widths[d]`` children per node at depth d + 1 (within ``room``
        depths); each leaf's path as (tokens, ranks)."""
        out: list[tuple[list[int], list[int]]] = []

        def walk(token: int, depth: int, path: list[int], ranks: list[int]) -> None:
            if depth >= min(len(widths), room):
                if path:
                    out.append((path, ranks))
                return
            row = self.table[token, : widths[depth]].tolist()
            nexts = [(r, t) for r, t in enumerate(row) if t >= 0]
            if not nexts:
                if path:
                    out.append((path, ranks))
                return
            for r, t in nexts:
                walk(t, depth + 1, path + [t], ranks + [r])

        walk(int(pending), 0, [], [])
        return out


class SharedSources:
    """What the requests of one method share: the free nodes' ``SourceStats``, the suffix cache of earlier responses
    (an ``NgramIndex`` of at most ``cache_tokens`` tokens; None: no cache), the recycled candidates
    (``RecycledTokens`` over ``vocab`` ids; None: none) and the method's ``ObservedCosts`` (None: the cost model as
    measured; the method table gives one, a test with a synthetic cost model none)."""

    def __init__(self, cache_tokens: int | None = 65536, max_n: int = 4, vocab: int | None = None,
                 observed: ObservedCosts | None = None):
        self.stats = SourceStats()
        self.cache = NgramIndex(max_n, keep=3, max_tokens=cache_tokens) if cache_tokens else None
        self.recycled = RecycledTokens(vocab) if vocab else None
        self.drafted_rate: float | None = None  # the drafted steps' realized tokens per predicted ms, all requests
        self.observed = observed  # the batch-1 verify curve corrected by the verifies' observed times (None: as measured)
        self.row_cost = ObservedRowCost()  # what a verified row adds to a batched step, as the steps measure it
        self._curves: dict[tuple, list[float]] = {}

    def seed(self, responses) -> int:
        """Put earlier responses (token id lists, ``read_responses``) into the suffix cache, oldest first, as if this
        method had served them (a cache of ``cache_tokens`` keeps the latest); returns the tokens now held."""
        if self.cache is not None:
            for tokens in responses:
                self.cache.new_segment(tokens)
        return self.cache.tokens_held if self.cache is not None else 0

    def load_curve(self, costs, load: int, nodes: int) -> list[float]:
        """A request's cost of a batched step of ``load`` requests with 0..``nodes`` nodes of its own verified: its share
        of the others' plain step plus every ms its rows add (``costs``: a ``BatchCostModel``; a row at least what the
        steps measured, ``row_cost``), kept per load, model tables and measured row cost (each request of a step reads
        the same curve)."""
        per_row = self.row_cost.per_row() or 0.0
        key = (load, nodes, tuple(costs.verify_ms), costs.verify_per_request_ms, round(per_row, 3))
        curve = self._curves.get(key)
        if curve is None:
            if len(self._curves) > 256:
                self._curves.clear()
            plain = costs.step_ms(load, 0, load)
            curve = self._curves[key] = [plain / load + max(costs.step_ms(load + k, 0, load) - plain, per_row * k)
                                         for k in range(nodes + 1)]
        return curve


def read_responses(paths, target: str | None = None) -> dict[str, list[int]]:
    """The responses of earlier eval runs, for ``policy.mixed.cache_seed``: {request id: output ids} of every request
    of each run's rows.jsonl (``python -m pipeline.evaluate``'s, beside its results.json), its ``ar`` row where it has
    one, else its first method's.

    Args:
        target: the target these token ids must come from (``model.target``), or None: not checked.
    Raises:
        ValueError: for a missing or unreadable file, one of another target, or one with no response; the message
            names the fix.
    """
    out: dict[str, list[int]] = {}
    for path in paths:
        path = Path(str(path))
        fix = ("policy.mixed.cache_seed takes the rows.jsonl of earlier eval runs on this target (python -m "
               "pipeline.evaluate ... writes data/eval/<run>/rows.jsonl)")
        if not path.is_file():
            raise ValueError(f"policy.mixed.cache_seed: {path} is not a file; {fix}")
        found = 0
        with open(path) as f:
            for n, line in enumerate(f, 1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"policy.mixed.cache_seed: {path} line {n} is not JSON ({err}); {fix}") from None
                settings = record.get("settings")
                if settings is not None:
                    seeded = (settings.get("model") or {}).get("target")
                    if target is not None and seeded is not None and str(seeded) != str(target):
                        raise ValueError(f"policy.mixed.cache_seed: {path} holds responses of target {seeded}, not "
                                         f"{target}: their token ids are another tokenizer's; seed from a run on {target}")
                    continue
                rows = record.get("rows") or {}
                row = rows.get("ar") or next((r for r in rows.values() if r.get("output_ids")), None)
                if row and row.get("output_ids"):
                    out[str(record.get("id"))] = [int(t) for t in row["output_ids"]]
                    found += 1
        if not found:
            raise ValueError(f"policy.mixed.cache_seed: {path} holds no response (no request row with output_ids); {fix}")
    return out


def merge_paths(tree: DraftTree, chains: list[tuple[list[int], list[float], list[object]]], max_nodes: int
                ) -> tuple[DraftTree, list[list[object]]]:
    """``tree`` (best-first, ``values`` its path acceptances) and ``chains`` (each: tokens from the root, each node's
    conditional acceptance, each node's tag) merged into one best-first tree of at most ``max_nodes`` nodes.

    A chain node whose token already sits at the same place is the same node (its acceptance the larger of the two);
    a parent's children's acceptances are scaled to sum to at most 1; each node's value is the product along its path;
    nodes are ordered by value (a parent before its children).

    Returns:
        (the merged tree, each node's tags: the chain tags that landed on it).
    """
    tokens, parents, ranks, conds, tags = [], [], [], [], []
    children: dict[tuple[int, int], int] = {}
    for j, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
        parent_value = 1.0 if p < 0 else tree.values[p]
        tokens.append(int(tok)), parents.append(p), ranks.append(tree.ranks[j]), tags.append([])
        conds.append(tree.values[j] / parent_value if parent_value > 0 else 0.0)
        children[(p, int(tok))] = j
    for chain_tokens, chain_conds, chain_tags in chains:
        parent = -1
        for tok, a, tag in zip(chain_tokens, chain_conds, chain_tags):
            node = children.get((parent, int(tok)))
            if node is None:
                node = len(tokens)
                tokens.append(int(tok)), parents.append(parent), ranks.append(0), conds.append(0.0), tags.append([])
                children[(parent, int(tok))] = node
            conds[node] = max(conds[node], float(a))
            tags[node].append(tag)
            parent = node
    sums: dict[int, float] = {}
    for p, a in zip(parents, conds):
        sums[p] = sums.get(p, 0.0) + a
    depth, value = [0] * len(tokens), [0.0] * len(tokens)
    for j, p in enumerate(parents):  # parents come first: the tree's order, then each chain's
        scale = 1.0 / sums[p] if sums[p] > 1.0 else 1.0
        depth[j] = 1 if p < 0 else depth[p] + 1
        value[j] = conds[j] * scale * (1.0 if p < 0 else value[p])
    kept: set[int] = set()  # best first: a parent (value >= its child's, shallower on ties) before its children
    order = []
    for j in sorted(range(len(tokens)), key=lambda j: (-value[j], depth[j], j))[:max_nodes]:
        if parents[j] < 0 or parents[j] in kept:
            kept.add(j)
            order.append(j)
    where = {j: i for i, j in enumerate(order)}
    merged = DraftTree([tokens[j] for j in order], [where[parents[j]] if parents[j] >= 0 else -1 for j in order],
                       [depth[j] for j in order], [ranks[j] for j in order], [value[j] for j in order],
                       [tuple(sorted({t[0] for t in tags[j]} | ({"drafter"} if j < len(tree) else set())))
                        for j in order])
    return merged, [tags[j] for j in order]


def continuations(tokens: list[int], room: int, branches: int, index: NgramIndex | None, segment: int | None,
                  cache: NgramIndex | None, cache_segment: int | None) -> list[Continuation]:
    """What the free n-gram sources propose after ``tokens`` (the request's own, ``index``'s segment ``segment``):
    continuations of at most ``room`` tokens from its own index first, then from the suffix cache of earlier responses
    (its own segment there excluded), at most ``branches`` with distinct first tokens. None: that source is off."""
    found: list[Continuation] = []
    if index is not None and room > 0:
        found = index.lookup(tokens, room, branches, exclude=(segment, len(tokens) - 1))
    if cache is not None and room > 0 and len(found) < branches:
        own = (cache_segment, len(cache.segments.get(cache_segment, ())) - 1)
        firsts = {c.tokens[0] for c in found}
        found += [c for c in cache.lookup(tokens, room, branches, exclude=own, source="cache")
                  if c.tokens[0] not in firsts][: branches - len(found)]
    return found


class MixedSchedule(TreeSchedule):
    """The ``mixed`` method's schedule (module doc).

    Args:
        calibration, costs, block_size, skip_drafts, max_skip, objective, top_k, max_nodes: as ``TreeSchedule`` (the
            drafter's part; ``block_size`` 1 or no calibration: the free sources alone).
        shared: the method's ``SharedSources``.
        sources: which of ``SOURCES`` to draft from.
        max_n: the longest n-gram matched; branches: continuations per lookup.
        recycle_widths: the recycled candidates' tree: children per node at depth 1, 2, ...
        batch_costs: the batched step cost model (``pipeline.costs.batched.BatchCostModel``), or None: with it, a tree
            in a batched step of ``load`` requests is sized on what its rows add to that step (``_verify_ms``).
    Raises:
        ValueError: for an unknown source, or as ``TreeSchedule``.
    """

    proposes = True
    chooses_trees = True

    def __init__(self, calibration: AcceptanceCalibration | None, costs: CostModel, block_size: int,
                 shared: SharedSources, sources=SOURCES, skip_drafts: bool = True, max_skip: int = 8,
                 objective: str = "rate", top_k: int = 4, max_nodes: int = 15, max_n: int = 4, branches: int = 2,
                 recycle_widths=(4, 2, 1), batch_costs=None):
        unknown = sorted(set(sources) - set(SOURCES))
        if unknown:
            raise ValueError(f"policy.mixed.sources {unknown} unknown; choose from {list(SOURCES)}")
        self.drafts = "drafter" in sources and int(block_size) >= 2 and calibration is not None
        super().__init__(calibration, costs, max(2, int(block_size)), None, skip_drafts, max_skip, objective, top_k,
                         max_nodes)
        if not self.drafts:
            self.max_block_size = 1
        self.shared, self.sources, self.batch_costs = shared, tuple(sources), batch_costs
        self.observed = shared.observed
        self.max_n, self.branches = int(max_n), int(branches)
        self.recycle_widths = tuple(int(w) for w in recycle_widths)
        self.index = NgramIndex(self.max_n, keep=3)
        self._segment = self._cache_segment = None
        self._seen = 0
        self._chains: list[tuple[list[int], list[float], list[object]]] = []
        self._free_rate = 0.0
        self._drafted_rate: float | None = None
        self._drafted = self._probe = False
        self._step_ms, self._plain_rate = 1.0, 0.0
        self._tags: list[list[object]] = []
        self._own = SourceStats(REQUEST_PRIOR_WEIGHT)

    def first(self, last_logits: torch.Tensor) -> int:
        b = super().first(last_logits)
        self._drafted_rate = None
        self.backoff = BackOff(self.max_skip)
        if self.shared.drafted_rate is not None and self.shared.drafted_rate * self._verify_ms(0, 0)[0] < 1.0:
            self.backoff.run = self.max_skip // 2  # the drafter has not paid lately: a new request looks later
            self.backoff.missed()
        self.index = NgramIndex(self.max_n, keep=3)
        self._segment, self._seen = None, 0
        self._own = SourceStats(REQUEST_PRIOR_WEIGHT)
        return b if self.drafts else 1

    # -- before the drafter ------------------------------------------------------------------------------------------
    def prepare(self, request, block_size: int) -> int:
        output = request.stats.output_ids
        if self._segment is None:
            self._segment = self.index.new_segment(request.prompt_ids)
            cache = self.shared.cache if "cache" in self.sources else None
            self._cache_segment = cache.new_segment() if cache is not None else None
        self.index.extend(self._segment, output[self._seen:])
        if self._cache_segment is not None and self._cache_segment in self.shared.cache.segments:
            self.shared.cache.extend(self._cache_segment, output[self._seen:])
        self._seen = len(output)
        tokens = self.index.segments[self._segment]
        start = request.state.start
        room = min(self.max_nodes, request.remaining - 1)
        found = continuations(tokens, room, self.branches, self.index if "ngram" in self.sources else None,
                              self._segment, self.shared.cache if "cache" in self.sources else None,
                              self._cache_segment)
        shared, own = self.shared.stats, self._own

        def estimate(source: str, feature: int, depth: int) -> float:  # the request's own rate, the method's as prior
            return own.estimate(source, feature, depth, shared.estimate(source, feature, depth))

        floor = MIN_PATH_VALUE
        if self.batch_costs is not None and self.load > 1:  # under load: below a row's share of the step, nothing pays
            curve = self._verify_ms(start, 1)
            floor = max(floor, 0.8 * (curve[1] - curve[0]) / curve[0])

        def chain(tokens: list[int], tags: list[tuple]) -> tuple[list[int], list[float], list[tuple]]:
            conds, value = [], 1.0
            for tag in tags:
                a = estimate(*tag)
                value *= a
                if value < floor:
                    break
                conds.append(a)
            return tokens[: len(conds)], conds, tags[: len(conds)]

        self._chains = [chain(c.tokens, [(c.source, c.match, d) for d in range(1, len(c.tokens) + 1)]) for c in found]
        recycled = self.shared.recycled if "recycle" in self.sources else None
        if recycled is not None and room > 0:
            for path, ranks in recycled.chains(request.state.pending, self.recycle_widths, room):
                self._chains.append(chain(path, [("recycle", r + 1, d) for d, r in enumerate(ranks, 1)]))
        self._chains = [c for c in self._chains if c[0]]
        self._drafted = self._probe = False
        if block_size > 1 and self.drafts:  # the free tree's rate decides whether the drafter runs
            free = merge_paths(DraftTree(), self._chains, self.max_nodes)[0].values if self._chains else []
            _, self._free_rate = best_count(free, 0.0, self._verify_ms(start, len(free)))
            rate = self._drafted_rate if self._drafted_rate is not None else self.shared.drafted_rate
            if rate is None or rate > self._free_rate:
                self._drafted = True
            elif not self.backoff.skipping():  # the drafter has not paid: look again after 1, 2, 4, ... steps
                self._drafted = self._probe = True
        return block_size if self._drafted else 1

    def _verify_ms(self, start: int, nodes: int) -> list[float]:
        """The step's cost to this request with 0..``nodes`` nodes verified: alone, the batch-1 model's verify of
        1 + n rows; in a batched step of ``load`` requests (with ``batch_costs``), its share of the others' plain step
        plus every ms its n rows add to it (a row that costs ~12% of a step alone costs ~70% of one request's share at 16
        on two cores: under load only nodes likely to be taken pay)."""
        if self.batch_costs is None or self.load <= 1:
            return self.costs(self.max_nodes + 1, start)[1][: nodes + 1]  # corrected by ``observed``
        return self.shared.load_curve(self.batch_costs, self.load, self.max_nodes)[: nodes + 1]

    def timed_verify(self, rows: int, ms: float, start: int, requests: int = 1) -> None:
        if requests > 1:
            self.shared.row_cost.observe(rows, requests, ms)
        else:
            super().timed_verify(rows, ms, start)

    # -- the tree ---------------------------------------------------------------------------------------------------
    def choose_tree(self, tokens: torch.Tensor | None, probs: torch.Tensor | None, start: int) -> DraftTree:
        if tokens is None and not self._chains:  # nothing proposed: a plain step, priced as one
            self._tags = []
            self._step_ms = self._verify_ms(start, 0)[0]
            self._plain_rate = 1.0 / self._step_ms
            return DraftTree()
        draft_ms = 0.0
        drafted = DraftTree()
        if tokens is not None:
            draft_ms = self.costs(tokens.shape[0] + 1, start)[0]
            drafted = grow(tokens, self.acceptance(probs), self.max_nodes)
        tree, self._tags = merge_paths(drafted, self._chains, self.max_nodes)
        verify_ms = self._verify_ms(start, len(tree))
        n = self.choose_count(tree.values, draft_ms, verify_ms)
        self._step_ms, self._plain_rate = draft_ms + verify_ms[n], 1.0 / verify_ms[0]
        self._tags = self._tags[:n]
        return tree.prefix(n)

    # -- after the verify -------------------------------------------------------------------------------------------
    def verified(self, tree: DraftTree, path: list[int], tokens: list[int], logits: torch.Tensor) -> None:
        if self.shared.recycled is not None and "recycle" in self.sources:
            self.shared.recycled.update(tokens, logits)
        if self._drafted:  # what a drafted step yielded per (predicted) ms: the drafter's realized rate
            rate = (len(path) + 1) / self._step_ms
            before = self._drafted_rate if self._drafted_rate is not None else self.shared.drafted_rate
            self._drafted_rate = rate if before is None else 0.7 * before + 0.3 * rate
            shared = self.shared.drafted_rate
            self.shared.drafted_rate = rate if shared is None else 0.9 * shared + 0.1 * rate
            if self._probe:  # judged on the running rate, not one lucky step
                self.backoff.paid() if self._drafted_rate > self._plain_rate else self.backoff.missed()
        taken = set(path)
        stats, own = self.shared.stats, self._own
        for j, (p, node_tags) in enumerate(zip(tree.parents, self._tags)):
            if p >= 0 and p not in taken:
                continue
            for source, match, depth in node_tags:
                stats.observe(source, match, depth, j in taken)
                own.observe(source, match, depth, j in taken)

    def next(self, tau: int, block_size: int) -> int:
        return self._chosen if self.drafts else 1  # whether the drafter runs is ``prepare``'s choice, step by step
