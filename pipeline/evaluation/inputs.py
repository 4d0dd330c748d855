"""What an eval run reads before it decodes: the split, the prompts, and the artifacts its methods need.

``check_prompts`` reads the configured prompt files before any model loads (a broken JSONL line is reported at once);
``load_eval_inputs`` loads labels, split ids, predictors and the verify-width calibration + cost model through the one
builder of every stage's methods (``pipeline.policy.setup``, as the server and ``bench_batch`` load them);
``method_schedules`` builds every method's schedule factory there.
"""

from __future__ import annotations

import dataclasses
import logging

from omegaconf import DictConfig

from pipeline.policy import registry, setup
from pipeline.policy.checks import check_cache_seed_disjoint
from pipeline.policy.registry import METHODS, PolicyInputs
from pipeline.prompts import Prompt, check_label_template_kwargs, load_prompt_sets, prompt_id_of

log = logging.getLogger(__name__)

EvalInputs = PolicyInputs  # the eval stage's name for the methods' loaded inputs
WIDTH_METHODS = tuple(m for m, d in METHODS.items() if registry.CALIBRATION in d.needs)
SPLIT_METHODS = tuple(m for m, d in METHODS.items() if d.label_split)


def sources(cfg: DictConfig):
    """Where the eval stage's methods read their inputs (``pipeline.policy.setup.Sources``): ``eval.predictor_dir`` (the
    predictors, and the run's calibration in its ``verify_width``), ``eval.labels_dir`` / ``features_dir``,
    ``decode.block_size``; a predictor must choose among ``model.candidates``."""
    from pipeline.policy.setup import Sources

    hint = (f"run the train stage: make train (python -m pipeline.train run_name={cfg.run_name}; for full_vocab: "
            "predictor=full_vocab, after make dataset features=full_vocab on labels with label.store_full_logits=true)")
    return Sources("eval", str(cfg.eval.predictor_dir), str(cfg.eval.labels_dir), str(cfg.eval.features_dir),
                   cfg.decode.get("block_size"), "decode.block_size", str(cfg.eval.get("target", "tau")),
                   check_candidates=True, missing_hint=hint)


def resolve_split(cfg: DictConfig, methods: list[str]) -> str | None:
    """The split whose prompts are decoded: None (every configured prompt) or train/validation/test.

    Raises:
        ValueError: for an unknown ``eval.split``.
    """
    split = str(cfg.eval.get("split", "auto") or "all")
    if split == "auto":
        return "test" if any(m in SPLIT_METHODS for m in methods) else None
    if split == "all":
        return None
    if split not in ("train", "validation", "test"):
        raise ValueError(f"eval.split must be auto, all, train, validation or test; got {split!r}")
    return split


def check_prompts(cfg: DictConfig) -> int:
    """Read every configured prompt file once (no model needed) and return the prompt count.

    Raises:
        FileNotFoundError / ValueError: for a prompt set that can be read neither from its file nor from the hub (with
            ``data.missing=skip``: only when no set can), or a broken line (``pipeline.prompts`` names the fix, the line).
    """
    prompts = load_prompt_sets(cfg.data.sets, None, cfg.data.seed, missing=missing_sets(cfg),
                               skipped_to=cfg.data.get("skipped_to"))
    methods = [str(m) for m in cfg.eval.get("methods") or []]
    if "mixed" in methods:  # the prompts it decodes (without a split: data.limit and offset; with one: any of them)
        split = resolve_split(cfg, methods)
        decoded = prompts if split is not None else select_prompts(cfg, None, EvalInputs())
        check_cache_seed_disjoint(cfg.get("policy"), [p.id for p in decoded], split)
    return len(prompts)


def missing_sets(cfg: DictConfig) -> str:
    """``data.missing`` (``error`` when absent): what a prompt set that cannot be read does (``pipeline.prompts``)."""
    return str(cfg.data.get("missing", "error") or "error")


def load_eval_inputs(cfg: DictConfig, methods: list[str], decoder=None) -> EvalInputs:
    """Load the labels, split ids, predictors and calibration that ``methods`` need (labels also when merely present,
    for the report's figures).

    Raises:
        FileNotFoundError: when a needed artifact is missing; the message names the stage to run.
        ValueError: when a predictor does not fit the decoder (vocabulary, block-size limit) or ``model.candidates``.
    """
    src = dataclasses.replace(sources(cfg), split=resolve_split(cfg, methods), labels_if_present=True)
    inputs = setup.load_inputs(cfg, decoder, methods, src)  # labels, splits, predictors, calibration, cost model
    meta = inputs.label_meta
    check_label_template_kwargs(meta, cfg.model, str(cfg.eval.labels_dir))  # prompts of other token ids: labels of other text
    if meta:
        for key, value in (("max_new_tokens", cfg.decode.max_new_tokens), ("temperature", cfg.decode.temperature)):
            if key in meta and meta[key] != value:
                log.warning("labels were made with %s=%s but decode.%s=%s: oracle/best_fixed B may not be optimal here",
                            key, meta[key], key, value)
    return inputs


def method_schedules(cfg: DictConfig, decoder, inputs: EvalInputs | None = None, methods: list[str] | None = None) -> dict:
    """Schedule factories of ``methods`` (the one method table, ``pipeline.policy.setup``), or of every method available
    with ``inputs`` (``registry.available``: ``ar``, ``fixed``, ``ema`` and the transformers baselines always; the
    others when their labels, splits, predictor or calibration are loaded).

    Raises:
        ValueError: for an unknown method, one whose inputs are missing, or a B the drafter cannot draft (named).
    """
    inputs = inputs if inputs is not None else EvalInputs()
    if methods is None:
        return registry.available(setup.context(cfg, decoder, inputs, sources(cfg)))
    return setup.build_methods(cfg, decoder, inputs, methods, sources(cfg))


def select_prompts(cfg: DictConfig, split: str | None, inputs: EvalInputs) -> list[Prompt]:
    """The configured prompts, restricted to ``split``'s ids (then ``data.limit`` per set) when a split is used.

    Raises:
        ValueError: when none of the split's prompts is among the configured prompt sets.
    """
    if split is None:
        return load_prompt_sets(cfg.data.sets, cfg.data.limit, cfg.data.seed, cfg.data.get("offset", 0), missing_sets(cfg),
                                cfg.data.get("skipped_to"))  # a skipped set's share to data.skipped_to (the demo)
    wanted = {prompt_id_of(i) for i in inputs.splits[split]}
    prompts = [p for p in load_prompt_sets(cfg.data.sets, None, cfg.data.seed, missing=missing_sets(cfg)) if p.id in wanted]
    if not prompts:
        raise ValueError(f"none of the {len(wanted)} {split} prompts of {cfg.eval.features_dir} is in the configured prompt "
                         "sets; pass the label stage's prompt sets (data=...)")
    if len(prompts) < len(wanted):
        log.warning("%d of the %d %s prompts are not in the configured prompt sets; evaluating %d",
                    len(wanted) - len(prompts), len(wanted), split, len(prompts))
    if cfg.data.limit:
        kept: dict[str, int] = {}
        limited = []
        for p in prompts:
            if kept.get(p.source_set, 0) < int(cfg.data.limit):
                kept[p.source_set] = kept.get(p.source_set, 0) + 1
                limited.append(p)
        prompts = limited
    return prompts
