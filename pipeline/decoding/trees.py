"""Draft trees: the drafter's best branches from one block forward, verified in one target forward.

A DFlash drafter scores every position of its block at once, so one forward gives the top candidates at each of the
B-1 drafted positions. A tree (DDTree, arXiv 2604.12989) keeps the candidates most likely to be accepted: node n is
the rank-``rank`` candidate at depth ``depth`` (position start + depth) under its parent, and its value is the
estimated probability that the whole path to it is accepted (the product of its nodes' conditional acceptances).
``grow`` adds nodes best first (a max-heap of the frontier: a node's first child and its next sibling), so every
prefix of the node order is the subtree of that many nodes with the most expected accepted tokens, and it contains the
chain of the rank-0 candidates as far as those pay. How many nodes a step verifies is the policy's choice
(``pipeline.policy.trees``, on this machine's cost curve).

The verify runs the pending token (row 0) and the nodes (rows 1..n, in ``grow``'s order: a parent before its children)
in one target forward; each row attends to the cached context, its ancestors and itself (``row_parents``; the smallm
kernel's ``attend`` with per-row parents, where a row reads the same keys in the same order as the causal row of its
path, so the same bits; ``tree_mask`` on transformers' paths). ``walk`` then follows the target's own token from the
root: a node is accepted when it equals the target's token at its parent (at T>0 the target's position-keyed sample),
so the output is the target's, token for token, at every T. The accepted path's keys/values are moved behind the
context (``pipeline.models.cache.compact``) and the rest dropped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch


TOP_K = 4
"""Candidates per drafted position a tree draws from by default (``policy.tree.top_k``; the label stage records as many
with each calibration sample, ``label.tree_top_k``)."""


@dataclass
class DraftTree:
    """Nodes of a draft tree in best-first order (a parent before its children).

    Attributes:
        tokens: each node's token id; parents: its parent node (-1: a child of the root, the pending token);
        depths: 1 for the root's children, ...; ranks: its candidate's rank at its depth (0: the drafter's first
        choice); values: the estimated probability that the path to it is accepted (non-increasing in node order);
        sources: each node's draft sources (``pipeline.policy.mixed.SOURCES``: a token two sources proposed at one
        place is one node of both), or None: the drafter's alone.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    sources: list[tuple[str, ...]] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], values: list[float] | None = None) -> "DraftTree":
        """A chain of ``tokens`` (each node the child of the one before): a chain of drafts is a tree."""
        n = len(tokens)
        return cls([int(t) for t in tokens], list(range(-1, n - 1)), list(range(1, n + 1)), [0] * n,
                   list(values) if values is not None else [1.0] * n)

    def is_chain(self) -> bool:
        """Whether every node is the child of the node before it (its verify rows are causal rows)."""
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def prefix(self, n: int) -> "DraftTree":
        """The first ``n`` nodes (a tree: parents come first)."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.ranks[:n], self.values[:n],
                         None if self.sources is None else self.sources[:n])

    def source_counts(self, path: list[int]) -> dict[str, list[int]]:
        """{source: [its nodes verified, its nodes accepted]} of this tree verified with ``path`` accepted (a node of
        several sources counts for each; ``sources`` None: all the drafter's)."""
        taken, out = set(path), {}
        for j in range(len(self.tokens)):
            for source in (self.sources[j] if self.sources is not None else ("drafter",)):
                row = out.setdefault(source, [0, 0])
                row[0] += 1
                row[1] += j in taken
        return out

    def row_parents(self) -> list[int]:
        """Each verify row's parent row: row 0 is the pending token (-1), row j + 1 is node j."""
        return [-1] + [p + 1 for p in self.parents]

    def row_depths(self) -> list[int]:
        """Each verify row's offset from the pending token's position (0 for the pending token)."""
        return [0] + list(self.depths)

    def walk(self, target_tokens: list[int]) -> tuple[list[int], int]:
        """The accepted path and the bonus token, from the target's token at every verify row.

        Args:
            target_tokens: [n + 1] the target's next token after each row (row 0: after the pending token).
        Returns:
            (accepted nodes in order, the bonus token: the target's token after the last accepted row).
        """
        children: dict[int, dict[int, int]] = {}
        for j, (p, tok) in enumerate(zip(self.parents, self.tokens)):
            children.setdefault(p, {}).setdefault(int(tok), j)
        path, node = [], -1
        while True:
            want = int(target_tokens[node + 1])
            nxt = children.get(node, {}).get(want)
            if nxt is None:
                return path, want
            path.append(nxt)
            node = nxt


def grow(tokens: torch.Tensor, acceptance: torch.Tensor, max_nodes: int) -> DraftTree:
    """The best-first tree of up to ``max_nodes`` nodes.

    Args:
        tokens: [D, K] candidate token ids at depths 1..D, best first at each depth.
        acceptance: [D, K] each candidate's estimated probability of being the target's token given that its parent
            was (non-increasing along K; a depth's values should sum to at most 1).
        max_nodes: the most nodes (0: an empty tree).
    Returns:
        ``DraftTree`` in best-first order (``values`` non-increasing).
    """
    tokens = torch.as_tensor(tokens).reshape(tokens.shape[0], -1).tolist()
    a = torch.as_tensor(acceptance, dtype=torch.float64).reshape(len(tokens), -1).tolist()
    tree = DraftTree()
    if not tokens or max_nodes <= 0:
        return tree
    depth_count, k_count = len(tokens), len(tokens[0])
    # frontier entries: (-value, tie-break, depth index, rank, parent node, parent value)
    heap = [(-a[0][0], 0, 0, 0, -1, 1.0)]
    pushed = 1
    while heap and len(tree) < max_nodes:
        neg, _, d, r, parent, parent_value = heapq.heappop(heap)
        value = -neg
        node = len(tree)
        tree.tokens.append(int(tokens[d][r]))
        tree.parents.append(parent)
        tree.depths.append(d + 1)
        tree.ranks.append(r)
        tree.values.append(value)
        if r + 1 < k_count:  # the next sibling
            heapq.heappush(heap, (-parent_value * a[d][r + 1], pushed, d, r + 1, parent, parent_value))
            pushed += 1
        if d + 1 < depth_count:  # the first child
            heapq.heappush(heap, (-value * a[d + 1][0], pushed, d + 1, 0, node, value))
            pushed += 1
    return tree


def depth_exclusive(acceptance: torch.Tensor) -> torch.Tensor:
    """[D, K] acceptance estimates made consistent across the candidates of one depth: the target takes at most one of
    them, so each value is capped by what the better-ranked ones leave (their running sum stays <= 1)."""
    a = torch.as_tensor(acceptance, dtype=torch.float64).clamp(0.0, 1.0)
    before = torch.cumsum(a, dim=1) - a
    return torch.minimum(a, (1.0 - before).clamp(min=0.0))


def step_record(tree: DraftTree, path: list[int]) -> dict:
    """A tree step as the eval stage keeps it: each node's parent, depth, rank and value, and the accepted nodes."""
    return {"q": list(tree.parents), "d": list(tree.depths), "r": list(tree.ranks),
            "v": [round(float(v), 6) for v in tree.values], "p": list(path)}


def tree_summary(records: list[dict]) -> dict | None:
    """The shapes of a decode's trees and how each (depth, rank) fared, from ``step_record``s (None without any).

    Returns:
        ``steps`` (tree steps, the empty ones included), ``nodes`` (mean nodes per step), ``depth`` (mean deepest node),
        ``accepted`` (mean accepted nodes per step), ``shape`` (mean nodes at depth 1, 2, ...), ``branching`` (mean
        children of a node that has any, at depth 0 (the root), 1, ...) and the rank-acceptance table ``ranks``:
        ``offered[d][r]``, the rank-r candidates at depth d + 1 whose parent the target took (so it could take them),
        ``accepted[d][r]``, those it took, and ``predicted[d][r]``, the sum of their estimated conditional acceptances
        (each node's value over its parent's): ``predicted / offered`` against ``accepted / offered`` is the
        estimator's calibration per depth and rank.
    """
    if not records:
        return None
    depth = max(max(r["d"], default=0) for r in records)
    ranks = max(max(r["r"], default=-1) for r in records) + 1
    offered = [[0] * ranks for _ in range(depth)]
    accepted = [[0] * ranks for _ in range(depth)]
    predicted = [[0.0] * ranks for _ in range(depth)]
    shape = [0] * depth
    children, parents = [0] * (depth + 1), [0] * (depth + 1)
    for r in records:
        path = set(r["p"])
        counts: dict[int, int] = {}
        for j, (p, d, k) in enumerate(zip(r["q"], r["d"], r["r"])):
            shape[d - 1] += 1
            counts[p] = counts.get(p, 0) + 1
            if p < 0 or p in path:
                offered[d - 1][k] += 1
                accepted[d - 1][k] += int(j in path)
                if "v" in r:
                    parent_value = 1.0 if p < 0 else r["v"][p]
                    predicted[d - 1][k] += r["v"][j] / parent_value if parent_value > 0 else 0.0
        for p, c in counts.items():
            level = 0 if p < 0 else r["d"][p]
            children[level] += c
            parents[level] += 1
    n = len(records)
    return {"steps": n, "nodes": sum(len(r["d"]) for r in records) / n,
            "depth": sum(max(r["d"], default=0) for r in records) / n,
            "accepted": sum(len(r["p"]) for r in records) / n,
            "shape": [s / n for s in shape],
            "branching": [c / p if p else 0.0 for c, p in zip(children, parents)],
            "ranks": {"offered": offered, "accepted": accepted, "predicted": [[round(x, 3) for x in row] for row in predicted]}}
