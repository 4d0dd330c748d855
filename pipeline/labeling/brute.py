"""Brute-force labelling: decode the prompt once per candidate B, all from ONE prefill.

A ``PrefillResult``'s cache is consumed by one decode, so every candidate decodes from a deep copy of
it; at T>0 each repeat only re-samples the first token with its own seed (the prefill logits do not
depend on the seed).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.requests import DecodeConfig, PrefillResult, RequestStats
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.models.clock import now


def reseed(prefill: PrefillResult, config: DecodeConfig, copy_cache: bool = True) -> PrefillResult:
    """The prefill as ``decoder.prefill(ids, config)`` would return it for ``config``'s seed.

    Re-samples the first token from ``prefill.last_logits`` with ``config``'s temperature and seed, and
    deep-copies the cache unless ``copy_cache`` is False (then the returned prefill shares it).
    """
    n = prefill.input_ids.shape[1]
    sampler = PositionKeyedSampler(config.temperature, config.seed, prefill.last_logits.shape[-1])
    first = int(sampler.pick(prefill.last_logits[None], n)[0])
    cache = copy.deepcopy(prefill.cache) if copy_cache else prefill.cache
    return replace(prefill, cache=cache, first_token=first)


@dataclass
class BruteResult:
    """Per candidate B: the decoder's ``RequestStats`` and the wall time of copying the cache + decoding (ms)."""

    stats: dict[int, RequestStats]
    wall_ms: dict[int, float]


def brute_force(decoder: SpeculativeDecoder, prefill: PrefillResult, candidates: list[int], config: DecodeConfig,
                consume: bool = False) -> BruteResult:
    """Decode with every candidate B (``SpeculativeDecoder.decode`` with a fixed B) after one prefill.

    Args:
        prefill: from ``decoder.prefill(ids, config_with_any_seed, want_features=True)``.
        candidates: block sizes (1..drafter limit).
        config: the decode settings; the first token is re-sampled with its seed.
        consume: let the last candidate use ``prefill.cache`` itself (no copy); the prefill is unusable after.
    Raises:
        ValueError: for an invalid block size (from the decoder).
    """
    stats, wall = {}, {}
    order = sorted(set(int(b) for b in candidates))
    for i, b in enumerate(order):
        t0 = now(decoder.device)
        start = reseed(prefill, config, copy_cache=not (consume and i == len(order) - 1))
        stats[b] = decoder.decode(start, b, config)
        wall[b] = (now(decoder.device) - t0) * 1e3
    return BruteResult(stats, wall)
