"""``eval`` stage: decode a prompt set with several block-size methods and compare them.

    python -m pipeline.evaluate data=humaneval data.limit=20 decode.max_new_tokens=128 \
        decode.block_size=8 eval.methods=[ar,fixed] eval.out=data/eval/humaneval.json
    make eval    # python -m pipeline.evaluate run_name=<run> data=<the label stage's sets> \
                 #   eval.methods=[ar,fixed,best_fixed,blockpilot,ema,oracle]   (+ full_vocab when trained)

Methods (declared once in ``pipeline.policy.registry``, shared with the server; options ``policy.<method>.*``,
``conf/policy/default.yaml``):
  * ``ar`` (B=1) and ``fixed`` (``decode.block_size``, default the drafter's training block size);
  * ``ema``: ``EMASchedule`` over ``model.candidates`` (per-step adaptive baseline);
  * ``best_fixed``: the single candidate B with the best mean label (tau, or tokens/s with
    ``eval.target=speed``) over the train split's requests;
  * ``oracle``: each request's own label B (``label_tau``, or ``label_speed``; every turn of a multi-turn
    prompt is a request with its own label, ``pipeline.prompts.request_id``);
  * ``blockpilot`` / ``full_vocab``: the trained predictors (``eval.predictor_dir/<policy.<m>.predictor>``)
    pick B once from the prefill logits of each request (each turn of a multi-turn prompt); their time is
    part of the request (``schedule_ms``);
  * ``verify_width`` / ``hybrid``: per-step verify widths (``pipeline.policy.verify_width``);
  * ``hf_generate`` / ``hf_prompt_lookup``: transformers' own ``model.generate`` on the same target (greedy at T=0,
    sampled above; plain or with prompt-lookup decoding), timed the same way (``pipeline.policy.baselines``).
``best_fixed`` and ``oracle`` read the label stage's rows (``eval.labels_dir``), the predictor methods
read ``predictor.json`` + ``predictor.safetensors``, and ``eval.split`` (``auto``: ``test`` as soon as one
of those four methods runs, else every configured prompt) takes the split's prompt ids from the dataset
stage's DatasetDict (``eval.features_dir``); the prompts themselves come from ``data``.

Every method decodes every prompt with the same decoder; prompts are interleaved across methods so
machine noise hits all of them alike, and decodes of the same (request, B) are shared between methods
(``eval.share_decodes``, ``pipeline.evaluation.runs``). The configuration and the prompt files are checked
before any model loads. Writes a JSON file with, per method, ``tau`` (mean acceptance
length over all steps, tokens), ``tokens_per_s`` (new tokens over prefill + schedule + decode time),
``speedup`` (vs ``ar`` in this run), ``tpot_ms``, ``lossless`` (the exact-match rate: the fraction of prompts whose
output is token-identical to ``ar``'s, 1.0 = every one; ``exact_matches`` counts them; in float32 it is 1.0, in
bfloat16 it may be lower, see the README's numerics section), ``n_prompts``, ``overhead_ms`` (time choosing B per prompt, ms) and ``overhead_pct`` (its share of
decode time, %), ``oracle_gain_share`` = (tau - tau_fixed) / (tau_oracle - tau_fixed) with a bootstrap
95% interval over prompts ``oracle_gain_share_ci`` (null unless ``fixed`` and ``oracle`` ran, for methods that do
not choose B per request, and the interval for a single prompt), ``provenance`` (run_name, date, git commit), and
per-prompt rows (``chosen_b``: the B picked for the first turn, ``chosen_bs``: for every turn);
``per_set`` repeats the summary per source set. Beside it: ``results.md`` and PNG figures (``pipeline.evaluation.report``), also logged to W&B.

A prompt that does not fit the target's context (prompt + ``decode.max_new_tokens``, any turn) is skipped with a
warning naming it and listed in ``skipped`` (``[{"id", "reason"}]``). ``main`` keeps per-prompt rows in ``rows.jsonl``
beside ``results.json``, one line per finished prompt appended as it finishes; a rerun with the same settings
reuses them and decodes only the prompts not yet there (other settings: the old file is moved to ``rows.jsonl.old``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from pipeline.cli import stage
from pipeline.config_checks import validate_config
from pipeline.evaluation.inputs import (EvalInputs, check_prompts, load_eval_inputs,  # noqa: F401  (the API)
                                        method_schedules, select_prompts)
from pipeline.evaluation.report import log_summary, log_to_wandb, write_json, write_report
from pipeline.evaluation.runs import SharedDecodes, evaluate, merge_turns  # noqa: F401
from pipeline.evaluation.stats import oracle_gain_share, summarize  # noqa: F401
from pipeline.decoding.build import build_decoder
from pipeline.tracking import init_wandb

log = logging.getLogger(__name__)


@stage("evaluate")
def main(cfg: DictConfig) -> None:
    """Validate the config, read the prompts, build the run, write results.json (+ results.md, figures, W&B)."""
    validate_config(cfg, "eval")  # before W&B and before any model loads
    log.info("prompt files checked: %d prompts in the configured sets (data.limit applies next)", check_prompts(cfg))
    run = init_wandb(cfg, job_type="eval")
    decoder = build_decoder(cfg.model)
    inputs = load_eval_inputs(cfg, list(cfg.eval.methods), decoder)
    results = evaluate(cfg, decoder, inputs=inputs, rows_path=Path(cfg.eval.out).with_name("rows.jsonl"))
    out = write_json(results, cfg.eval.out)
    report = {}
    if cfg.eval.get("report", True):
        label_col = "label_tau" if str(cfg.eval.get("target", "tau")) == "tau" else "label_speed"
        report = write_report(results, out.parent, inputs.labels, label_col, table_name=out.with_suffix(".md").name)
    log_summary(results)
    if run is not None:
        log_to_wandb(run, results, report)
        run.finish()
    print(out)


if __name__ == "__main__":
    main()
