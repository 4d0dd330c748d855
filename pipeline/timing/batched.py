"""The cost of a batched step on this machine (``pipeline.costs.BatchCostModel``): measured, checked, cached.

``measure_batch_costs`` prefills enough random prompts of ``context`` tokens, then times, as points of one interleaved
measurement (``pipeline.costs.timer``), with ``pipeline.models.forward``:

- the target forward over R total rows (the LM head and each request's sampling included), for R in ``rows``, the rows
  split over the fewest requests that hold them (at most ``max_block`` rows each: B, or ``FREE_ROWS`` without a
  drafter), and q = min(B, max rows) rows as q requests of one row (against one request of q rows: the difference /
  (q - 1) is the per-request cost);
- the drafter forward over blocks of B (one step's worth of pending context features each) for 1, 2, 4 ...
  ``max_requests`` drafting requests, and B / 2 blocks of 2 rows against one block of B (the per-request draft cost).

Each request's caches are rolled back after every point, so all points see the same context. Points that break the
cost's shape (more rows cheaper) are timed again (``pipeline.costs.timer.retime``). ``batch_costs_of`` obtains the
model from the per-machine cache after a spot check of it (``spot_check``), else measures it.
"""

from __future__ import annotations

import logging
import platform
from typing import Sequence

import torch

from pipeline.costs import BatchCostModel, check_batch_cost_settings, monotone, store, suspect_points
from pipeline.models.cache import crop_to
from pipeline.timing.fixture import (SPOT_TOLERANCE, WARM, draft_cache_at, first_loaded, measure_points, prefill,
                                     random_ids)

log = logging.getLogger(__name__)
PREFIX = "batch-costs"
FREE_ROWS = 8  # rows a request verifies per step in the points of a decoder without a drafter (a free-source tree's)


def verify_block(decoder, block_size: int) -> int:
    """The most rows a request verifies in a timed step: B (at least 2) with a drafter; without one, ``block_size``
    where it is above 1, else ``FREE_ROWS`` (so the per-request cost is measured apart from the rows' either way)."""
    if decoder.drafter is not None or int(block_size) > 1:
        return max(2, int(block_size))
    return FREE_ROWS


class BatchPoints:
    """The timed points of batched steps over ``need`` prefilled requests (see the module doc)."""

    PENDING = 2  # about one step's accepted tokens of new context features

    def __init__(self, decoder, block_size: int, context: int, need: int, seed: int = 0):
        from pipeline.decoding.sampling import PositionKeyedSampler

        self.decoder, self.context = decoder, int(context)
        self.has_drafter = decoder.drafter is not None
        if self.has_drafter:
            decoder.check_block_size(block_size)
        self.max_block = verify_block(decoder, block_size)
        if context + self.max_block + 1 > decoder.max_context:
            raise ValueError(f"batch cost context {context} + B {self.max_block} exceeds the target's "
                             f"{decoder.max_context} positions; use a shorter context")
        self.forward = decoder.forward
        vocab = decoder.lm_head.shape[0]
        gen = torch.Generator().manual_seed(seed)
        self.sampler = PositionKeyedSampler(0.0, seed, vocab)
        self.caches, self.feats = [], []
        for _ in range(need):
            cache, _, features = prefill(decoder, random_ids(decoder, context, gen))
            self.caches.append(cache)
            self.feats.append(features)
        self.block_ids = random_ids(decoder, self.max_block, gen)

    def split_rows(self, total: int) -> list[int]:
        """``total`` rows over the fewest requests of at most B rows each, as even as can be."""
        n = -(-total // self.max_block)
        return [total // n + (1 if i < total % n else 0) for i in range(n)]

    def verify(self, split: list[int]):
        """A target forward over requests of ``split`` rows each."""
        forward, caches, ctx, block = self.forward, self.caches, self.context, self.block_ids

        def run() -> None:
            outs = forward.target([block[:, :q] for q in split], caches[: len(split)], [ctx] * len(split),
                                  [self.has_drafter] * len(split))
            for (logits, _), c in zip(outs, caches):
                self.sampler.pick(logits, ctx + 1)
                crop_to(c, ctx)

        return run

    def draft(self, sizes: list[int]):
        """A drafter forward over blocks of ``sizes`` rows (one per request)."""

        dec, ctx, pending, block = self.decoder, self.context, self.PENDING, self.block_ids
        dcaches = [draft_cache_at(dec, block[:, :2], self.feats[i], ctx, pending) for i in range(len(sizes))]

        def run() -> None:
            hidden = self.forward.draft_hidden([block[:, :b] for b in sizes],
                                               [self.feats[i][:, ctx - pending:] for i in range(len(sizes))],
                                               [ctx] * len(sizes), dcaches)
            for dc in dcaches:
                crop_to(dc, ctx - pending)
            for lg in self.forward.draft_logits([h[0, 1:] for h in hidden]):
                self.sampler.pick_columns(lg, ctx + 1, dec.draft_vocab)

        return run


def _draft_counts(max_requests: int) -> list[int]:
    return [n for n in (1, 2, 4, 8, 16, 32) if n <= max_requests]


@torch.inference_mode()
def measure_batch_costs(decoder, block_size: int = 8, context: int = 128, max_requests: int = 16,
                        rows: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 5, seed: int = 0
                        ) -> BatchCostModel:
    """Time batched steps on this machine (see the module doc); ``repeats``: rounds after one warm-up round.

    Raises:
        ValueError: for repeats < 1, a block size beyond the drafter's limit, or a context that leaves no room for a
            block.
    """
    if repeats < 1:
        raise ValueError(f"batch cost repeats must be >= 1, got {repeats}")
    rows = sorted({int(r) for r in rows if int(r) >= 1})
    b = verify_block(decoder, block_size)
    need = max(max_requests, *[-(-r // b) for r in rows], b, 2)
    bench = BatchPoints(decoder, block_size, context, need, seed)
    q = min(bench.max_block, max(rows))
    points = {("verify", r): bench.verify(bench.split_rows(r)) for r in rows}
    if q > 1:
        points[("verify_ones", q)] = bench.verify([1] * q)
        points[("verify_one", q)] = bench.verify([q])
    counts = _draft_counts(max_requests) if bench.has_drafter else []
    pairs = bench.max_block // 2  # blocks of 2 rows, against one block of their rows (at most B rows)
    if bench.has_drafter:
        points.update({("draft", n): bench.draft([bench.max_block] * n) for n in counts})
        if pairs >= 2:
            points[("draft_pairs", pairs)] = bench.draft([2] * pairs)
            points[("draft_joint", pairs)] = bench.draft([2 * pairs])

    def suspects(timings) -> set:
        out = set()
        for part in ("verify", "draft"):
            keys = sorted(k for k in points if k[0] == part)
            table = {i: [timings[k].ms] for i, k in enumerate(keys)}
            out |= {keys[i] for i, _ in suspect_points(table)}
        return out

    timings, check = measure_points(decoder, points, suspects, repeats, "batched step costs of this machine")
    ms = {k: t.ms for k, t in timings.items()}
    per_request = max(0.0, (ms[("verify_ones", q)] - ms[("verify_one", q)]) / (q - 1)) if q > 1 else 0.0
    verify_ms = monotone([max(1e-3, ms[("verify", r)] - per_request * (len(bench.split_rows(r)) - 1)) for r in rows])
    draft_rows, draft_ms, draft_per_request = [bench.max_block], [0.0], 0.0
    if bench.has_drafter:
        if pairs >= 2:  # B < 4: no two blocks of 2 fit in one block, so no per-request share is measured
            draft_per_request = max(0.0, (ms[("draft_pairs", pairs)] - ms[("draft_joint", pairs)]) / (pairs - 1))
        draft_rows = [n * bench.max_block for n in counts]
        draft_ms = monotone([max(1e-3, ms[("draft", n)] - draft_per_request * (n - 1)) for n in counts])
    spread = {"verify": [round(timings[("verify", r)].spread, 4) for r in rows],
              "draft": [round(timings[("draft", n)].spread, 4) for n in counts]}
    info = {"host": platform.node(), "threads": torch.get_num_threads(), "target": decoder.target.name,
            "forward": decoder.forward_path(), "exact_batching": bench.forward.exact, "block_size": bench.max_block,
            "rounds": repeats, "check": check, "verify_raw_ms": {str(r): ms[("verify", r)] for r in rows}}
    return BatchCostModel(rows, verify_ms, draft_rows, draft_ms, per_request, draft_per_request, context, info, spread)


@torch.inference_mode()
def spot_check(decoder, costs: BatchCostModel, rounds: int = 3, tolerance: float = SPOT_TOLERANCE) -> str | None:
    """Re-time the stored model's narrowest and widest verify (as split when measured) on this machine now; returns
    why the model must be measured again (a point stored more than ``tolerance`` times slower than it runs now), or
    None."""
    raw = {int(r): float(v) for r, v in (costs.info.get("verify_raw_ms") or {}).items()}
    if not raw:
        return None
    picks = sorted({min(raw), max(raw)})
    block = int(costs.info.get("block_size") or 1)
    try:
        bench = BatchPoints(decoder, block, costs.context,
                            max(-(-r // max(1, block)) for r in picks))
    except ValueError as err:
        return str(err)
    loaded = first_loaded(decoder, {r: bench.verify(bench.split_rows(r)) for r in picks}, raw, rounds, tolerance)
    if loaded is None:
        return None
    r, then, now = loaded
    return (f"its step of {r} verified rows reads {then:.1f} ms, this machine takes {now:.1f} ms now (it was measured "
            "while other work shared the cores)")


def batch_costs_of(decoder, settings, model, block_size: int, max_requests: int, seed: int = 0,
                   setting: str = "policy.budget.costs", fresh: bool = False) -> BatchCostModel:
    """This machine's ``BatchCostModel`` from a config block: the one way the server's ``budget`` policy and
    ``pipeline.bench_batch`` obtain it: from the per-machine cache (keyed by the target and drafter, this host, torch's
    threads, the forward path and the arguments) when its ``spot_check`` passes, else measured and stored.

    Args:
        settings: ``{context, rows, repeats, cache, spot_check}`` (``policy.budget.costs``); ``cache`` null measures
            afresh; ``spot_check`` false reuses a cached model unchecked.
        model: the ``model`` config (its ``target`` and ``drafter`` key the cache).
        block_size: B of the timed draft blocks (``verify_block``: its rows per request); max_requests: the most
            requests timed together (``serve.max_batch``, the benchmark's largest concurrency).
        setting: the block's name, for messages; fresh: measure again and replace the cache (the run-time monitor).
    Raises:
        ValueError: for an empty ``rows``, ``context`` or ``repeats`` below 1 (naming ``setting``), or as
            ``measure_batch_costs``.
    """
    rows = check_batch_cost_settings(settings, setting)
    args = {"block_size": verify_block(decoder, block_size), "context": int(settings["context"]),
            "max_requests": int(max_requests), "rows": sorted(rows), "repeats": int(settings["repeats"]), "seed": int(seed)}
    cache_dir = settings.get("cache")
    if not cache_dir:
        return measure_batch_costs(decoder, **args)
    key = store.key(PREFIX, identity={"target": str(model.get("target")), "drafter": str(model.get("drafter"))},
                    forward=decoder.forward_path(), warm=WARM, **args)
    if fresh:
        costs = measure_batch_costs(decoder, **args)
        log.info("batched step costs: measured again and stored in %s",
                 store.put(cache_dir, key, "batch_costs", costs.to_dict()))
        return costs
    check = (lambda d: spot_check(decoder, BatchCostModel.from_dict(d))) if settings.get("spot_check", True) else None
    return BatchCostModel.from_dict(store.cached(
        cache_dir, key, "batch_costs", lambda: measure_batch_costs(decoder, **args).to_dict(), check=check))
