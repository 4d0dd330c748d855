"""Configuration checks of the policy layer, run before any model loads: the methods' options (``policy.<method>.*``,
``check_policy_options``, shared by the eval stage and the server) and the dataset and train stages' configs."""

from __future__ import annotations

from pipeline.decoding.checks import check_common


def check_policy_options(cfg) -> None:
    """The methods' options (``policy.<method>.*``, conf/policy/default.yaml): each predictor method names its
    predictor's sub-folder; ``policy.verify_width``'s ``block_size`` (null or >= 2), ``objective`` (rate or marginal)
    and ``max_skip`` (>= 0).

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    policy = cfg.get("policy") or {}
    for m in ("blockpilot", "full_vocab"):
        if m in policy and not (policy.get(m) or {}).get("predictor"):
            raise ValueError(f"policy.{m}.predictor is empty: give the predictor's sub-folder, e.g. policy.{m}.predictor=mlp")
    vw = policy.get("verify_width") or {}
    if vw.get("block_size") is not None and int(vw.block_size) < 2:
        raise ValueError(f"policy.verify_width.block_size={vw.block_size}: the verify-width policy drafts blocks of B >= 2 "
                         "(null: decode.block_size or the drafter's training B)")
    if vw.get("objective") is not None and str(vw.objective) not in ("rate", "marginal"):
        raise ValueError(f"policy.verify_width.objective={vw.objective!r}: choose rate or marginal")
    if vw.get("max_skip") is not None and int(vw.max_skip) < 0:
        raise ValueError(f"policy.verify_width.max_skip={vw.max_skip}: give 0 (never skip drafts) or more steps")
    check_mixed_options(policy.get("mixed") or {})


def check_mixed_options(mixed) -> None:
    """``policy.mixed``: known ``sources`` (at least one), ``max_n`` and ``branches`` >= 1, ``cache_tokens`` >= 0 (0: no
    suffix cache; with ``cache`` among the sources, >= 1), ``max_nodes`` null or 1..15, ``max_skip`` >= 0, each
    ``cache_seed`` file an eval run's rows.jsonl with responses.

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    from pipeline.policy.mixed import SOURCES

    sources = mixed.get("sources")
    if sources is not None:
        names = [str(s) for s in sources]
        unknown = [s for s in names if s not in SOURCES]
        if unknown or not names:
            raise ValueError(f"policy.mixed.sources={names}: choose one or more of {list(SOURCES)}")
        if "cache" in names and mixed.get("cache_tokens") is not None and int(mixed.cache_tokens) < 1:
            raise ValueError(f"policy.mixed.cache_tokens={mixed.cache_tokens}: the suffix cache needs a bound of >= 1 token "
                             "(e.g. 65536), or drop cache from policy.mixed.sources")
    for key in ("max_n", "branches"):
        if mixed.get(key) is not None and int(mixed[key]) < 1:
            raise ValueError(f"policy.mixed.{key}={mixed[key]}: give 1 or more")
    if mixed.get("cache_tokens") is not None and int(mixed.cache_tokens) < 0:
        raise ValueError(f"policy.mixed.cache_tokens={mixed.cache_tokens}: give 0 (no suffix cache) or more tokens")
    if mixed.get("max_nodes") is not None and not 1 <= int(mixed.max_nodes) <= 15:
        raise ValueError(f"policy.mixed.max_nodes={mixed.max_nodes}: give 1..15 (a verify of up to 16 rows), or null")
    if mixed.get("max_skip") is not None and int(mixed.max_skip) < 0:
        raise ValueError(f"policy.mixed.max_skip={mixed.max_skip}: give 0 or more steps")
    if cache_seed_paths(mixed):
        from pipeline.policy.mixed import read_responses

        read_responses(cache_seed_paths(mixed))  # every file there and readable (the target is checked at the build)


SEED_LABELS = "labels"
"""``policy.mixed.cache_seed=labels``: the run's label stage's replies to the train split's prompts."""


def cache_seed_paths(mixed) -> list[str]:
    """``policy.mixed.cache_seed`` as a list of paths (one path or a list; null or ``labels``: none)."""
    seed = mixed.get("cache_seed")
    if not seed or seed == SEED_LABELS:
        return []
    return [str(seed)] if isinstance(seed, str) else [str(p) for p in seed]


def seeds_from_labels(policy) -> bool:
    """Whether ``policy.mixed.cache_seed`` is ``labels``."""
    return ((policy or {}).get("mixed") or {}).get("cache_seed") == SEED_LABELS


def check_cache_seed_disjoint(policy, prompt_ids, split: str | None = None) -> None:
    """An eval whose ``policy.mixed.cache_seed`` holds a response to one of its own prompts would draft that prompt
    from its own earlier answer: refused. ``labels`` (the train split's replies) needs a run that decodes the test or
    validation ``split``.

    Raises:
        ValueError: naming a shared prompt (or the split) and the fix.
    """
    from pipeline.policy.mixed import read_responses
    from pipeline.prompts import prompt_id_of

    if seeds_from_labels(policy) and split not in ("test", "validation"):
        raise ValueError(f"policy.mixed.cache_seed=labels fills the suffix cache with the label stage's replies to the "
                         f"train split's prompts, but this run decodes {split or 'every configured prompt'}: decode the "
                         "test or validation split (eval.split=test, bench.split=test)")
    paths = cache_seed_paths((policy or {}).get("mixed") or {})
    if not paths:
        return
    shared = sorted({prompt_id_of(r) for r in read_responses(paths)} & {str(p) for p in prompt_ids})
    if shared:
        raise ValueError(f"policy.mixed.cache_seed holds responses to {len(shared)} prompts this run decodes (e.g. "
                         f"{shared[0]}): seed the suffix cache from runs on other prompts (another set, or data.offset "
                         "past this run's)")


def check_dataset_config(cfg) -> None:
    """Check the composed ``conf/dataset.yaml`` (the shared groups; no model loads).

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    check_common(cfg, loads_model=False)


def check_train_config(cfg) -> None:
    """Check the composed ``conf/train.yaml`` (the shared groups; no target loads).

    Raises:
        ValueError: for the first bad value, naming the key and the fix.
    """
    check_common(cfg, loads_model=False)
