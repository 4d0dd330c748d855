"""What an eval run reads before it decodes: the split, the prompts, and the artifacts its methods need.

``check_prompts`` reads the configured prompt files before any model loads (a broken JSONL line is reported at once);
``load_eval_inputs`` loads labels, split ids, predictors and the verify-width calibration + cost model through
``pipeline.policy.registry`` (the server loads them the same way); ``method_schedules`` builds every method's
schedule factory from the registry.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.policy import registry
from pipeline.policy.registry import METHODS, PerPrompt, PolicyInputs  # noqa: F401  (PerPrompt: re-exported)
from pipeline.prompts import Prompt, check_label_template_kwargs, load_prompt_sets, prompt_id_of

log = logging.getLogger(__name__)

EvalInputs = PolicyInputs  # the eval stage's name for the methods' loaded inputs
LABEL_METHODS = tuple(m for m, d in METHODS.items() if registry.LABELS in d.needs)
PREDICTOR_METHODS = ("blockpilot", "full_vocab")
WIDTH_METHODS = tuple(m for m, d in METHODS.items() if registry.CALIBRATION in d.needs)
SPLIT_METHODS = tuple(m for m, d in METHODS.items() if d.label_split)


def policy_options(cfg: DictConfig) -> dict:
    """The ``policy`` config group as a plain dict (``{method: {option: value}}``)."""
    return OmegaConf.to_container(cfg.policy, resolve=True) if cfg.get("policy") is not None else {}


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
    return len(load_prompt_sets(cfg.data.sets, None, cfg.data.seed, missing=missing_sets(cfg)))


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
    from pipeline.labeling.store import read_label_table
    from pipeline.policy.data import split_prompt_ids

    inputs = EvalInputs()
    labels_dir = Path(cfg.eval.labels_dir)
    need_labels = any(m in LABEL_METHODS for m in methods)
    if need_labels or any(labels_dir.glob("shard-*.parquet")):
        try:
            inputs.labels, inputs.label_meta = read_label_table(labels_dir)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"eval methods {[m for m in methods if m in LABEL_METHODS]} need labels: {err}") from err
    split = resolve_split(cfg, methods)
    if split is not None or "best_fixed" in methods:
        try:
            inputs.splits = split_prompt_ids(cfg.eval.features_dir)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"eval.split={split} / best_fixed need the dataset stage's splits: {err}") from err
    wanted = {METHODS[m].predictor for m in methods if m in METHODS and METHODS[m].predictor}
    for method in [m for m in PREDICTOR_METHODS if m in wanted]:
        inputs.predictors[method] = load_method_predictor(cfg, method, decoder)
    if any(m in WIDTH_METHODS for m in methods):
        load_verify_width_inputs(cfg, inputs, decoder)
    meta = inputs.label_meta
    check_label_template_kwargs(meta, cfg.model, str(labels_dir))  # prompts of other token ids: labels of other text
    if meta:
        for key, value in (("max_new_tokens", cfg.decode.max_new_tokens), ("temperature", cfg.decode.temperature)):
            if key in meta and meta[key] != value:
                log.warning("labels were made with %s=%s but decode.%s=%s: oracle/best_fixed B may not be optimal here",
                            key, meta[key], key, value)
    return inputs


def load_method_predictor(cfg: DictConfig, method: str, decoder=None):
    """The exported predictor of ``method`` (``eval.predictor_dir/<policy.<method>.predictor>``), checked against
    ``model.candidates`` and the decoder (``registry.load_method_predictor``).

    Raises:
        FileNotFoundError: without an exported predictor (names ``make train``).
        ValueError: when its candidates differ from ``model.candidates``, or it does not fit the decoder.
    """
    directory = registry.predictor_folder(cfg.eval.predictor_dir, method, policy_options(cfg))
    hint = "" if method == "blockpilot" else " predictor=full_vocab (after make dataset features=full_vocab, labels with label.store_full_logits=true)"
    return registry.load_method_predictor(
        method, directory, decoder, list(cfg.model.candidates), str(cfg.model.device),
        f"run the train stage: make train (python -m pipeline.train run_name={cfg.run_name}{hint})")


def verify_width_block_size(cfg: DictConfig, decoder) -> int:
    """B drafted by ``verify_width``: ``policy.verify_width.block_size``, else ``decode.block_size``, else the training B."""
    return registry.verify_width_block_size(policy_options(cfg), decoder, cfg.decode.get("block_size"))


def load_verify_width_inputs(cfg: DictConfig, inputs: EvalInputs, decoder) -> None:
    """The calibration (``policy.verify_width.calibration``, else ``<eval.predictor_dir>/verify_width``, else the
    drafter folder's) and this machine's latency model, measured (or reused from ``policy.verify_width.latency.cache``,
    shared with the label stage) for every width up to the largest candidate or B, into ``inputs``.

    Raises:
        FileNotFoundError: without a calibration; ValueError: without a drafter.
    """
    widths = [*cfg.model.candidates, verify_width_block_size(cfg, decoder)] if decoder is not None else []
    registry.load_verify_width(inputs, decoder, policy_options(cfg), Path(cfg.eval.predictor_dir) / "verify_width",
                               cfg.model.get("drafter"), widths, cfg)


def policy_context(cfg: DictConfig, decoder, inputs: EvalInputs | None) -> registry.Context:
    """The registry's build context of an eval run."""
    return registry.Context(decoder, policy_options(cfg), inputs if inputs is not None else EvalInputs(),
                            [int(c) for c in cfg.model.candidates], cfg.decode.get("block_size"), "decode.block_size",
                            str(cfg.eval.get("target", "tau")), "eval")


def method_schedules(cfg: DictConfig, decoder, inputs: EvalInputs | None = None, methods: list[str] | None = None) -> dict:
    """Schedule factories of ``methods`` (``registry.build``), or of every method available with ``inputs``
    (``registry.available``: ``ar``, ``fixed``, ``ema`` and the transformers baselines always; the others when their
    labels, splits, predictor or calibration are loaded).

    Raises:
        ValueError: for an unknown method, one whose inputs are missing, or a B the drafter cannot draft (named).
    """
    ctx = policy_context(cfg, decoder, inputs)
    if methods is None:
        return registry.available(ctx)
    return {m: registry.build(m, ctx) for m in dict.fromkeys(methods)}


def select_prompts(cfg: DictConfig, split: str | None, inputs: EvalInputs) -> list[Prompt]:
    """The configured prompts, restricted to ``split``'s ids (then ``data.limit`` per set) when a split is used.

    Raises:
        ValueError: when none of the split's prompts is among the configured prompt sets.
    """
    if split is None:
        return load_prompt_sets(cfg.data.sets, cfg.data.limit, cfg.data.seed, cfg.data.get("offset", 0), missing_sets(cfg))
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
