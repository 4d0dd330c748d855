"""The run loop of the eval stage: every method decodes every prompt with the same decoder, prompts interleaved across
methods so machine noise hits all of them alike (``evaluate``), through ``SharedDecodes``.

With ``eval.share_decodes`` (default on) a request whose method keeps one B for the whole request (``ar``, ``fixed``,
``best_fixed``, ``oracle``, the predictors) runs its own prefill and its own choice of B, both timed, and then reuses the
decode of that (request, B) when an earlier method of the same prompt already ran it: decoding is deterministic given
(request, B, seed), so only the decode's wall time is shared, which also removes timing noise between methods that pick
the same B. ``ema``, the verify widths and transformers' own ``generate`` always decode on their own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from pipeline.decoding import DecodeConfig, FixedSchedule
from pipeline.decoding.conversation import decode_prompt
from pipeline.decoding.schedules import ExternalDecode, Schedule
from pipeline.decoding.requests import RequestStats
from pipeline.decoding.speculative import PromptTooLongError
from pipeline.decoding.trees import step_record
from pipeline.evaluation.checks import check_eval_config
from pipeline.models.clock import now
from pipeline.evaluation.inputs import (EvalInputs, check_prompts, load_eval_inputs, method_schedules, resolve_split,
                                        select_prompts, sources)
from pipeline.evaluation.resume import RowLog, row_settings
from pipeline.evaluation.stats import speed_gains, summarize_all
from pipeline.decoding.build import build_decoder
from pipeline.policy.registry import METHODS, check_methods
from pipeline.prompts import Prompt, set_chat_template_kwargs, skipped_sets, template_kwargs_of

log = logging.getLogger(__name__)


class SharedDecodes:
    """Decoder front end for the eval stage that runs each (request, B) decode once (see the module docstring).

    Quacks like ``SpeculativeDecoder`` for ``decode_prompt`` (``target``, ``generate``). An ``ExternalDecode``
    (transformers' ``generate``, ``pipeline.policy.baselines``) decodes the request itself. For a
    schedule with ``static = True`` (and ``share``) it prefills, times ``schedule.first`` as ``schedule_ms``, and decodes
    with that fixed B, or copies the stored decode of the same (request ids, B, decoding config) with this request's own
    ``prefill_ms`` and ``schedule_ms``. Other schedules go straight to the decoder. ``clear()`` forgets the stored
    decodes (called between prompts to bound memory).

    Args:
        decoder: the ``SpeculativeDecoder``; share: reuse decodes (False: every request decodes on its own).
        watch: a ``pipeline.policy.setup.CostWatch`` given every decode the decoder runs (the run-time check of the
            cost model the verify-width methods read), or None.
    Attributes:
        decodes: decodes actually run; reused: requests served from a stored decode.
    """

    def __init__(self, decoder, share: bool = True, watch=None):
        self.decoder, self.share, self.watch = decoder, bool(share), watch
        self.target = decoder.target
        self.memo: dict[tuple, RequestStats] = {}
        self.decodes = self.reused = 0

    def clear(self) -> None:
        self.memo.clear()

    def generate(self, input_ids: torch.Tensor, schedule: Schedule | ExternalDecode, config: DecodeConfig) -> RequestStats:
        if isinstance(schedule, ExternalDecode):
            self.decodes += 1
            return schedule.run_request(self.decoder, input_ids, config)
        if not (self.share and schedule.static):
            self.decodes += 1
            return self._watched(self.decoder.generate(input_ids, schedule, config))
        prefill = self.decoder.prefill(input_ids, config, want_features=schedule.max_block_size > 1)
        t0 = now(self.decoder.device)
        block_size = int(schedule.first(prefill.last_logits))
        schedule_ms = (now(self.decoder.device) - t0) * 1e3
        key = (tuple(input_ids.flatten().tolist()), block_size, config.max_new_tokens, config.temperature, config.seed)
        stored = self.memo.get(key)
        if stored is None:
            self.decodes += 1
            stored = self.memo[key] = self._watched(self.decoder.decode(prefill, FixedSchedule(block_size), config))
        else:
            self.reused += 1
        return dataclasses.replace(stored, output_ids=list(stored.output_ids), taus=list(stored.taus),
                                   block_sizes=list(stored.block_sizes), prefill_ms=prefill.prefill_ms,
                                   schedule_ms=schedule_ms, first_block_size=block_size)


    def _watched(self, stats: RequestStats) -> RequestStats:
        if self.watch is not None:
            self.watch.request(stats)
        return stats


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
        **({"trees": [step_record(t, p) for s in stats for t, p in s.trees]} if any(s.trees for s in stats) else {}),
        "confidences": [c for s in stats for c in s.confidences],
        "output_ids": [t for s in stats for t in s.output_ids],
        "chosen_b": stats[0].first_block_size if stats else None,  # the first turn's B
        "chosen_bs": [s.first_block_size for s in stats],            # every turn's B (one request per turn)
    }


def verify_width_bound(inputs: EvalInputs, block_size: int, prompt_ids: set[str]) -> dict | None:
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


def _factory(available: dict, method: str, prompt: Prompt):
    return available[method].bind(prompt)


def evaluate(cfg: DictConfig, decoder=None, schedules: dict | None = None, inputs: EvalInputs | None = None,
             rows_path: str | Path | None = None) -> dict:
    """Run the configured methods over the configured prompts and return the results dict (``pipeline.evaluate``).

    Args:
        decoder: a ``SpeculativeDecoder`` (default: built from ``cfg.model``, after the config and prompt files are
            checked).
        schedules: method -> ``pipeline.policy.registry.Factory`` (default: ``method_schedules``).
        inputs: preloaded ``EvalInputs`` (default: ``load_eval_inputs``).
        rows_path: a ``RowLog`` JSONL file: per-prompt rows are appended as each prompt finishes and a rerun
            resumes from it (``main`` passes ``rows.jsonl`` beside ``eval.out``); None keeps them in memory only.
    Raises:
        ValueError: for a bad config (``check_eval_config``) or prompt file, both before any model loads, or an unknown
            method; FileNotFoundError: for a missing prompt, label, dataset or predictor file.
    """
    if schedules is None:
        check_eval_config(cfg)
    if decoder is None:
        check_prompts(cfg)  # before the model loads (main checks them itself before W&B)
    torch.manual_seed(cfg.seed)
    decoder = decoder or build_decoder(cfg.model)
    set_chat_template_kwargs(decoder.target.tokenizer, template_kwargs_of(cfg.model))
    methods = list(cfg.eval.methods)
    inputs = inputs if inputs is not None else load_eval_inputs(cfg, methods, decoder)
    if "ar" not in methods:
        methods = ["ar"] + methods  # speedup and losslessness are measured against ar in the same run
    if schedules is None:
        check_methods(methods, "eval")
        available = method_schedules(cfg, decoder, inputs, methods)
    else:
        available = schedules
        unknown = [m for m in methods if m not in available]
        if unknown:
            raise ValueError(f"unknown eval.methods {unknown}; available: {sorted(available)}")
    split = resolve_split(cfg, methods)
    prompts = select_prompts(cfg, split, inputs)
    decode_cfg = DecodeConfig(cfg.decode.max_new_tokens, cfg.decode.temperature, cfg.decode.seed)
    row_log = RowLog(rows_path, row_settings(cfg, methods, split, inputs, decoder))
    from pipeline.policy.setup import CostWatch

    watch = CostWatch(cfg, decoder, inputs, sources(cfg))
    runner = SharedDecodes(decoder, bool(cfg.eval.get("share_decodes", True)), watch)

    todo = [p for p in prompts if p.id not in row_log.done]
    if cfg.eval.warmup:
        warm = SharedDecodes(decoder, share=False)
        for prompt in todo:  # the first prompt that fits the context
            try:
                for m in methods:
                    decode_prompt(warm, prompt, _factory(available, m, prompt),
                                  DecodeConfig(8, decode_cfg.temperature, decode_cfg.seed))
                break
            except PromptTooLongError:
                continue
    for prompt in tqdm(todo, desc="eval", unit="prompt"):
        runner.clear()
        prompt_rows = {}
        try:
            for m in methods:
                stats = decode_prompt(runner, prompt, _factory(available, m, prompt), decode_cfg)
                row = merge_turns(prompt.id, prompt.source_set, stats)
                prompt_rows[m] = row
        except PromptTooLongError as err:
            log.warning("skipping prompt %r: %s", prompt.id, err)
            row_log.append({"id": prompt.id, "skipped": str(err)})
            continue
        row_log.append({"id": prompt.id, "rows": prompt_rows})
    for m in methods:  # peers that run a server of their own (vLLM) stop it
        if not available[m].per_request and isinstance(made := available[m](), ExternalDecode):
            made.close()
    return collect_results(cfg, methods, prompts, row_log, runner, inputs, decoder, split)


def collect_results(cfg: DictConfig, methods: list[str], prompts: list[Prompt], row_log: RowLog, runner: SharedDecodes,
                    inputs: EvalInputs, decoder, split: str | None) -> dict:
    """The results dict of a finished run from its row log (see ``pipeline.evaluate`` for the keys)."""
    from pipeline.evaluation.report import provenance

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
    log.info("decodes run: %d, shared by methods picking the same B: %d", runner.decodes, runner.reused)

    def shares(m: str) -> bool:  # the oracle gain share means something for a per-request choice of B only
        return METHODS[m].gain_share if m in METHODS else True

    results = {"config": OmegaConf.to_container(cfg.decode, resolve=True), "split": split,
               "shared_decodes": runner.reused, "provenance": provenance(cfg),
               "skipped": skipped, "skipped_sets": skipped_sets(str(s.name) for s in cfg.data.sets),
               "methods": summarize_all(rows, methods, reference, boot, shares), "per_set": {},
               "forward_path": decoder.forward_path()}  # the backend that ran and whether it is batch-invariant
    for source_set in sorted({r["source_set"] for r in rows["ar"]}):
        subset = {m: [r for r in rows[m] if r["source_set"] == source_set] for m in methods}
        results["per_set"][source_set] = summarize_all(subset, methods, reference, boot, shares)
    for m in methods:
        results["methods"][m]["rows"] = [{k: v for k, v in r.items() if k != "output_ids"} for r in rows[m]]
    results["gains"] = {"all": speed_gains(results), **{s: speed_gains(results, s) for s in results["per_set"]}}
    if inputs.calibration is not None:
        stored = json.loads(Path(inputs.calibration_path).read_text()) if inputs.calibration_path else {}
        from pipeline.policy.setup import drafted_block_size

        block_size = drafted_block_size(cfg, decoder, sources(cfg))
        results["verify_width"] = {"calibration": inputs.calibration_path, "block_size": block_size,
                                   "calibration_info": inputs.calibration.info,
                                   "reliability": stored.get("reliability"), "reliability_split": stored.get("reliability_split"),
                                   "latency_model": inputs.latency.to_dict() if inputs.latency is not None else None}
        bound = verify_width_bound(inputs, block_size, {r["id"] for r in rows["ar"]})
        if bound is not None:
            results["verify_width"]["bound"] = bound
            log.info("verify-width foresight bound at B=%d (latency model, %d requests): %.2fx ar (drafting every step: "
                     "%.2fx; fixed %.2fx)", bound["block_size"], bound["all"]["requests"], bound["all"]["foresight"],
                     bound["all"]["foresight_drafting"], bound["all"]["fixed"])
    if inputs.predictors:
        results["predictors"] = {m: {k: p.meta.get(k) for k in ("arch", "num_parameters", "features", "candidates", "inference_ms", "fallback")}
                                 for m, p in inputs.predictors.items()}
    return results
