"""Batched decoding benchmark (prints figures; not a test).

    python -m pipeline.bench_batch out=data/bench/batch.json            # embedded default, HumanEval (16 prompts)
    python -m pipeline.bench_batch out=PATH 'bench.concurrency=[1,8]' 'bench.methods=[ar,budget]' bench.rate=4
    python -m pipeline.bench_batch out=PATH bench.split=test run_name=<make-all run> data=mix   # held-out prompts

For the configured target and drafter, the prompts (``data``, ``bench.split``) are first decoded one at a time with
batch-1 ``ar`` (B = 1): that is every request's reference text and ``batch1_ar_tokens_per_s``. Then, for every arrival
pattern of ``bench.arrivals`` (``burst``: every request arrives at once; ``poisson``: arrivals at ``bench.rate`` per
second), every concurrency c (at most c requests decode together; the rest queue and join at a step boundary after their
prefill) and every method of ``bench.methods`` (built by the one method table, ``pipeline.policy.setup``, as the eval
stage and the server build them: ``ar``, ``fixed``, ``verify_width``, ``budget``, ...), the workload is decoded with
``pipeline.decoding.scheduler.decode_all`` (the server's scheduler). Per run:

- ``tokens_per_s``: all requests' new tokens / wall time from the first arrival to the last token;
  ``tokens_per_s_ci``: a percentile bootstrap 95% interval, resampling the run's batched steps and prefills (each a
  (ms, tokens) unit) and scaling their throughput by the run's busy share of the wall time;
- ``tpot_ms_p50``/``_p99``: per request (last token time - first token time) / (new tokens - 1), over requests (ms);
- ``ttft_ms_p50``/``_p99``: first token time - arrival time (queueing and prefill included, ms);
- ``exact_match``: the share of requests whose text equals their batch-1 ``ar`` text; ``tau``, ``mean_batch``.

With ``bench.labels_dir`` (a label run with replay samples at B), ``foresight`` holds the modelled batched foresight
bound (``pipeline.policy.budget.batched_foresight_bound``: speedups over batched ``ar`` of ``fixed`` and of widths
chosen with foresight, per concurrency, on the same cost model): how much of the reachable gain ``budget`` takes.

The JSON has ``batch1_ar_tokens_per_s``, ``by_concurrency["<c>"]["<method>"]`` for the first arrival pattern (burst by
default) and ``by_arrivals["<pattern>"]`` for each; a Markdown table is written beside it, and a W&B run logs the
figures. ``verify_width`` reads the batch-1 cost model (``policy.verify_width.latency``); the batched cost model that
``budget`` reads is measured once per machine (``pipeline.timing.batched.batch_costs_of``, cached after a spot check)
from ``policy.budget.costs.*``, and the calibration and skip rule are ``policy.verify_width``'s
(``conf/policy/default.yaml``): the settings the server's ``serve.policy=budget`` reads, so both build the same
``BudgetPolicy``. Timings need a quiet machine: other processes on the cores inflate every figure.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from pipeline.cli import stage
from pipeline.config_checks import validate_config
from pipeline.evaluation.batched import FIELDS, bench_batch, markdown

log = logging.getLogger(__name__)


@stage("bench_batch")
def main(cfg: DictConfig) -> None:
    validate_config(cfg, "bench_batch")
    from pipeline.tracking import init_wandb

    run = init_wandb(cfg, job_type="bench_batch")
    result = bench_batch(cfg)
    table = markdown(result)
    print(table)
    if cfg.out:
        from pipeline.evaluation.report import write_json

        out = write_json(result, Path(cfg.out))
        out.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {out}")
    if run is not None:
        summary = {"batch1_ar_tokens_per_s": result["batch1_ar_tokens_per_s"]}
        for pattern, per_c in result["by_arrivals"].items():
            for c, per_m in per_c.items():
                for method, f in per_m.items():
                    for key in ("tokens_per_s", "speedup_vs_batch1_ar", "tpot_ms_p50", "ttft_ms_p50", "exact_match"):
                        summary[f"{pattern}/c{c}/{method}/{key}"] = f[key]
        run.summary.update(summary)
        import wandb

        wandb.log({"bench_batch": wandb.Table(columns=["arrivals", "concurrency", "method", *FIELDS[:1], "exact_match"],
                                              data=[[p, int(c), m, f["tokens_per_s"], f["exact_match"]]
                                                    for p, per_c in result["by_arrivals"].items()
                                                    for c, per_m in per_c.items() for m, f in per_m.items()])})
        run.finish()


if __name__ == "__main__":
    main()
