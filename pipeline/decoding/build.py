"""The decoder of a ``model`` config: the configured target and drafter (``pipeline.models.loading``) in a
``SpeculativeDecoder``."""

from __future__ import annotations

from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.models.loading import load_models


def build_decoder(model_cfg) -> SpeculativeDecoder:
    """A ``SpeculativeDecoder`` over the configured target and drafter, on ``model_cfg.backend``, with the target KV
    cache ``model_cfg.kv_cache`` (``auto`` | ``dynamic`` | ``preallocated``; ``pipeline.models.target.new_cache``) and
    prompts prefilled in chunks of at most ``model_cfg.prefill_chunk`` tokens (absent or 0: one forward).

    Raises:
        ValueError: when the drafter does not fit the target, the backend cannot run here, or for an unknown kv_cache.
    """
    target, drafter = load_models(model_cfg)
    return SpeculativeDecoder(target, drafter, backend=model_cfg.get("backend", "auto"),
                              kv_cache=model_cfg.get("kv_cache", "auto"),
                              fast_forward=model_cfg.get("fast_forward", "auto"),
                              prefill_chunk=model_cfg.get("prefill_chunk", None),
                              precision=model_cfg.get("precision", "auto"),
                              draft_precision=model_cfg.get("draft_precision", "auto"),
                              kv_dtype=model_cfg.get("kv_cache_dtype", "auto"))
