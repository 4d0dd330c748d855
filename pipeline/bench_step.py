"""Benchmark of one decoding step's cost (prints figures; not a test).

    python -m pipeline.bench_step                                   # table on stdout
    python -m pipeline.bench_step out=data/bench/step.json contexts=[128,512] 'backends=[auto,eager]'

For the configured target and drafter, at each context length L, the least of ``repeats`` interleaved runs
(``pipeline.timing.steps.step_figures`` on the one timer, ``pipeline.costs.timer``) of:

- ``ar_ms``: one autoregressive step (target forward over 1 token with an L-token cache, LM head,
  sampling): what ``decode`` runs per token at B=1;
- ``forward_ms[q]``: one target forward over q tokens with the drafter's features and the LM head over
  the q rows (a verify of width q-1), q in ``widths``;
- ``drafter_ms[B]``: one drafter forward over a block of B (``pending_features`` new context features)
  with its head over the B-1 draft rows and sampling;
- ``step_ms[B]``: one full draft+verify step at B, exactly the one decode step's (``pipeline.decoding.step.chain_step``);
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
from pathlib import Path

import torch
from omegaconf import DictConfig

from pipeline.cli import stage
from pipeline.decoding.speculative import SpeculativeDecoder
from pipeline.models.backend import resolve_backend
from pipeline.models.cache import resolve_kv_cache
from pipeline.models.loading import load_models
from pipeline.costs.store import cpu_name
from pipeline.models.kernel import kernel_isa
from pipeline.timing.limits import floor_ms, machine_limits, weight_footprint
from pipeline.timing.steps import step_figures

log = logging.getLogger(__name__)
KEYS = ("ar_ms", "forward_ms", "drafter_ms", "step_ms", "step_over_ar")


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
    limits = machine_limits()  # read bandwidth and FMA rate: the floor beside each figure
    log.info("bench_step: this machine reads %.1f GB/s and multiplies at %.0f GFLOP/s (float32)", limits["read_gb_s"],
             limits["gflop_s"])
    by_kv_cache = {}
    for kind in kinds:
        by_backend = by_kv_cache[kind] = {}
        for name in names:
            decoder = SpeculativeDecoder(target, drafter, backend=name, kv_cache=kind,
                                         fast_forward=cfg.model.get("fast_forward", "auto"),
                                         precision=cfg.model.get("precision", "exact") if name == "smallm" else "exact",
                                         draft_precision=cfg.model.get("draft_precision", "auto") if name == "smallm"
                                         else "auto")
            by_context = {}
            for length in cfg.contexts:
                log.info("bench_step: backend %s, kv cache %s, context %d", name, decoder.kv_cache, int(length))
                by_context[str(int(length))] = step_figures(
                    decoder, int(length), [int(q) for q in cfg.widths], [int(b) for b in cfg.block_sizes],
                    int(cfg.pending_features), int(cfg.repeats), int(cfg.warmup), int(cfg.seed))
                fig = by_context[str(int(length))]
                log.info("bench_step: backend %s, kv cache %s, context %d: ar_ms %.2f, step_ms %s, step_over_ar %s",
                         name, kind, int(length), fig["ar_ms"], {k: round(v, 2) for k, v in fig["step_ms"].items()},
                         {k: round(v, 3) for k, v in fig["step_over_ar"].items()})
            first = by_context[str(int(cfg.contexts[0]))]
            weight_bytes, params = weight_footprint(decoder)
            floors = {"ar_ms": round(floor_ms(weight_bytes, params, 1, limits), 3),
                      "forward_ms": {str(q): round(floor_ms(weight_bytes, params, int(q), limits), 3) for q in cfg.widths}}
            by_backend[name] = {**{k: first[k] for k in KEYS}, "kv_cache": decoder.kv_cache, "by_context": by_context,
                                "forward_path": decoder.forward_path(), "weight_mb": round(weight_bytes / 1e6, 1),
                                "floor_ms": floors}
    chosen = by_kv_cache[kinds[0]][names[0]]
    return {
        "backend": names[0], "context": int(cfg.contexts[0]), **chosen,
        "by_backend": by_kv_cache[kinds[0]], "by_kv_cache": by_kv_cache,
        "info": {"host": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
                 "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": str(target.model.dtype),
                 "device": str(target.model.device), "target": target.name, "drafter": str(cfg.model.drafter),
                 "repeats": int(cfg.repeats), "pending_features": int(cfg.pending_features),
                 "fast_forward": str(cfg.model.get("fast_forward", "auto")), "cpu": cpu_name(),
                 "isa": kernel_isa(), "limits": limits},
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
                floors = per.get("floor_ms") or {}
                floor_ar = floors.get("ar_ms")
                floor_8 = (floors.get("forward_ms") or {}).get("8")
                rows.append([name, length, f"{fig['ar_ms']:.1f}", *[f"{fig['forward_ms'][q]:.1f}" for q in qs],
                             f"{fig['drafter_ms'][b]:.1f}", f"{fig['step_ms'][b]:.1f}", f"{fig['step_over_ar'][b]:.2f}",
                             per.get("kv_cache", kind),
                             f"{floor_ar:.1f} ({fig['ar_ms'] / floor_ar:.1f}x)" if floor_ar else "-",
                             f"{floor_8:.1f} ({fig['forward_ms']['8'] / floor_8:.1f}x)" if floor_8 and "8" in fig["forward_ms"] else "-"])
                header = ["backend", "context", "ar_ms", *[f"forward q={q}" for q in qs], f"drafter B={b}",
                          f"step B={b}", f"step/ar B={b}", "kv_cache", "floor ar (ar/floor)", "floor q=8 (q=8/floor)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


@stage("bench_step")
def main(cfg: DictConfig) -> None:
    from pipeline.config_checks import validate_config

    validate_config(cfg, "bench_step")
    result = bench_step(cfg)
    table = markdown(result, int(cfg.model.get("training_block_size") or 8))
    info = result["info"]
    print(f"{info['cpu']}, kernel ISA {info['isa']}, {info['threads']} threads: reads {info['limits']['read_gb_s']} GB/s, "
          f"{info['limits']['gflop_s']} GFLOP/s float32 (floor = max(weights read once, products at that rate))")
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
