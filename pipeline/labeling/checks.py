"""The label stage's configuration check (``check_label_config``), run before the target loads."""

from __future__ import annotations

from pipeline.decoding.checks import check_block_sizes, check_common

MODES = ("replay", "brute")  # label.mode: ``pipeline.labeling.oracle`` (replay) or ``pipeline.labeling.brute``
LM_HEAD_MODES = ("auto", "lazy", "full")  # label.lm_head: how a replay scores drafts (``pipeline.labeling.replay``)


def check_label_config(cfg) -> None:
    """Check the composed ``conf/label.yaml`` (also the label settings of ``bench_label``): the shared groups
    (``pipeline.decoding.checks.check_common``, ``model.device`` included), then ``label.block_sizes`` (distinct
    integers >= 1), ``label.mode`` (replay or brute), ``label.turns`` (all or first), ``label.lm_head`` and ``label.tree_top_k`` (>= 1).

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    check_common(cfg, loads_model=True)
    label = cfg.label
    check_block_sizes(label.get("block_sizes"), "label.block_sizes")
    if str(label.get("mode", "replay")) not in MODES:
        raise ValueError(f"label.mode={label.get('mode')!r}: choose one of {list(MODES)}")
    if str(label.get("turns", "all")) not in ("all", "first"):
        raise ValueError(f"label.turns must be 'all' or 'first', got {label.get('turns')!r}")
    if str(label.get("lm_head", "auto")) not in LM_HEAD_MODES:
        raise ValueError(f"label.lm_head={label.get('lm_head')!r}: choose one of {list(LM_HEAD_MODES)}")
    top_k = label.get("tree_top_k", 4)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"label.tree_top_k={top_k!r}: the drafter's candidates kept per calibration sample, an integer >= 1 "
                         "(policy.tree.top_k's, 4 by default)")
