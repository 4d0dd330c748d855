"""The serve stage's configuration check (``check_serve_config``), run before any model loads."""

from __future__ import annotations

from pipeline.decoding.checks import check_common, is_int
from pipeline.policy.checks import check_policy_options


def check_serve_config(cfg) -> None:
    """Check the composed ``conf/serve.yaml``: the shared groups (``pipeline.decoding.checks.check_common``,
    ``model.device`` included), then ``serve.policy`` (servable; ``budget`` with a valid ``policy.budget.costs``),
    ``serve.max_batch`` (``auto`` or >= 1), ``serve.max_batch_limit``, ``serve.prefix_cache_mb`` (>= 0) and the
    policies' options (``pipeline.policy.checks.check_policy_options``).

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    check_common(cfg, loads_model=True)
    if cfg.get("serve") is None:
        return
    from pipeline.policy.registry import BATCHED, check_methods

    serve = cfg.serve
    policy = str(serve.get("policy"))
    check_methods(policy, "serve")
    max_batch = serve.get("max_batch", 1)
    max_batch = 1 if max_batch is None else max_batch
    if max_batch != "auto" and (not is_int(max_batch) or max_batch < 1):
        raise ValueError(f"serve.max_batch={max_batch!r}: the most requests decoding together, auto (the knee of this "
                         "machine's batched step costs) or an integer >= 1 (1: one at a time; e.g. serve.max_batch=8)")
    limit = serve.get("max_batch_limit", 64)
    if not is_int(limit) or limit < 1:
        raise ValueError(f"serve.max_batch_limit={limit!r}: the largest batch serve.max_batch=auto may pick, an "
                         "integer >= 1 (e.g. 64)")
    prefix_mb = serve.get("prefix_cache_mb", 0)
    prefix_mb = 0 if prefix_mb is None else prefix_mb
    if isinstance(prefix_mb, bool) or not isinstance(prefix_mb, (int, float)) or not prefix_mb >= 0:
        raise ValueError(f"serve.prefix_cache_mb={prefix_mb!r}: the prefix cache's size in MiB, a number >= 0 "
                         "(0: off); set e.g. serve.prefix_cache_mb=256, or serve.prefix_cache_mb=0 to prefill every "
                         "prompt whole")
    kv = serve.get("kv_cache_mb")
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, (int, float)) or kv < 0):
        raise ValueError(f"serve.kv_cache_mb={kv!r}: the KV cache's bound in MB, a number >= 0 (0 or null: no bound)")
    if policy in BATCHED or max_batch == "auto":
        from pipeline.costs.batched import check_batch_cost_settings

        check_batch_cost_settings(((cfg.get("policy") or {}).get("budget") or {}).get("costs"), "policy.budget.costs")
    check_policy_options(cfg)
