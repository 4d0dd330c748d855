"""The cost of one batched decode step (``BatchCostModel``), measured once per machine, models and forward path, and
cached like the single-request latency model (``pipeline.costs``). Module-level imports are the standard
library and numpy only (the cost layer sits below the policies; the measurement imports torch and the models lazily).

``measure_batch_costs`` prefills ``max_requests`` random prompts of ``context`` tokens, then times (the least of
``repeats`` runs after a warm-up, since other load only adds time) with ``pipeline.models.batched_forward``:

- the target forward over R total rows (the LM head and each request's sampling included), for R in ``rows``, the rows
  split over the fewest requests that hold them (at most ``max_block`` rows each), and at R = ``per_request_rows`` split
  as one request and as R requests of one row (the difference / (R - 1) is the per-request cost);
- the drafter forward over blocks of ``block_size`` (one step's worth of pending context features each) for 1, 2, 4 ...
  ``max_requests`` drafting requests, and one request's block of ``block_size`` against ``block_size`` / 2 blocks of 2
  rows (the per-request draft cost).

Each request's caches are rolled back after every timing, so all timings see the same context.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pipeline.costs import _cached, interp, monotone  # the one curve fit and cache of pipeline.costs

log = logging.getLogger(__name__)


@dataclass
class BatchCostModel:
    """The cost of one batched step (ms), by total verified rows, drafted rows and requests.

    ``step_ms(R, D, N, N_d) = verify(R) + verify_per_request_ms * (N - 1)
                              + [D > 0] * (draft(D) + draft_per_request_ms * (N_d - 1))``

    with ``verify`` / ``draft`` interpolated from the measured tables (rows -> ms: the forward, its LM head and
    sampling, as one request, or rows split over several when more than one request's worth) and the per-request
    terms the attention, masks and bookkeeping each extra request adds. Measured per machine and forward path by
    ``pipeline.costs.batched.measure_batch_costs_cached``.

    Attributes:
        verify_rows, verify_ms: the target-forward table; draft_rows, draft_ms: the drafter-forward table (rows
        ascending); verify_per_request_ms, draft_per_request_ms: ms per extra request; context: the context length
        it was measured at (tokens); info: how it was measured.
    Raises:
        ValueError: for empty or unsorted tables.
    """

    verify_rows: list[int]
    verify_ms: list[float]
    draft_rows: list[int]
    draft_ms: list[float]
    verify_per_request_ms: float = 0.0
    draft_per_request_ms: float = 0.0
    context: int = 128
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, xs, ys in (("verify", self.verify_rows, self.verify_ms), ("draft", self.draft_rows, self.draft_ms)):
            if not xs or len(xs) != len(ys) or list(xs) != sorted(set(xs)):
                raise ValueError(f"BatchCostModel: the {name} table needs ascending distinct rows with one ms each, "
                                 f"got {xs} / {ys}")

    def verify(self, rows: int) -> float:
        """One target forward over ``rows`` rows (ms)."""
        return max(1e-6, interp(rows, self.verify_rows, self.verify_ms))

    def draft(self, rows: int) -> float:
        """One drafter forward over ``rows`` block rows (ms); 0 for none."""
        return 0.0 if rows <= 0 else max(0.0, interp(rows, self.draft_rows, self.draft_ms))

    def step_ms(self, verified_rows: int, drafted_rows: int, requests: int, drafting: int = 0) -> float:
        """One batched step: a target forward over ``verified_rows`` rows of ``requests`` requests, after a drafter
        forward over ``drafted_rows`` block rows of ``drafting`` requests (ms)."""
        ms = self.verify(verified_rows) + self.verify_per_request_ms * max(0, requests - 1)
        if drafted_rows > 0:
            ms += self.draft(drafted_rows) + self.draft_per_request_ms * max(0, drafting - 1)
        return ms

    def to_dict(self) -> dict:
        return {"verify_rows": list(self.verify_rows), "verify_ms": list(self.verify_ms),
                "draft_rows": list(self.draft_rows), "draft_ms": list(self.draft_ms),
                "verify_per_request_ms": self.verify_per_request_ms, "draft_per_request_ms": self.draft_per_request_ms,
                "context": self.context, "info": self.info}

    @classmethod
    def from_dict(cls, data: dict) -> "BatchCostModel":
        return cls([int(r) for r in data["verify_rows"]], [float(v) for v in data["verify_ms"]],
                   [int(r) for r in data["draft_rows"]], [float(v) for v in data["draft_ms"]],
                   float(data.get("verify_per_request_ms", 0.0)), float(data.get("draft_per_request_ms", 0.0)),
                   int(data.get("context", 128)), dict(data.get("info", {})))


class SoloCosts:
    """A ``CostModel``-like view of a ``BatchCostModel`` for one request alone (``draft_ms(b, L)``, ``verify_ms(rows, L)``),
    so a single-request ``VerifyWidthSchedule`` can run on the same measured costs (the batched ``verify_width`` method).
    The batched model is measured at one context, so ``context`` is not read."""

    def __init__(self, costs: BatchCostModel):
        self.costs = costs

    def draft_ms(self, b: int, context: int) -> float:
        return self.costs.draft(b)

    def verify_ms(self, rows: int, context: int) -> float:
        return self.costs.verify(rows)


def measure_batch_costs(decoder, block_size: int = 8, context: int = 128, max_requests: int = 16,
                        rows: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128), repeats: int = 3, seed: int = 0
                        ) -> BatchCostModel:
    """Time batched steps on this machine (see the module doc).

    Args:
        block_size: B of the timed draft blocks (the methods' drafted B); context: tokens in every request's caches.
        max_requests: the most requests timed together; rows: total verified rows of the target table.
    Raises:
        ValueError: for repeats < 1, a block size beyond the drafter's limit, or a context that leaves no room for a
            block.
    """
    import torch
    from transformers import DynamicCache

    from pipeline.decoding.sampling import PositionKeyedSampler
    from pipeline.decoding.speculative import _now, crop_to
    from pipeline.models.batched_forward import BatchedForward
    from pipeline.models.target import new_cache

    if repeats < 1:
        raise ValueError(f"batch cost repeats must be >= 1, got {repeats}")
    has_drafter = decoder.drafter is not None
    if has_drafter:
        decoder.check_block_size(block_size)
    max_block = max(2, int(block_size)) if has_drafter else 1
    if context + max_block + 1 > decoder.max_context:
        raise ValueError(f"batch cost context {context} + B {max_block} exceeds the target's {decoder.max_context} "
                         "positions; use a shorter context")
    device = decoder.device
    vocab = decoder.lm_head.shape[0]
    forward = BatchedForward(decoder)
    gen = torch.Generator().manual_seed(seed)
    n_tok = min(vocab, len(decoder.target.tokenizer))
    rows = sorted({int(r) for r in rows if int(r) >= 1})
    need = max(max_requests, *[-(-r // max_block) for r in rows], max_block, 2)
    sampler = PositionKeyedSampler(0.0, seed, vocab)
    caches, feats = [], []
    with torch.inference_mode():
        for _ in range(need):
            ids = torch.randint(0, n_tok, (1, context), generator=gen).to(device)
            cache = new_cache(decoder.model, decoder.kv_cache)
            _, features = decoder.target_forward(ids, cache, 0, want_features=has_drafter, last_only=True)
            caches.append(cache)
            feats.append(features)
    block_ids = torch.randint(0, n_tok, (1, max_block), generator=gen).to(device)

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = _now(device)
            fn()
            times.append((_now(device) - t0) * 1e3)
        return min(times)

    def verify(split: list[int]) -> float:
        def run() -> None:
            with torch.inference_mode():
                outs = forward.target([block_ids[:, :q] for q in split], caches[: len(split)], [context] * len(split),
                                      [has_drafter] * len(split))
                for (logits, _), c in zip(outs, caches):
                    sampler.pick(logits, context + 1)
                    crop_to(c, context)
        return timed(run)

    def split_rows(total: int) -> list[int]:
        n = -(-total // max_block)
        return [total // n + (1 if i < total % n else 0) for i in range(n)]

    verify_raw = {r: verify(split_rows(r)) for r in rows}
    q = min(max_block, max(rows))
    per_request = max(0.0, (verify([1] * q) - verify([q])) / max(1, q - 1)) if q > 1 else 0.0
    verify_ms = monotone([max(1e-3, verify_raw[r] - per_request * (len(split_rows(r)) - 1)) for r in rows])

    draft_rows, draft_ms, draft_per_request = [max_block], [0.0], 0.0
    if has_drafter:
        pending = 2  # about one step's accepted tokens of new context features

        def draft(sizes: list[int]) -> float:
            dcaches = []
            with torch.inference_mode():
                for i, _ in enumerate(sizes):
                    dc = DynamicCache()
                    decoder.drafter(decoder.embed(block_ids[:, :2]), feats[i][:, : context - pending],
                                    torch.arange(0, context - pending + 2, device=device)[None], cache=dc)
                    crop_to(dc, context - pending)
                    dcaches.append(dc)

            def run() -> None:
                with torch.inference_mode():
                    hidden = forward.draft_hidden([block_ids[:, :b] for b in sizes],
                                                  [feats[i][:, context - pending:] for i in range(len(sizes))],
                                                  [context] * len(sizes), dcaches)
                    for dc in dcaches:
                        crop_to(dc, context - pending)
                    logits = forward.draft_logits([h[0, 1:] for h in hidden])
                    for lg in logits:
                        sampler.pick_columns(lg, context + 1, decoder.draft_vocab)
            return timed(run)

        counts = [n for n in (1, 2, 4, 8, 16, 32) if n <= max_requests]
        raw = {n: draft([max_block] * n) for n in counts}
        pairs = max(2, max_block // 2)
        draft_per_request = max(0.0, (draft([2] * pairs) - draft([2 * pairs])) / max(1, pairs - 1)) if pairs > 1 else 0.0
        draft_rows = [n * max_block for n in counts]
        draft_ms = monotone([max(1e-3, raw[n] - draft_per_request * (n - 1)) for n in counts])
    info = {"host": platform.node(), "threads": torch.get_num_threads(), "target": decoder.target.name,
            "forward": decoder.forward_path(), "exact_batching": forward.exact, "block_size": max_block,
            "repeats": repeats, "verify_raw_ms": {str(r): v for r, v in verify_raw.items()}}
    return BatchCostModel(rows, verify_ms, draft_rows, draft_ms, per_request, draft_per_request, context, info)


def measure_batch_costs_cached(decoder, block_size: int = 8, context: int = 128,
                               max_requests: int = 16, rows: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
                               repeats: int = 3, seed: int = 0, cache_dir: str | Path | None = None,
                               identity: dict | None = None) -> BatchCostModel:
    """``measure_batch_costs``, kept in ``cache_dir/batch-costs-<key>.json``; the key hashes ``identity`` (target,
    drafter), this host, torch's thread count, the decoder's forward path (backend with its kernel's hash, lean
    forwards, KV cache) and the arguments. ``cache_dir=None`` measures afresh every time.

    Raises:
        ValueError: as ``measure_batch_costs``.
    """
    args = {"block_size": int(block_size), "context": int(context), "max_requests": int(max_requests),
            "rows": sorted(int(r) for r in rows), "repeats": int(repeats), "seed": int(seed)}
    if cache_dir is None:
        return measure_batch_costs(decoder, **args)
    import torch

    key = {"identity": identity or {}, "host": platform.node(), "threads": torch.get_num_threads(),
           "forward": decoder.forward_path(), **args}
    return BatchCostModel.from_dict(_cached(cache_dir, "batch-costs", key, "batch_costs",
                                            lambda: measure_batch_costs(decoder, **args).to_dict()))


def check_batch_cost_settings(settings, setting: str = "policy.budget.costs") -> list[int]:
    """Check a batched cost model's config block (``{context, rows, repeats, cache}``) before any model loads; returns
    its rows.

    Raises:
        ValueError: for a missing block, empty or non-positive ``rows``, or ``context`` / ``repeats`` below 1, naming
            ``setting``.
    """
    if settings is None:
        raise ValueError(f"{setting} is missing: give {{context, rows, repeats, cache}} (conf/policy/default.yaml "
                         "policy.budget.costs)")
    try:
        rows = [int(r) for r in (settings.get("rows") or [])]
    except (TypeError, ValueError):
        rows = []
    if not rows or min(rows) < 1:
        raise ValueError(f"{setting}.rows={settings.get('rows')!r}: give the total verified rows to time, "
                         "e.g. [1, 2, 4, 8, 16, 32, 64]")
    for key in ("context", "repeats"):
        value = settings.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{setting}.{key}={value!r}: must be an integer >= 1")
    return rows


def batch_costs_of(decoder, settings, model, block_size: int, max_requests: int, seed: int = 0,
                   setting: str = "policy.budget.costs") -> BatchCostModel:
    """This machine's ``BatchCostModel`` from a config block: the one way the server's ``budget`` policy and
    ``pipeline.bench_batch`` obtain it (``measure_batch_costs_cached``, keyed by the target and drafter).

    Args:
        settings: ``{context, rows, repeats, cache}`` (``policy.budget.costs``, or ``bench.costs`` which defaults to it);
            ``cache`` null measures afresh.
        model: the ``model`` config (its ``target`` and ``drafter`` key the cache).
        block_size: B of the timed draft blocks; max_requests: the most requests timed together (``serve.max_batch``,
            the benchmark's largest concurrency).
        setting: the block's name, for messages.
    Raises:
        ValueError: for an empty ``rows``, ``context`` or ``repeats`` below 1 (naming ``setting``), or as
            ``measure_batch_costs``.
    """
    rows = check_batch_cost_settings(settings, setting)
    return measure_batch_costs_cached(
        decoder, block_size=int(block_size), context=int(settings["context"]), max_requests=int(max_requests), rows=rows,
        repeats=int(settings["repeats"]), seed=int(seed), cache_dir=settings.get("cache"),
        identity={"target": str(model.get("target")), "drafter": str(model.get("drafter"))})
