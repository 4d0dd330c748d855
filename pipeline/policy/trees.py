"""Draft trees sized by this machine's cost curve (method ``tree``): verify the drafter's best branches that pay.

Each drafted step the decoder hands over the drafter's top ``top_k`` candidates at each of the block's B-1 positions and
its probability of each (``SpeculativeDecoder.draft_candidates``). ``TreeSchedule.choose_tree``:

1. estimates each candidate's conditional acceptance (the probability that the target's token at that position is
   this candidate, given that its parent was accepted) with the drafts' calibration (``pipeline.policy.calibration``:
   for a first choice, the drafter's probability and the position's column, the model the chain's verify width reads;
   for a lower rank, its rank's model when the calibration has one (its probability and the first choice's there),
   never above a better rank's), capped so that one position's candidates share at most probability 1
   (``pipeline.decoding.trees.depth_exclusive``);
2. grows the best-first tree of up to ``max_nodes`` nodes (``pipeline.decoding.trees.grow``): its first n nodes are
   the n-node subtree with the most expected accepted tokens, ``1 + sum of their path acceptances``;
3. keeps the n that maximises expected tokens per ms, ``(1 + sum_{i<=n} v_i) / (draft_ms(B) + verify_ms(n + 1))`` on the
   measured step costs (``pipeline.costs.CostModel``): the CaDDTree objective (arXiv 2606.01813) on our calibration
   and cost model, chosen by the same rule as the chain's verify width (``VerifyWidthSchedule.choose_count``,
   ``pipeline.policy.widths.best_count``).

The chain is the special case of rank-0 nodes only and no drafting is n = 0, so a tree is never priced worse than the
chain it contains: for every n the best-first subtree holds at least the chain's expected tokens. The skip rule (skip
the drafter for 1, 2, 4, ... steps after a draft that did not pay) is ``verify_width``'s (``VerifyWidthSchedule``).
"""

from __future__ import annotations

import torch

from pipeline.costs import CostModel
from pipeline.decoding.trees import TOP_K, DraftTree, depth_exclusive, grow
from pipeline.policy.calibration import AcceptanceCalibration
from pipeline.policy.verify_width import VerifyWidthSchedule


class TreeSchedule(VerifyWidthSchedule):
    """Drafts at block size B, verifies the draft tree that maximises expected tokens per ms (module docstring).

    Args:
        calibration, costs, block_size, predictor, skip_drafts, max_skip, objective: as ``VerifyWidthSchedule``.
        top_k: candidates drafted at each position (the tree's widest branching).
        max_nodes: the most nodes a tree may have (its verify is max_nodes + 1 rows).
    Attributes:
        shapes: the chosen trees' nodes per depth, one list per drafted step.
    Raises:
        ValueError: as ``VerifyWidthSchedule``, or for top_k < 1 or max_nodes < 1.
    """

    chooses_widths = False
    chooses_trees = True

    def __init__(self, calibration: AcceptanceCalibration, costs: CostModel, block_size: int, predictor=None,
                 skip_drafts: bool = True, max_skip: int = 8, objective: str = "rate", top_k: int = TOP_K,
                 max_nodes: int = 15):
        super().__init__(calibration, costs, block_size, predictor, skip_drafts, max_skip, objective)
        if int(top_k) < 1 or int(max_nodes) < 1:
            raise ValueError(f"a draft tree needs top_k >= 1 and max_nodes >= 1, got top_k={top_k}, max_nodes={max_nodes}")
        self.top_k, self.max_nodes = int(top_k), int(max_nodes)

    def acceptance(self, probs: torch.Tensor) -> torch.Tensor:
        """[D, K] conditional acceptance estimates of the candidates whose drafter probabilities are ``probs`` [D, K]."""
        depth, k = probs.shape
        columns = torch.arange(1, depth + 1).repeat_interleave(k)
        ranks = torch.arange(k).repeat(depth)
        first = probs[:, :1].expand(depth, k).reshape(-1)
        a = self.calibration.predict(probs.reshape(-1), columns, ranks, first).reshape(depth, k)
        return depth_exclusive(torch.cummin(a, dim=1).values)  # a rank never above a better one (``grow``'s order)

    def choose_tree(self, tokens: torch.Tensor, probs: torch.Tensor, start: int) -> DraftTree:
        b = tokens.shape[0] + 1
        full = grow(tokens, self.acceptance(probs), self.max_nodes)
        draft_ms = self.costs(b, start)[0]
        verify_ms = self.costs(self.max_nodes + 1, start)[1][: len(full) + 1]  # rows 1..n + 1 (a verify of n nodes)
        return full.prefix(self.choose_count(torch.tensor(full.values, dtype=torch.float64), draft_ms, verify_ms))
