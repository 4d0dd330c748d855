"""``validate_config(cfg, stage)``: the configuration check of a stage, run by its entry point before any model loads.

Each package owns its stage's check (``pipeline.labeling.checks``, ``pipeline.evaluation.checks``,
``pipeline.serving.checks``, ``pipeline.drafting.checks``, ``pipeline.policy.checks``), built on the shared checks of
``pipeline.decoding.checks`` (block sizes, temperature, device, the ``model``, ``decode`` and ``data`` groups). This
module only picks the one of a stage; it sits with the entry points, and no library module imports it (library code
calls its own package's check).
"""

from __future__ import annotations

STAGES = ("label", "dataset", "train", "eval", "bench_label", "draft", "serve")


def validate_config(cfg, stage: str) -> None:
    """Check the composed config of ``stage`` before any model or data loads.

    Checks, where the groups exist: ``model.device`` for the stages that load the target (label, eval, bench_label, draft, serve: one this
    PyTorch can run on; ``cuda`` on a CPU-only build is refused before the weights load), ``model.candidates`` (distinct
    integers >= 1), ``decode.max_new_tokens`` (>= 1), ``decode.temperature`` (finite, >= 0), ``decode.block_size``
    (null or >= 1; 0 is not "default"), ``data.limit`` (null or >= 0), ``data.missing``; for ``eval``: every
    ``eval.methods`` entry is known and each predictor method has a ``policy.<method>.predictor`` sub-folder,
    ``policy.verify_width``, ``eval.split``; for ``label``: ``label.block_sizes``, ``mode``, ``turns``, ``lm_head``; for
    ``draft``: ``draft.loss``, each set's ``temperature`` and a ``source: self`` set's ``limit``,
    ``draft.checkpoint_every``; for ``serve``: ``serve.policy`` (servable), ``serve.max_batch`` (>= 1), ``policy.budget.costs`` (for budget) and the
    policies' options.

    Args:
        cfg: the stage's composed ``DictConfig``.
        stage: one of ``STAGES``.
    Raises:
        ValueError: for an unknown stage, or the first bad value, naming the key and the fix.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; one of {STAGES}")
    if stage == "label":
        from pipeline.labeling.checks import check_label_config as check
    elif stage == "eval":
        from pipeline.evaluation.checks import check_eval_config as check
    elif stage == "serve":
        from pipeline.serving.checks import check_serve_config as check
    elif stage == "draft":
        from pipeline.drafting.checks import check_draft_config as check
    elif stage == "dataset":
        from pipeline.policy.checks import check_dataset_config as check
    elif stage == "train":
        from pipeline.policy.checks import check_train_config as check
    else:  # bench_label: the shared groups, on the device it loads the target on
        from pipeline.decoding.checks import check_common

        def check(c):
            check_common(c, loads_model=True)
    check(cfg)
