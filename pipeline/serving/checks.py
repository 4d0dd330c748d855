"""The serve stage's configuration check (``check_serve_config``), run before any model loads."""

from __future__ import annotations

from pipeline.decoding.checks import check_common, is_int
from pipeline.policy.checks import check_policy_options


def check_serve_config(cfg) -> None:
    """Check the composed ``conf/serve.yaml``: the shared groups (``pipeline.decoding.checks.check_common``,
    ``model.device`` included), then ``serve.policy`` (servable; ``budget`` with a valid ``policy.budget.costs``),
    ``serve.max_batch`` (>= 1) and the policies' options (``pipeline.policy.checks.check_policy_options``).

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
    if not is_int(max_batch) or max_batch < 1:
        raise ValueError(f"serve.max_batch={max_batch!r}: the most requests decoding together, an integer >= 1 "
                         "(1: one at a time; e.g. serve.max_batch=8 for continuous batching)")
    if policy in BATCHED:
        from pipeline.costs.batched import check_batch_cost_settings

        check_batch_cost_settings(((cfg.get("policy") or {}).get("budget") or {}).get("costs"), "policy.budget.costs")
    check_policy_options(cfg)
