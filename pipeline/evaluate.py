"""``eval`` stage: decode a prompt set with several block-size methods and compare them.

    python -m pipeline.evaluate data=humaneval data.limit=20 decode.max_new_tokens=128 \
        decode.block_size=8 eval.methods=[ar,fixed] eval.out=data/eval/humaneval.json
    make eval    # python -m pipeline.evaluate run_name=<run> data=<the label stage's sets> \
                 #   eval.methods=[ar,fixed,best_fixed,blockpilot,ema,oracle]   (+ full_vocab when trained)

Methods:
  * ``ar`` (B=1) and ``fixed`` (``decode.block_size``, default the drafter's training block size);
  * ``ema``: ``EMASchedule`` over ``model.candidates`` (per-step adaptive baseline);
  * ``best_fixed``: the single candidate B with the best mean label (tau, or tokens/s with
    ``eval.target=speed``) over the train split's requests;
  * ``oracle``: each request's own label B (``label_tau``, or ``label_speed``; every turn of a multi-turn
    prompt is a request with its own label, ``pipeline.prompts.request_id``);
  * ``blockpilot`` / ``full_vocab``: the trained predictors (``eval.predictor_dir/<eval.predictors[m]>``)
    pick B once from the prefill logits of each request (each turn of a multi-turn prompt); their time is
    part of the request (``schedule_ms``).
``best_fixed`` and ``oracle`` read the label stage's rows (``eval.labels_dir``), the predictor methods
read ``predictor.json`` + ``predictor.safetensors``, and ``eval.split`` (``auto``: ``test`` as soon as one
of those four methods runs, else every configured prompt) takes the split's prompt ids from the dataset
stage's DatasetDict (``eval.features_dir``); the prompts themselves come from ``data``.

Every method decodes every prompt with the same decoder; prompts are interleaved across methods so
machine noise hits all of them alike. With ``eval.share_decodes`` (default on) a request whose method
keeps one B for the whole request (``ar``, ``fixed``, ``best_fixed``, ``oracle``, the predictors) runs its
own prefill and its own choice of B, both timed, and then reuses the decode of that (request, B) when
an earlier method of the same prompt already ran it: decoding is deterministic given (request, B,
seed), so only the decode's wall time is shared, which also removes timing noise between methods
that pick the same B. ``ema`` always decodes on its own. Writes a JSON file with, per method, ``tau`` (mean acceptance
length over all steps, tokens), ``tokens_per_s`` (new tokens over prefill + schedule + decode time),
``speedup`` (vs ``ar`` in this run), ``tpot_ms``, ``lossless`` (the exact-match rate: the fraction of prompts whose
output is token-identical to ``ar``'s, 1.0 = every one; ``exact_matches`` counts them; in float32 it is 1.0, in
bfloat16 it may be lower, see the README's numerics section), ``n_prompts``, ``overhead_ms`` (time choosing B per prompt, ms) and ``overhead_pct`` (its share of
decode time, %), ``oracle_gain_share`` = (tau - tau_fixed) / (tau_oracle - tau_fixed) with a bootstrap
95% interval over prompts ``oracle_gain_share_ci`` (null unless ``fixed`` and ``oracle`` ran), and
per-prompt rows (``chosen_b``: the B picked for the first turn, ``chosen_bs``: for every turn);
``per_set`` repeats the summary per source set. Beside it: ``results.md`` and PNG figures (``pipeline.reporting``), also logged to W&B.

A prompt that does not fit the target's context (prompt + ``decode.max_new_tokens``, any turn) is skipped with a
warning naming it and listed in ``skipped`` (``[{"id", "reason"}]``). ``main`` keeps per-prompt rows in ``rows.jsonl``
beside ``results.json``, one line per finished prompt appended as it finishes; a rerun with the same settings
reuses them and decodes only the prompts not yet there (other settings: the old file is moved to ``rows.jsonl.old``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from pipeline.config_checks import validate_config
from pipeline.decoding import DecodeConfig, EMASchedule, FixedSchedule
from pipeline.decoding.schedules import FirstChoice
from pipeline.decoding.speculative import PromptTooLongError, RequestStats, _now
from pipeline.decoding.conversation import decode_prompt
from pipeline.models.loading import build_decoder
from pipeline.prompts import (Prompt, check_label_template_kwargs, load_prompt_sets, prompt_id_of, request_id,
                              set_chat_template_kwargs, template_kwargs_of)
from pipeline.tracking import init_wandb

log = logging.getLogger(__name__)

LABEL_METHODS = ("best_fixed", "oracle")
PREDICTOR_METHODS = ("blockpilot", "full_vocab")
WIDTH_METHODS = ("verify_width", "hybrid")  # per-step verify width (pipeline.policy.verify_width)
SPLIT_METHODS = LABEL_METHODS + PREDICTOR_METHODS + ("hybrid",)


class PerPrompt:
    """A schedule factory that needs the request (e.g. the oracle): ``fn(prompt, turn) -> schedule``."""

    def __init__(self, fn: Callable[[Prompt, int], object]):
        self.fn = fn

    def bind(self, prompt: Prompt) -> Callable[[], object]:
        """A zero-argument factory for ``decode_prompt``: its k-th call builds the schedule of turn k (0-based)."""
        turn = iter(range(len(prompt.turns)))
        return lambda: self.fn(prompt, next(turn))


class SharedDecodes:
    """Decoder front end for the eval stage that runs each (request, B) decode once (see module docstring).

    Quacks like ``SpeculativeDecoder`` for ``decode_prompt`` (``target``, ``generate``). For a schedule
    with ``static = True`` it prefills, times ``schedule.first`` as ``schedule_ms``, and decodes with that
    fixed B, or copies the stored decode of the same (request ids, B, decoding config) with this
    request's own ``prefill_ms`` and ``schedule_ms``. Other schedules go straight to the decoder.
    ``clear()`` forgets the stored decodes (called between prompts to bound memory).

    Attributes:
        decodes: decodes actually run; reused: requests served from a stored decode.
    """

    def __init__(self, decoder):
        self.decoder = decoder
        self.target = decoder.target
        self.memo: dict[tuple, RequestStats] = {}
        self.decodes = self.reused = 0

    def clear(self) -> None:
        self.memo.clear()

    def generate(self, input_ids: torch.Tensor, schedule, config: DecodeConfig) -> RequestStats:
        if not getattr(schedule, "static", False):
            self.decodes += 1
            return self.decoder.generate(input_ids, schedule, config)
        prefill = self.decoder.prefill(input_ids, config, want_features=schedule.max_block_size > 1)
        t0 = _now(self.decoder.device)
        block_size = int(schedule.first(prefill.last_logits))
        schedule_ms = (_now(self.decoder.device) - t0) * 1e3
        key = (tuple(input_ids.flatten().tolist()), block_size, config.max_new_tokens, config.temperature, config.seed)
        stored = self.memo.get(key)
        if stored is None:
            self.decodes += 1
            stored = self.memo[key] = self.decoder.decode(prefill, FixedSchedule(block_size), config)
        else:
            self.reused += 1
        return dataclasses.replace(stored, output_ids=list(stored.output_ids), taus=list(stored.taus),
                                   block_sizes=list(stored.block_sizes), prefill_ms=prefill.prefill_ms,
                                   schedule_ms=schedule_ms)


@dataclass
class EvalInputs:
    """What the label-based and predictor methods need (each None/empty when not needed).

    Attributes:
        labels: label rows (``pipeline.dataset.read_label_table``); label_meta: its ``meta.json``;
        splits: ``{split: prompt ids}`` from the feature DatasetDict; predictors: ``{method: Predictor}``;
        calibration / calibration_path / latency: the verify-width policy's acceptance calibration and this
        machine's ``LatencyModel`` (for ``verify_width`` and ``hybrid``).
    """

    labels: object = None
    label_meta: dict = field(default_factory=dict)
    splits: dict[str, list[str]] | None = None
    predictors: dict = field(default_factory=dict)
    calibration: object = None
    calibration_path: str | None = None
    latency: object = None

    @property
    def candidates(self) -> list[int] | None:
        return [int(b) for b in self.labels["candidates"].iloc[0]] if self.labels is not None and len(self.labels) else None


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


def load_eval_inputs(cfg: DictConfig, methods: list[str], decoder=None) -> EvalInputs:
    """Load the labels, split ids and predictors that ``methods`` need (labels also when merely present, for plots).

    Raises:
        FileNotFoundError: when a needed artifact is missing; the message names the stage to run.
        ValueError: when a predictor does not fit the decoder (vocabulary, block-size limit).
    """
    from pipeline.dataset import read_label_table, split_prompt_ids

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
    for method in methods:
        if method in PREDICTOR_METHODS:
            inputs.predictors[method] = load_method_predictor(cfg, method, decoder)
    if "hybrid" in methods and "blockpilot" not in inputs.predictors:
        inputs.predictors["blockpilot"] = load_method_predictor(cfg, "blockpilot", decoder)
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


def calibration_path(cfg: DictConfig) -> Path:
    """Where the verify-width calibration is read: ``eval.verify_width.calibration`` when set, else the run's
    ``<eval.predictor_dir>/verify_width`` (the train stage's export) when present, else the drafter folder's shipped
    ``calibration.json`` (``pipeline.policy.verify_width.find_calibration``).

    Raises:
        FileNotFoundError: when none exists (names the train stage).
    """
    from pipeline.policy.verify_width import find_calibration

    vw = cfg.eval.get("verify_width") or {}
    return find_calibration(vw.get("calibration"), Path(cfg.eval.predictor_dir) / "verify_width", cfg.model.get("drafter"))


def load_verify_width_inputs(cfg: DictConfig, inputs: EvalInputs, decoder) -> None:
    """Load the calibration (``calibration_path``) and this machine's latency model into ``inputs``.

    The latency model is measured (or reused from ``eval.verify_width.latency.cache``, shared with the label stage)
    for every width up to the largest candidate or B, unless ``eval.verify_width.latency.path`` names a stored one.

    Raises:
        FileNotFoundError: without a calibration; ValueError: without a drafter.
    """
    from pipeline.labeling.runner import latency_identity
    from pipeline.policy.verify_width import load_calibration, load_cost_model

    if decoder is not None and decoder.drafter is None:
        raise ValueError("eval methods verify_width/hybrid need a drafter (model.drafter=...)")
    path = calibration_path(cfg)
    inputs.calibration, inputs.calibration_path = load_calibration(path), str(path)
    lat = (cfg.eval.get("verify_width") or {}).get("latency") or {}
    if lat.get("path") or decoder is not None:
        widths = [*cfg.model.candidates, verify_width_block_size(cfg, decoder)] if decoder is not None else []
        inputs.latency = load_cost_model(decoder, lat, widths, cfg.decode.temperature, cfg.seed, latency_identity(cfg.model))


def verify_width_bound(inputs: "EvalInputs", block_size: int, prompt_ids: set[str]) -> dict | None:
    """``pipeline.policy.verify_width.foresight_bound`` over the labelled requests of ``prompt_ids`` with the run's
    latency model, or None (with a log line) when the labels or the latency model are missing or hold no samples
    at ``block_size``."""
    from pipeline.policy.verify_width import foresight_bound
    from pipeline.prompts import prompt_id_of

    if inputs.labels is None or inputs.latency is None:
        return None
    ids = {i for i in inputs.labels["id"].astype(str) if prompt_id_of(i) in prompt_ids}
    try:
        return foresight_bound(inputs.labels, inputs.latency, block_size, ids)
    except ValueError as err:
        log.info("no verify-width foresight bound: %s", err)
        return None


def verify_width_block_size(cfg: DictConfig, decoder) -> int:
    """B drafted by ``verify_width``: ``eval.verify_width.block_size``, else ``decode.block_size``, else the training B."""
    vw = cfg.eval.get("verify_width") or {}
    if vw.get("block_size"):
        return int(vw.block_size)
    if cfg.decode.get("block_size") is not None:
        return int(cfg.decode.block_size)
    return decoder.drafter.block_size if decoder.drafter is not None else 1


def load_method_predictor(cfg: DictConfig, method: str, decoder=None):
    """The exported predictor of ``method`` (``eval.predictor_dir/<eval.predictors[method]>``), checked against the config
    and the decoder.

    Raises:
        FileNotFoundError: without an exported predictor (names ``make train``).
        ValueError: when its candidates differ from ``model.candidates``, or it does not fit the decoder (vocabulary,
            the drafter's block-size limit); also ``load_predictor``'s checks of the files against each other.
    """
    from pipeline.policy.export import load_predictor

    name = cfg.eval.predictors[method]
    directory = Path(cfg.eval.predictor_dir) / name
    hint = "" if method == "blockpilot" else " predictor=full_vocab (after make dataset features=full_vocab, labels with label.store_full_logits=true)"
    try:
        predictor = load_predictor(directory, device=cfg.model.device)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"eval method {method!r} needs a trained predictor at {directory}; run the train stage: "
                                f"make train (python -m pipeline.train run_name={cfg.run_name}{hint})") from err
    candidates = [int(c) for c in cfg.model.candidates]
    if sorted(predictor.candidates) != sorted(candidates):
        raise ValueError(f"predictor {directory} chooses among block sizes {predictor.candidates}, but model.candidates="
                         f"{candidates}: evaluate with model.candidates={predictor.candidates} or train a predictor on labels "
                         f"made with these candidates (label.block_sizes=${{model.candidates}})")
    if decoder is not None:
        vocab = decoder.lm_head.shape[0]
        spec_vocab = predictor.featurizer.spec.vocab_size
        if spec_vocab and spec_vocab != vocab:
            raise ValueError(f"predictor {directory} was trained on a vocabulary of {spec_vocab}, the target has {vocab}: "
                             "train it on labels of this target")
        limit = decoder.drafter.max_block_size if decoder.drafter is not None else 1
        if max(predictor.candidates) > limit:
            raise ValueError(f"predictor {directory} picks block sizes up to {max(predictor.candidates)}, beyond the drafter's "
                             f"limit {limit}; use a predictor trained for this drafter")
    return predictor


def best_fixed_block_size(inputs: EvalInputs, target: str = "tau") -> int:
    """The candidate B with the best mean tau (``target=tau``) or tokens/s (``speed``) over the train split's labels.

    Raises:
        ValueError: when no train-split prompt has a label.
    """
    column = "tau" if target == "tau" else "tokens_per_s"
    train = set(inputs.splits["train"])
    rows = inputs.labels[inputs.labels["id"].isin(train)]
    if rows.empty:
        raise ValueError("no train-split prompt has a label: rebuild the dataset (make dataset) from these labels")
    mean = np.stack(rows[column].map(np.asarray).to_list()).astype(float).mean(0)
    return inputs.candidates[int(np.argmax(mean))]  # first maximum: the smaller B on ties


def method_schedules(cfg: DictConfig, decoder, inputs: EvalInputs | None = None) -> dict[str, Callable[[], object] | PerPrompt]:
    """Schedule factories of every method available with ``inputs``.

    ``ar``, ``fixed`` and ``ema`` need nothing; ``best_fixed``/``oracle`` need ``inputs.labels`` (and the
    train split for ``best_fixed``); ``blockpilot``/``full_vocab`` need their loaded predictor.
    """
    from pipeline.policy.schedule import PredictorSchedule

    trained_b = decoder.drafter.block_size if decoder.drafter is not None else 1
    fixed_b = trained_b if cfg.decode.get("block_size") is None else int(cfg.decode.block_size)
    try:
        decoder.check_block_size(fixed_b)
    except ValueError as err:
        raise ValueError(f"decode.block_size={cfg.decode.get('block_size')}: {err}") from err
    ema = cfg.eval.get("ema") or {}
    candidates = list(cfg.model.candidates)
    out: dict = {
        "ar": lambda: FixedSchedule(1),
        "fixed": lambda: FixedSchedule(fixed_b),
        "ema": lambda: EMASchedule(candidates, ema.get("alpha", 0.5), ema.get("margin", 1.0), ema.get("start")),
    }
    if inputs is None:
        return out
    target = str(cfg.eval.get("target", "tau"))
    if inputs.labels is not None:
        label_col = "label_tau" if target == "tau" else "label_speed"
        label_of = dict(zip(inputs.labels["id"].astype(str), inputs.labels[label_col].astype(int)))

        def oracle(prompt: Prompt, turn: int):
            if prompt.id not in label_of:
                raise ValueError(f"prompt {prompt.id!r} has no label in {cfg.eval.labels_dir}; label it (make label) or "
                                 "evaluate the dataset's split (eval.split=test)")
            rid = request_id(prompt.id, turn)
            if rid not in label_of:  # labels made with label.turns=first: the first turn's label for every turn
                log.warning("no label for request %r (labels of first turns only?); the oracle uses %r's", rid, prompt.id)
                rid = prompt.id
            return FixedSchedule(label_of[rid])

        out["oracle"] = PerPrompt(oracle)
        if inputs.splits is not None:
            best = best_fixed_block_size(inputs, target)
            out["best_fixed"] = lambda: FixedSchedule(best)
    for method, predictor in inputs.predictors.items():
        out[method] = lambda p=predictor: PredictorSchedule(p)
    if inputs.calibration is not None and inputs.latency is not None:
        from pipeline.policy.verify_width import VerifyWidthSchedule

        vw = cfg.eval.get("verify_width") or {}
        width_b = verify_width_block_size(cfg, decoder)
        decoder.check_block_size(width_b)
        options = {"skip_drafts": bool(vw.get("skip_drafts", True)), "max_skip": int(vw.get("max_skip", 8)),
                   "objective": str(vw.get("objective", "rate"))}
        out["verify_width"] = lambda: VerifyWidthSchedule(inputs.calibration, inputs.latency, width_b, **options)
        if "blockpilot" in inputs.predictors:
            out["hybrid"] = lambda: VerifyWidthSchedule(inputs.calibration, inputs.latency, width_b,
                                                        inputs.predictors["blockpilot"], **options)
    return out


def select_prompts(cfg: DictConfig, split: str | None, inputs: EvalInputs) -> list[Prompt]:
    """The configured prompts, restricted to ``split``'s ids (then ``data.limit`` per set) when a split is used.

    Raises:
        ValueError: when none of the split's prompts is among the configured prompt sets.
    """
    if split is None:
        return load_prompt_sets(cfg.data.sets, cfg.data.limit, cfg.data.seed, cfg.data.get("offset", 0))
    wanted = {prompt_id_of(i) for i in inputs.splits[split]}
    prompts = [p for p in load_prompt_sets(cfg.data.sets, None, cfg.data.seed) if p.id in wanted]
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


def summarize(rows: list[dict], reference: dict[str, list[int]] | None) -> dict:
    """Aggregate per-prompt rows of one method (see the module docstring for the keys)."""
    steps = sum(r["steps"] for r in rows)
    accepted = sum(r["tau"] * r["steps"] for r in rows)
    new_tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["prefill_ms"] + r["schedule_ms"] + r["decode_ms"] for r in rows) / 1e3
    decode_ms = sum(r["decode_ms"] for r in rows)
    schedule_ms = sum(r["schedule_ms"] for r in rows)
    out = {
        "n_prompts": len(rows),
        "tau": accepted / steps if steps else 0.0,
        "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / seconds if seconds else 0.0,
        "tpot_ms": decode_ms / max(1, new_tokens - len(rows)),
        "decode_ms": decode_ms,
        "schedule_ms": schedule_ms,
        "overhead_ms": schedule_ms / len(rows) if rows else 0.0,
        "overhead_pct": 100.0 * schedule_ms / decode_ms if decode_ms else 0.0,
    }
    widths = [k for r in rows for k in r.get("verify_widths", [])]
    if widths:  # mean drafts verified per step
        out["verify_width"] = float(np.mean(widths))
    confidences = [c for r in rows for c in r.get("confidences", [])]
    if any(c is not None for c in confidences):  # a verify-width policy: the share of steps that drafted at all
        out["drafted"] = float(np.mean([c is not None for c in confidences]))
    if reference is not None:
        matches = sum(r["output_ids"] == reference[r["id"]] for r in rows)
        out["exact_matches"] = matches
        out["lossless"] = matches / len(rows) if rows else None  # exact-match rate vs ar, not a bare flag
    return out


def merge_turns(prompt_id: str, source_set: str, stats: list) -> dict:
    """One per-prompt row from the ``RequestStats`` of its turns."""
    steps = sum(len(s.taus) for s in stats)
    return {
        "id": prompt_id,
        "source_set": source_set,
        "steps": steps,
        "tau": sum(sum(s.taus) for s in stats) / steps if steps else 0.0,
        "new_tokens": sum(s.new_tokens for s in stats),
        "prefill_ms": sum(s.prefill_ms for s in stats),
        "decode_ms": sum(s.decode_ms for s in stats),
        "schedule_ms": sum(s.schedule_ms for s in stats),
        "block_sizes": sorted({b for s in stats for b in s.block_sizes}),
        "verify_widths": [k for s in stats for k in s.verify_widths],
        "confidences": [c for s in stats for c in s.confidences],
        "output_ids": [t for s in stats for t in s.output_ids],
    }


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def oracle_gain_share(rows: dict[str, list[dict]], method: str, samples: int = 1000, seed: int = 0) -> tuple[float | None, list]:
    """(tau_method - tau_fixed) / (tau_oracle - tau_fixed) over the prompts all three decoded, with a
    percentile bootstrap 95% interval over prompts (tau = accepted tokens / steps of the resampled prompts).

    Returns:
        (share or None when the oracle gains nothing over fixed, [low, high] or [None, None]).
    """
    by_id = {m: {r["id"]: r for r in rows[m]} for m in (method, "fixed", "oracle")}
    ids = [i for i in by_id[method] if i in by_id["fixed"] and i in by_id["oracle"]]
    if not ids:
        return None, [None, None]
    acc = np.array([[by_id[m][i]["tau"] * by_id[m][i]["steps"] for i in ids] for m in (method, "fixed", "oracle")])
    steps = np.array([[by_id[m][i]["steps"] for i in ids] for m in (method, "fixed", "oracle")], dtype=float)

    def share(a: np.ndarray, s: np.ndarray) -> np.ndarray:
        tau = a / np.maximum(s, 1e-12)
        gain = tau[2] - tau[1]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(gain > 1e-9, (tau[0] - tau[1]) / gain, np.nan)

    point = float(share(acc.sum(1), steps.sum(1)))
    idx = np.random.default_rng(seed).integers(0, len(ids), size=(samples, len(ids)))
    boot = share(acc[:, idx].sum(-1), steps[:, idx].sum(-1))
    boot = boot[np.isfinite(boot)]
    ci = [_finite(np.percentile(boot, 2.5)), _finite(np.percentile(boot, 97.5))] if len(boot) else [None, None]
    return _finite(point), ci


def summarize_all(rows: dict[str, list[dict]], methods: list[str], reference: dict, boot: dict) -> dict[str, dict]:
    """Summary of every method over ``rows`` (one source set or all): ``summarize`` + speedup + oracle gain share."""
    block = {m: summarize(rows[m], reference) for m in methods}
    ar_speed = block["ar"]["tokens_per_s"]
    shares = "fixed" in rows and "oracle" in rows
    for m in methods:
        block[m]["speedup"] = block[m]["tokens_per_s"] / ar_speed if ar_speed else 0.0
        per_request = shares and m not in WIDTH_METHODS  # a per-step verify width trades tau for speed: no tau share
        share, ci = oracle_gain_share(rows, m, int(boot.get("samples", 1000)), int(boot.get("seed", 0))) if per_request else (None, [None, None])
        block[m]["oracle_gain_share"], block[m]["oracle_gain_share_ci"] = share, ci
    return block


class RowLog:
    """Per-prompt rows of one eval run in a JSONL file, appended one line per finished prompt (resume after a kill).

    Line 1 is ``{"settings": ...}`` (what the rows depend on); each later line is ``{"id", "rows": {method: row}}``
    or ``{"id", "skipped": reason}``. A line is written with one ``write`` + ``fsync``; a line cut by a kill is
    dropped on the next open. Opening with other settings moves the old file to ``<name>.old`` and starts afresh.

    Args:
        path: the JSONL file (``rows.jsonl`` beside ``results.json``); None keeps nothing (no resume).
        settings: JSON-ready settings the rows depend on.
    """

    def __init__(self, path: str | Path | None, settings: dict):
        self.path = Path(path) if path is not None else None
        self.done: dict[str, dict] = {}
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = json.dumps({"settings": settings}, sort_keys=True)
        lines = self.path.read_text().split("\n") if self.path.exists() else []
        complete = []
        for line in lines[:-1]:  # the text after the last newline is empty or a cut line
            try:
                complete.append((line, json.loads(line)))
            except json.JSONDecodeError:
                log.warning("%s: dropping an unreadable line", self.path)
        if complete and complete[0][1].get("settings") != json.loads(header)["settings"]:
            log.warning("%s holds rows of other settings; moving it to %s and starting afresh", self.path,
                        self.path.name + ".old")
            os.replace(self.path, self.path.with_name(self.path.name + ".old"))
            complete = []
        for _, entry in complete[1:]:
            self.done[str(entry["id"])] = entry
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in [header] + [raw for raw, _ in complete[1:]]))
        os.replace(tmp, self.path)
        if self.done:
            log.info("%s: resuming, %d prompts already done", self.path, len(self.done))

    def append(self, entry: dict) -> None:
        """Record one finished (or skipped) prompt."""
        self.done[str(entry["id"])] = entry
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())


def row_settings(cfg: DictConfig, methods: list[str], split: str | None, inputs: EvalInputs | None = None,
                 decoder: SpeculativeDecoder | None = None) -> dict:
    """What the per-prompt rows of an eval run depend on (a resumed run must match it): the methods, decoding and
    model settings, the decoder's forward path (backend with its kernel's version, fast forward, KV cache: the
    rows hold timings), the drafter's weight files (size, mtime) and digests of the loaded predictors and labels
    (a retrained drafter or predictor invalidates the rows)."""
    import hashlib

    def digest(obj) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def weights_stamp(path) -> list | None:  # a checkpoint retrained in place invalidates the rows too
        from pipeline.models.loading import resolve_path

        directory = Path(resolve_path(str(path))) if path else None
        if directory is None or not directory.is_dir():
            return None
        return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(directory.glob("*.safetensors"))]

    keep = ("target", "drafter", "dtype", "device", "attn_implementation")
    loaded = {"drafter_weights": weights_stamp(cfg.model.get("drafter"))}
    if inputs is not None:
        loaded.update({m: digest(p.meta) for m, p in inputs.predictors.items()})
        if inputs.labels is not None:
            loaded["labels"] = digest(inputs.labels[["id", "label_tau", "label_speed"]].astype(str).values.tolist())
    forward = decoder.forward_path() if decoder is not None else None
    return {"loaded": loaded, "methods": list(methods), "split": split, "forward": forward,
            "decode": OmegaConf.to_container(cfg.decode, resolve=True),
            "model": {k: cfg.model.get(k) for k in keep},
            "share_decodes": bool(cfg.eval.get("share_decodes", True)), "target": str(cfg.eval.get("target", "tau")),
            "labels_dir": str(cfg.eval.labels_dir), "predictor_dir": str(cfg.eval.predictor_dir),
            "predictors": OmegaConf.to_container(cfg.eval.predictors, resolve=True) if cfg.eval.get("predictors") else None,
            "verify_width": (OmegaConf.to_container(cfg.eval.verify_width, resolve=True) if cfg.eval.get("verify_width")
                             else None) if any(m in WIDTH_METHODS for m in methods) else None,
            "calibration": digest(inputs.calibration.to_dict()) if inputs is not None and inputs.calibration is not None else None}


def evaluate(cfg: DictConfig, decoder=None, schedules: dict | None = None, inputs: EvalInputs | None = None,
             rows_path: str | Path | None = None) -> dict:
    """Run the configured methods over the configured prompts and return the results dict.

    Args:
        decoder: a ``SpeculativeDecoder`` (default: built from ``cfg.model``).
        schedules: method -> schedule factory (default: ``method_schedules``); a factory is a zero-argument
            callable or a ``PerPrompt``.
        inputs: preloaded ``EvalInputs`` (default: ``load_eval_inputs``).
        rows_path: a ``RowLog`` JSONL file: per-prompt rows are appended as each prompt finishes and a rerun
            resumes from it (``main`` passes ``rows.jsonl`` beside ``eval.out``); None keeps them in memory only.
    Raises:
        ValueError: for a bad config (``validate_config``, before any model loads) or an unknown method;
        FileNotFoundError: for a missing label/dataset/predictor artifact.
    """
    if schedules is None:
        validate_config(cfg, "eval")
    torch.manual_seed(cfg.seed)
    decoder = decoder or build_decoder(cfg.model)
    set_chat_template_kwargs(decoder.target.tokenizer, template_kwargs_of(cfg.model))
    methods = list(cfg.eval.methods)
    inputs = inputs if inputs is not None else load_eval_inputs(cfg, methods, decoder)
    available = schedules or method_schedules(cfg, decoder, inputs)
    unknown = [m for m in methods if m not in available]
    if unknown:
        raise ValueError(f"unknown eval.methods {unknown}; available: {sorted(available)}")
    if "ar" not in methods:
        methods = ["ar"] + methods  # speedup and losslessness are measured against ar in the same run
    split = resolve_split(cfg, methods)
    prompts = select_prompts(cfg, split, inputs)
    decode_cfg = DecodeConfig(cfg.decode.max_new_tokens, cfg.decode.temperature, cfg.decode.seed)
    row_log = RowLog(rows_path, row_settings(cfg, methods, split, inputs, decoder))

    def factory(method: str, prompt: Prompt, chosen: list):
        make = available[method].bind(prompt) if isinstance(available[method], PerPrompt) else available[method]

        def build():
            schedule = FirstChoice(make())
            chosen.append(schedule)
            return schedule

        return build

    todo = [p for p in prompts if p.id not in row_log.done]
    if cfg.eval.warmup:
        for prompt in todo:  # the first prompt that fits the context
            try:
                for m in methods:
                    decode_prompt(decoder, prompt, factory(m, prompt, []), DecodeConfig(8, decode_cfg.temperature, decode_cfg.seed))
                break
            except PromptTooLongError:
                continue
    runner = SharedDecodes(decoder) if cfg.eval.get("share_decodes", True) else decoder
    for prompt in tqdm(todo, desc="eval", unit="prompt"):
        if isinstance(runner, SharedDecodes):
            runner.clear()
        prompt_rows = {}
        try:
            for m in methods:
                chosen: list[FirstChoice] = []
                stats = decode_prompt(runner, prompt, factory(m, prompt, chosen), decode_cfg)
                row = merge_turns(prompt.id, prompt.source_set, stats)
                row["chosen_b"] = chosen[0].chosen if chosen else None  # the first turn's B
                row["chosen_bs"] = [c.chosen for c in chosen]           # every turn's B (one request per turn)
                prompt_rows[m] = row
        except PromptTooLongError as err:
            log.warning("skipping prompt %r: %s", prompt.id, err)
            row_log.append({"id": prompt.id, "skipped": str(err)})
            continue
        row_log.append({"id": prompt.id, "rows": prompt_rows})
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    skipped = []
    for prompt in prompts:
        entry = row_log.done[prompt.id]
        if "skipped" in entry:
            skipped.append({"id": prompt.id, "reason": entry["skipped"]})
            continue
        for m in methods:
            rows[m].append(entry["rows"][m])
    reference = {r["id"]: r["output_ids"] for r in rows["ar"]}
    boot = cfg.eval.get("bootstrap") or {}
    if isinstance(runner, SharedDecodes):
        log.info("decodes run: %d, shared by methods picking the same B: %d", runner.decodes, runner.reused)
    results = {"config": OmegaConf.to_container(cfg.decode, resolve=True), "split": split,
               "shared_decodes": runner.reused if isinstance(runner, SharedDecodes) else 0,
               "skipped": skipped, "methods": summarize_all(rows, methods, reference, boot), "per_set": {},
               "forward_path": decoder.forward_path()}  # the backend that ran and whether it is batch-invariant
    for source_set in sorted({r["source_set"] for r in rows["ar"]}):
        subset = {m: [r for r in rows[m] if r["source_set"] == source_set] for m in methods}
        results["per_set"][source_set] = summarize_all(subset, methods, reference, boot)
    for m in methods:
        results["methods"][m]["rows"] = [{k: v for k, v in r.items() if k != "output_ids"} for r in rows[m]]
    from pipeline.reporting import speed_gains

    results["gains"] = {"all": speed_gains(results), **{s: speed_gains(results, s) for s in results["per_set"]}}
    if inputs.calibration is not None:
        stored = json.loads(Path(inputs.calibration_path).read_text()) if inputs.calibration_path else {}
        results["verify_width"] = {"calibration": inputs.calibration_path, "block_size": verify_width_block_size(cfg, decoder),
                                   "calibration_info": inputs.calibration.info,
                                   "reliability": stored.get("reliability"), "reliability_split": stored.get("reliability_split"),
                                   "latency_model": inputs.latency.to_dict() if inputs.latency is not None else None}
        bound = verify_width_bound(inputs, verify_width_block_size(cfg, decoder), {r["id"] for r in rows["ar"]})
        if bound is not None:
            results["verify_width"]["bound"] = bound
            log.info("verify-width foresight bound at B=%d (latency model, %d requests): %.2fx ar (drafting every step: "
                     "%.2fx; fixed %.2fx)", bound["block_size"], bound["all"]["requests"], bound["all"]["foresight"],
                     bound["all"]["foresight_drafting"], bound["all"]["fixed"])
    if inputs.predictors:
        results["predictors"] = {m: {k: p.meta.get(k) for k in ("arch", "num_parameters", "features", "candidates", "inference_ms", "fallback")}
                                 for m, p in inputs.predictors.items()}
    return results


def write_json(results: dict, out: str | Path) -> Path:
    """Write ``results`` atomically at ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, out)
    return out


def log_to_wandb(run, results: dict, report: dict[str, Path]) -> None:
    """Summary scalars, the results table and the figures of one eval run."""
    import wandb

    from pipeline.reporting import results_frame

    for m, r in results["methods"].items():
        run.summary.update({f"{m}/{k}": v for k, v in r.items() if isinstance(v, (int, float, bool))})
    for s, block in results.get("per_set", {}).items():
        for m, r in block.items():
            run.summary.update({f"{s}/{m}/{k}": v for k, v in r.items() if isinstance(v, (int, float, bool))})
    for s, per in results.get("gains", {}).items():  # verify_width / hybrid over fixed, best_fixed, ar (paired)
        for m, bases in per.items():
            for base, g in bases.items():
                run.summary.update({f"{s}/{m}/gain_vs_{base}": g["gain"], f"{s}/{m}/gain_vs_{base}_ci_low": g["ci"][0]})
    bound = (results.get("verify_width") or {}).get("bound")
    if bound:  # the foresight bound of any verify-width policy (modelled speedups over ar)
        for s, b in [("all", bound["all"]), *bound["per_set"].items()]:
            run.summary.update({f"{s}/verify_width_bound/{k}": v for k, v in b.items()})
    frame = results_frame(results).astype(object).where(lambda f: f.notna(), None)
    payload = {"eval/results": wandb.Table(dataframe=frame)}
    payload.update({f"eval/{name}": wandb.Image(str(path)) for name, path in report.items() if path.suffix == ".png"})
    run.log(payload)


@hydra.main(version_base="1.3", config_path="../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from pipeline.reporting import write_report

    validate_config(cfg, "eval")  # before W&B and before any model loads
    run = init_wandb(cfg, job_type="eval")
    decoder = build_decoder(cfg.model)
    inputs = load_eval_inputs(cfg, list(cfg.eval.methods), decoder)
    results = evaluate(cfg, decoder, inputs=inputs, rows_path=Path(cfg.eval.out).with_name("rows.jsonl"))
    out = write_json(results, cfg.eval.out)
    report = {}
    if cfg.eval.get("report", True):
        label_col = "label_tau" if str(cfg.eval.get("target", "tau")) == "tau" else "label_speed"
        report = write_report(results, out.parent, inputs.labels, label_col, table_name=out.with_suffix(".md").name)
    for m, r in results["methods"].items():
        share = r.get("oracle_gain_share")
        log.info("%-10s tau %.2f  tok/s %.2f  speedup %.2fx  overhead %.3f ms (%.3f%%)  gain share %s  lossless %s", m, r["tau"],
                 r["tokens_per_s"], r["speedup"], r["overhead_ms"], r["overhead_pct"],
                 "-" if share is None else f"{share:.2f}", r.get("lossless"))
    for m, bases in results.get("gains", {}).get("all", {}).items():
        for base, g in bases.items():
            log.info("%s vs %s: tokens/s %+.1f%% [%s, %s]", m, base, 100 * g["gain"],
                     *("-" if c is None else f"{100 * c:+.1f}%" for c in g["ci"]))
    if run is not None:
        log_to_wandb(run, results, report)
        run.finish()
    print(out)


if __name__ == "__main__":
    main()
