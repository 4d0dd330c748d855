"""``validate_config(cfg, stage)``: the configuration check of a stage, run by its entry point before any model loads.

Each package owns its stage's check (``pipeline.labeling.checks``, ``pipeline.evaluation.checks``,
``pipeline.serving.checks``, ``pipeline.drafting.checks``, ``pipeline.policy.checks``), built on the shared checks of
``pipeline.decoding.checks`` (block sizes, temperature, device, the ``model``, ``decode`` and ``data`` groups). This
module only picks the one of a stage; it sits with the entry points, and no library module imports it (library code
calls its own package's check).
"""

from __future__ import annotations

CHECKS = {  # stage -> "module:function" of its check (each imports no torch, Lightning or transformers)
    "label": "pipeline.labeling.checks:check_label_config",
    "dataset": "pipeline.policy.checks:check_dataset_config",
    "train": "pipeline.policy.checks:check_train_config",
    "eval": "pipeline.evaluation.checks:check_eval_config",
    "serve": "pipeline.serving.checks:check_serve_config",
    "draft": "pipeline.drafting.checks:check_draft_config",
    "bench_label": "pipeline.labeling.checks:check_label_config",
    "bench_batch": "pipeline.config_checks:check_bench_batch",
    "bench_serve": "pipeline.evaluation.checks:check_bench_serve_config",
    "bench_step": "pipeline.config_checks:check_bench_step",
    "retest": "pipeline.policy.checks:check_dataset_config",
    "serve_vllm": "pipeline.peers.vllm_settings:check_serve_vllm_config",
}
STAGES = tuple(CHECKS)


def check_bench_batch(cfg) -> None:
    """``bench_batch``: the shared groups (it loads the target) and ``bench.*`` (``check_bench_config``)."""
    from pipeline.decoding.checks import check_common
    from pipeline.evaluation.checks import check_bench_config

    check_common(cfg, loads_model=True)
    check_bench_config(cfg)


def check_bench_step(cfg) -> None:
    """``bench_step``: the shared groups (it loads the target) and its lists of contexts, widths and block sizes."""
    from pipeline.decoding.checks import check_block_sizes, check_common

    check_common(cfg, loads_model=True)
    for key in ("contexts", "widths", "block_sizes"):
        check_block_sizes(cfg.get(key), key)
    if int(cfg.get("repeats", 1)) < 1:
        raise ValueError(f"repeats must be >= 1 timed runs per figure, got {cfg.get('repeats')}")


def validate_config(cfg, stage: str) -> None:
    """Check the composed config of ``stage`` (one of ``STAGES``: every stage entry point calls it first) before any
    model or data loads: the check ``CHECKS`` names, which its package owns.

    The shared groups (``pipeline.decoding.checks.check_common``), where they exist: ``model.device`` for the stages
    that load the target (one this PyTorch can run on; ``cuda`` on a CPU-only build is refused before the weights
    load), ``model.candidates`` (distinct integers >= 1), ``decode.max_new_tokens`` (>= 1), ``decode.temperature``
    (finite, >= 0), ``decode.block_size`` (null or >= 1; 0 is not "default"), ``data.limit`` (null or >= 0),
    ``data.missing``; then each stage's own: ``eval.methods`` (known, evaluable at batch 1: ``registry.check_methods``),
    the policies' options and ``eval.split``; ``label.block_sizes``, ``mode``, ``turns``, ``lm_head``; ``draft.loss``
    and its sets; ``serve.policy`` (servable), ``serve.max_batch``, ``policy.budget.costs``; ``bench.*`` of bench_batch
    and bench_serve; bench_step's lists; serve_vllm's method, policy and port.

    Args:
        cfg: the stage's composed ``DictConfig``.
        stage: one of ``STAGES``.
    Raises:
        ValueError: for an unknown stage, or the first bad value, naming the key and the fix.
    """
    if stage not in CHECKS:
        raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")
    import importlib

    module, name = CHECKS[stage].split(":")
    getattr(importlib.import_module(module), name)(cfg)
