"""The eval stage's configuration check (``check_eval_config``), run before W&B starts and before any model loads."""

from __future__ import annotations

from pipeline.decoding.checks import check_common
from pipeline.policy.checks import check_policy_options


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
