"""The configuration checks of the eval stage (``check_eval_config``) and of the benchmarks built on it (``bench_batch``:
``check_bench_config``; ``bench_serve``: ``check_bench_serve_config``), run before W&B starts and before any model loads.
Standard library only (no torch)."""

from __future__ import annotations

import math

from pipeline.decoding.checks import check_common
from pipeline.policy.checks import check_policy_options

ARRIVALS = ("burst", "poisson")  # bench_batch's arrival patterns


def check_eval_config(cfg) -> None:
    """Check the composed ``conf/evaluate.yaml``: the shared groups (``pipeline.decoding.checks.check_common``,
    ``model.device`` included), then every ``eval.methods`` entry is known and evaluable at batch 1, the methods'
    options (``pipeline.policy.checks.check_policy_options``) and ``eval.split``.

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    check_common(cfg, loads_model=True)
    methods = cfg.eval.get("methods")
    if not methods or isinstance(methods, str):
        raise ValueError(f"eval.methods={methods!r}: give a list, e.g. 'eval.methods=[ar,fixed]'")
    from pipeline.policy.registry import check_methods

    check_methods(methods, "eval")
    check_policy_options(cfg)
    split = str(cfg.eval.get("split", "auto") or "all")
    if split not in ("auto", "all", "train", "validation", "test"):
        raise ValueError(f"eval.split must be auto, all, train, validation or test; got {split!r}")


def check_bench_config(cfg) -> None:
    """Check ``cfg.bench`` before any model loads.

    Raises:
        ValueError: for an empty or non-positive concurrency list, a method the batched decoder cannot run, an unknown
            arrival pattern, a non-positive rate, max_new_tokens or bootstrap count, a negative temperature, or (for
            budget) a bad ``policy.budget.costs`` block; each names the key.
    """
    from pipeline.policy.registry import METHODS, SERVABLE, check_methods

    b = cfg.bench
    conc = list(b.concurrency or [])
    if not conc or any(int(c) < 1 for c in conc):
        raise ValueError(f"bench.concurrency must be a non-empty list of ints >= 1, got {conc}")
    if not b.methods or isinstance(b.methods, str):
        raise ValueError(f"bench.methods must be a non-empty list of the methods the batched decoder runs, "
                         f"{list(SERVABLE)}; got {b.methods!r}")
    check_methods(b.methods, "bench")
    bad = [a for a in b.arrivals or [] if a not in ARRIVALS]
    if not b.arrivals or bad:
        raise ValueError(f"bench.arrivals must be a non-empty subset of {list(ARRIVALS)}, got {list(b.arrivals or [])}")
    if "poisson" in b.arrivals and not float(b.rate) > 0:
        raise ValueError(f"bench.rate must be > 0 requests/s for Poisson arrivals, got {b.rate}")
    if int(b.max_new_tokens) < 1:
        raise ValueError(f"bench.max_new_tokens must be >= 1, got {b.max_new_tokens}")
    if not float(b.temperature) >= 0 or not math.isfinite(float(b.temperature)):
        raise ValueError(f"bench.temperature must be a finite number >= 0, got {b.temperature}")
    if int(b.bootstrap) < 1:
        raise ValueError(f"bench.bootstrap must be >= 1 resamples, got {b.bootstrap}")
    if b.requests is not None and int(b.requests) < 1:
        raise ValueError(f"bench.requests must be >= 1 or null (every prompt), got {b.requests}")
    if b.split not in (None, "train", "validation", "test"):
        raise ValueError(f"bench.split must be null, train, validation or test, got {b.split!r}")
    if any(METHODS[m].batched for m in b.methods):
        from pipeline.costs.batched import check_batch_cost_settings

        check_batch_cost_settings(((cfg.get("policy") or {}).get("budget") or {}).get("costs"), "policy.budget.costs")


def check_bench_serve_config(cfg) -> None:
    """Check ``conf/bench_serve.yaml``: the shared groups (the target loads for the identity check), and
    ``bench.base_url`` (one running server) against ``bench.servers``.

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    check_common(cfg, loads_model=bool(cfg.bench.get("identity", True)))
    servers = cfg.bench.get("servers") or []
    if cfg.bench.get("base_url") and len(servers) > 1:
        raise ValueError(f"bench.base_url={cfg.bench.base_url} is one running server, but bench.servers names "
                         f"{len(servers)}: drop bench.base_url (each server is started in turn) or keep one")
    if int(cfg.bench.get("warmup_requests", 0) or 0) < 0:
        raise ValueError(f"bench.warmup_requests={cfg.bench.warmup_requests}: give 0 (none) or more requests")
