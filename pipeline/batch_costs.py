"""This machine's cost of one batched decode step (``pipeline.policy.budget.BatchCostModel``), measured once per
machine, models and forward path, and cached like the single-request latency model (``pipeline.labeling.latency``).

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

import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Sequence

import torch
from transformers import DynamicCache

from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.speculative import SpeculativeDecoder, _now, crop_to
from pipeline.models.batched_forward import BatchedForward
from pipeline.models.target import new_cache
from pipeline.policy.budget import BatchCostModel

log = logging.getLogger(__name__)


def monotone(ys: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in least squares (pool adjacent violators): a forward over more
    rows never costs less, so a noisy dip (other load on the cores) must not make wider steps look free."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def measure_batch_costs(decoder: SpeculativeDecoder, block_size: int = 8, context: int = 128, max_requests: int = 16,
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


def measure_batch_costs_cached(decoder: SpeculativeDecoder, block_size: int = 8, context: int = 128,
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
    key = {"identity": identity or {}, "host": platform.node(), "threads": torch.get_num_threads(),
           "forward": decoder.forward_path(), **args}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"batch-costs-{digest}.json"
    if path.is_file():
        log.info("reusing the batched step costs measured earlier on this machine: %s (delete it to remeasure)", path)
        return BatchCostModel.from_dict(json.loads(path.read_text())["batch_costs"])
    model = measure_batch_costs(decoder, **args)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "batch_costs": model.to_dict()}, indent=2, default=str))
    os.replace(tmp, path)
    log.info("batched step costs stored for later runs: %s", path)
    return model
