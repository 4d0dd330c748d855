"""Benchmark of one decoding step's cost (prints figures; not a test).

    python -m pipeline.bench_step                                   # table on stdout
    python -m pipeline.bench_step out=data/bench/step.json contexts=[128,512] 'backends=[auto,eager]'

For the configured target and drafter, at each context length L, the median over ``repeats`` runs of:

- ``ar_ms``: one autoregressive step (target forward over 1 token with an L-token cache, LM head,
  sampling): what ``decode`` runs per token at B=1;
- ``forward_ms[q]``: one target forward over q tokens with the drafter's features and the LM head over
  the q rows (a verify of width q-1), q in ``widths``;
- ``drafter_ms[B]``: one drafter forward over a block of B (``pending_features`` new context features)
  with its head over the B-1 draft rows and sampling;
- ``step_ms[B]``: one full draft+verify step at B, exactly ``SpeculativeDecoder.step``;
- ``step_over_ar[B]`` = step_ms[B] / ar_ms.

Each backend (``pipeline.models.backend``) is measured on the same loaded weights, one after the other,
and so is each target KV cache of ``kv_caches`` (``pipeline.models.cache``: ``dynamic``, ``preallocated``,
``auto``). The JSON holds the first backend's figures for the first context at the top level, every context
under ``by_context``, every backend (of the first KV cache) under ``by_backend`` and every KV cache under
``by_kv_cache`` (each a ``by_backend``); B and q are string keys. Timings need a quiet machine: other
processes on the cores inflate every figure.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig
from transformers import DynamicCache

from pipeline.cli import stage
from pipeline.decoding.sampling import PositionKeyedSampler
from pipeline.decoding.speculative import DecodeState, SpeculativeDecoder, _now, crop_to
from pipeline.models.backend import resolve_backend
from pipeline.models.cache import resolve_kv_cache
from pipeline.models.loading import load_models
from pipeline.models.target import new_cache

log = logging.getLogger(__name__)
KEYS = ("ar_ms", "forward_ms", "drafter_ms", "step_ms", "step_over_ar")


def median_ms(fn: Callable[[], None], reset: Callable[[], None], repeats: int, warmup: int,
              device: torch.device) -> float:
    """Median wall time of ``fn`` (ms) over ``repeats`` runs after ``warmup``; ``reset`` runs untimed after each."""
    times = []
    for i in range(warmup + repeats):
        t0 = _now(device)
        fn()
        if i >= warmup:
            times.append((_now(device) - t0) * 1e3)
        reset()
    return statistics.median(times)


@torch.inference_mode()
def measure_context(decoder: SpeculativeDecoder, length: int, widths, block_sizes, pending: int,
                    repeats: int, warmup: int, seed: int = 0) -> dict:
    """The five figures of the module docstring at one context length L (tokens).

    Raises:
        ValueError: when L + the widest block does not fit the target's context, or without a drafter.
    """
    if decoder.drafter is None:
        raise ValueError("bench_step needs a drafter (model.drafter=...)")
    widest = max([*widths, *block_sizes])
    if length + widest > decoder.max_context or length < pending + 1:
        raise ValueError(f"context {length} (+ {widest}) does not fit the target's {decoder.max_context} positions")
    for b in block_sizes:
        decoder.check_block_size(b)
    device = decoder.device
    vocab = decoder.lm_head.shape[0]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(vocab, len(decoder.target.tokenizer)), (1, length + widest), generator=generator).to(device)
    sampler = PositionKeyedSampler(0.0, seed, vocab)
    cache = new_cache(decoder.model, decoder.kv_cache)
    _, features = decoder.target_forward(ids[:, :length], cache, 0, want_features=True, last_only=True)
    draft_cache = DynamicCache()
    decoder.drafter(decoder.embed(ids[:, :1]), features[:, : length - pending],
                    torch.arange(0, length - pending + 1, device=device)[None], cache=draft_cache)
    crop_to(draft_cache, length - pending)
    state = DecodeState(cache, draft_cache, features[:, length - pending:], int(ids[0, length]), length)

    def reset() -> None:
        crop_to(cache, length)
        crop_to(draft_cache, length - pending)
        state.features = features[:, length - pending:]
        state.pending, state.start = int(ids[0, length]), length

    ar_state = DecodeState(cache, None, None, int(ids[0, length]), length)

    def ar() -> None:
        decoder.step(ar_state, 1, sampler)

    def ar_reset() -> None:
        crop_to(cache, length)
        ar_state.pending, ar_state.start = int(ids[0, length]), length

    for _ in range(max(1, warmup) * 10):  # settle the backend's packed weights and thread pool first
        ar()
        ar_reset()
    out = {"ar_ms": median_ms(ar, ar_reset, repeats, warmup, device), "forward_ms": {}, "drafter_ms": {}, "step_ms": {}}
    for q in widths:
        block = ids[:, length : length + q]

        def forward(block=block) -> None:
            logits, _ = decoder.target_forward(block, cache, length, want_features=True)
            sampler.pick(logits, length + 1)

        out["forward_ms"][str(q)] = median_ms(forward, reset, repeats, warmup, device)
    mask_id = decoder.drafter.mask_token_id
    for b in block_sizes:
        block = torch.full((1, b), mask_id, dtype=torch.long, device=device)

        def draft(block=block) -> None:
            block[0, 0] = state.pending
            decoder.draft(state, block, sampler)

        out["drafter_ms"][str(b)] = median_ms(draft, reset, repeats, warmup, device)
        out["step_ms"][str(b)] = median_ms(lambda b=b: decoder.step(state, b, sampler), reset, repeats, warmup, device)
    out["step_over_ar"] = {b: ms / out["ar_ms"] for b, ms in out["step_ms"].items()}
    return out


def bench_step(cfg: DictConfig) -> dict:
    """Run the benchmark for every KV cache in ``cfg.kv_caches`` and backend in ``cfg.backends``; returns the
    JSON-ready dict.

    Raises:
        ValueError: for an empty ``backends``, ``kv_caches`` or ``contexts`` list, an unknown backend or KV cache,
            or no drafter.
    """
    if not cfg.backends or not cfg.contexts or not cfg.get("kv_caches", ["auto"]):
        raise ValueError("bench_step needs at least one backend, one KV cache and one context length")
    kinds = []  # as requested (``auto``: what each backend's decoder takes, as the stages do; recorded resolved)
    for kind in cfg.get("kv_caches", ["auto"]):
        resolve_kv_cache(str(kind))  # an unknown name fails before any model loads
        if str(kind) not in kinds:
            kinds.append(str(kind))
    torch.manual_seed(int(cfg.seed))
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    target, drafter = load_models(cfg.model)
    names = []
    for backend in cfg.backends:
        name = resolve_backend(str(backend), target.model.device, target.model.dtype)
        if name not in names:
            names.append(name)
    by_kv_cache = {}
    for kind in kinds:
        by_backend = by_kv_cache[kind] = {}
        for name in names:
            decoder = SpeculativeDecoder(target, drafter, backend=name, kv_cache=kind,
                                         fast_forward=cfg.model.get("fast_forward", "auto"))
            by_context = {}
            for length in cfg.contexts:
                log.info("bench_step: backend %s, kv cache %s, context %d", name, decoder.kv_cache, int(length))
                by_context[str(int(length))] = measure_context(
                    decoder, int(length), [int(q) for q in cfg.widths], [int(b) for b in cfg.block_sizes],
                    int(cfg.pending_features), int(cfg.repeats), int(cfg.warmup), int(cfg.seed))
                fig = by_context[str(int(length))]
                log.info("bench_step: backend %s, kv cache %s, context %d: ar_ms %.2f, step_ms %s, step_over_ar %s",
                         name, kind, int(length), fig["ar_ms"], {k: round(v, 2) for k, v in fig["step_ms"].items()},
                         {k: round(v, 3) for k, v in fig["step_over_ar"].items()})
            first = by_context[str(int(cfg.contexts[0]))]
            by_backend[name] = {**{k: first[k] for k in KEYS}, "kv_cache": decoder.kv_cache, "by_context": by_context,
                                "forward_path": decoder.forward_path()}
    chosen = by_kv_cache[kinds[0]][names[0]]
    return {
        "backend": names[0], "context": int(cfg.contexts[0]), **chosen,
        "by_backend": by_kv_cache[kinds[0]], "by_kv_cache": by_kv_cache,
        "info": {"host": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
                 "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": str(target.model.dtype),
                 "device": str(target.model.device), "target": target.name, "drafter": str(cfg.model.drafter),
                 "repeats": int(cfg.repeats), "pending_features": int(cfg.pending_features),
                 "fast_forward": str(cfg.model.get("fast_forward", "auto"))},
    }


def markdown(result: dict, block_size: int | None = None) -> str:
    """A Markdown table: one row per (KV cache, backend, context) with ar_ms, forward_ms, drafter_ms and step_ms at B."""
    rows = []
    by_kv_cache = result.get("by_kv_cache") or {result.get("kv_cache", "dynamic"): result["by_backend"]}
    for kind, by_backend in by_kv_cache.items():
        for name, per in by_backend.items():
            for length, fig in per["by_context"].items():
                bs = sorted(fig["step_ms"], key=int)
                b = str(block_size) if block_size is not None and str(block_size) in fig["step_ms"] else bs[len(bs) // 2]
                qs = [q for q in ("1", "2", "4", "8", "16") if q in fig["forward_ms"]]
                rows.append([name, length, f"{fig['ar_ms']:.1f}", *[f"{fig['forward_ms'][q]:.1f}" for q in qs],
                             f"{fig['drafter_ms'][b]:.1f}", f"{fig['step_ms'][b]:.1f}", f"{fig['step_over_ar'][b]:.2f}",
                             per.get("kv_cache", kind)])
                header = ["backend", "context", "ar_ms", *[f"forward q={q}" for q in qs], f"drafter B={b}",
                          f"step B={b}", f"step/ar B={b}", "kv_cache"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


@stage("bench_step")
def main(cfg: DictConfig) -> None:
    result = bench_step(cfg)
    table = markdown(result, int(cfg.model.get("training_block_size") or 8))
    print(table)
    print(json.dumps({k: result[k] for k in ("backend", "kv_cache", "ar_ms", "step_over_ar")}, indent=1))
    if cfg.out:
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        from pipeline.evaluation.report import write_json

        write_json(result, out)
        out.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
