"""Benchmark of the label stage: what one prompt's label costs by brute force and by replay, relative to
one plain autoregressive decode, for K=5 and K=9 candidate block sizes (all from one run).

    python -m pipeline.bench_label                       # ratios
    python -m pipeline.bench_label check=true out=data/bench/label.json
    python -m pipeline.bench_label num_prompts=3 decode.max_new_tokens=32 model.target=... model.drafter=...

Per prompt, interleaved: one AR decode (prefill + B=1 decode), one brute-force label over the union of
the candidate sets (its cost for a K is the prefill plus the decodes of that K's candidates), and one
replay label per K. Prints and writes (``out=PATH``) ``replay_over_ar`` and ``brute_over_ar`` ({K: mean
label cost / mean AR cost}). With ``check=true`` it also reports ``tau_agreement`` (fraction of
(prompt, B) pairs whose replayed per-step taus equal brute force's), ``label_agreement`` (fraction of
prompts with equal ``label_tau``), the first divergence of each disagreeing pair with the top-2 score
gaps there, ``latency_rank_agreement`` (latency model vs measured brute-force tokens/s), and
``output_agreement`` (fraction of (prompt, B) brute-force decodes token-identical to the B=1 decode: 1.0 in
float32; in bfloat16 a verify over B positions may round differently from B single steps, see the README's
numerics section), reported with the target's ``dtype``.
"""

from __future__ import annotations

import json
import logging
import time

import torch
from omegaconf import DictConfig

from pipeline import costs
from pipeline.cli import stage
from pipeline.config_checks import validate_config
from pipeline.decoding.requests import DecodeConfig
from pipeline.models.clock import now
from pipeline.timing.steps import measure
from pipeline.evaluation.report import write_json
from pipeline.labeling.brute import brute_force, reseed
from pipeline.labeling.oracle import (LabelSettings, candidate_window, label_prompt, pick_label, predicted_tokens_per_s,
                                     rank_agreement)
from pipeline.labeling.replay import first_divergence, replay, target_trace
from pipeline.decoding.build import build_decoder
from pipeline.prompts import chat_input_ids, load_prompt_sets
from pipeline.tracking import init_wandb

log = logging.getLogger(__name__)


def bench_label(cfg: DictConfig, decoder=None) -> dict:
    """Run the benchmark described in the module docstring; returns the results dict.

    Raises:
        ValueError: for a bad config (``validate_config``, before the model loads), without a drafter, or when no
            prompt is configured.
    """
    validate_config(cfg, "bench_label")
    torch.manual_seed(int(cfg.seed))
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    decoder = decoder or build_decoder(cfg.model)
    if decoder.drafter is None:
        raise ValueError("bench_label needs a drafter (model.drafter=...)")
    prompts = load_prompt_sets(cfg.data.sets, cfg.data.limit, cfg.data.seed, cfg.data.get("offset", 0))
    prompts = prompts[: cfg.num_prompts] if cfg.get("num_prompts") else prompts
    if not prompts:
        raise ValueError("no prompts: check data.sets / data.limit / num_prompts")
    ks = sorted(int(k) for k in cfg.ks)
    center = int(decoder.drafter.block_size)
    candidates = {k: candidate_window(center, k, decoder.drafter.max_block_size) for k in ks}
    union = sorted({b for c in candidates.values() for b in c})
    config = DecodeConfig(int(cfg.decode.max_new_tokens), float(cfg.decode.temperature), int(cfg.decode.seed))
    settings = {k: LabelSettings(candidates[k], "replay", config.max_new_tokens, config.temperature, config.seed,
                                 1, int(cfg.label.topk), False, str(cfg.label.lm_head)) for k in ks}
    check = bool(cfg.check)

    t0 = time.perf_counter()
    latency = measure(decoder, union, list(cfg.label.latency.context_buckets), int(cfg.label.latency.repeats),
                            config.temperature, int(cfg.seed))  # measured afresh: its time is one of the figures
    latency_s = time.perf_counter() - t0
    tokenizer = decoder.target.tokenizer
    warm = chat_input_ids(tokenizer, prompts[0].turns[:1])
    short = DecodeConfig(min(8, config.max_new_tokens), config.temperature, config.seed)
    decoder.generate(warm, 1, short)
    label_prompt(decoder, warm, LabelSettings(union, "replay", short.max_new_tokens, short.temperature, short.seed),
                 latency)
    brute_force(decoder, decoder.prefill(warm, short), union, short, consume=True)

    ar_ms, brute_ms, replay_ms = [], {k: [] for k in ks}, {k: [] for k in ks}
    pairs_equal = pairs = labels_equal = outputs_equal = 0
    disagreements, predicted, measured, cand_lists, speed_rows = [], [], [], [], []
    new_tokens = []
    for prompt in prompts:
        ids = chat_input_ids(tokenizer, prompt.turns[:1])
        t0 = now(decoder.device)
        ar = decoder.generate(ids, 1, config)
        ar_ms.append((now(decoder.device) - t0) * 1e3)
        new_tokens.append(ar.new_tokens)

        t0 = now(decoder.device)
        prefill = decoder.prefill(ids, config, want_features=True)
        prefill_wall = (now(decoder.device) - t0) * 1e3
        brute = brute_force(decoder, prefill, union, config, consume=True)
        for k in ks:
            brute_ms[k].append(prefill_wall + sum(brute.wall_ms[b] for b in candidates[k]))

        labelled = {}
        for k in ks:
            t0 = now(decoder.device)
            labelled[k] = label_prompt(decoder, ids, settings[k], latency, keep_runs=check)
            replay_ms[k].append((now(decoder.device) - t0) * 1e3)

        if check:
            k = ks[-1]
            trace, replays = labelled[k].runs[0]
            if any(replays[b].taus != brute.stats[b].taus for b in candidates[k]):  # again, untimed, with gaps
                again = reseed(decoder.prefill(ids, config, want_features=True), config, copy_cache=False)
                trace = target_trace(decoder, again, config, record_gaps=True)
                replays = replay(decoder, trace, candidates[k], config, settings[k].lm_head, record_gaps=True)
            for b in candidates[k]:
                pairs += 1
                outputs_equal += brute.stats[b].output_ids == ar.output_ids  # speculative vs autoregressive text
                same = replays[b].taus == brute.stats[b].taus
                pairs_equal += same
                if not same:
                    where = first_divergence(brute.stats[b].taus, replays[b], trace)
                    disagreements.append({"id": prompt.id, "block_size": b, "lossless": brute.stats[b].output_ids == trace.tokens,
                                          **where})
            brute_tau = [brute.stats[b].tau for b in candidates[k]]
            labels_equal += pick_label(candidates[k], brute_tau) == labelled[k].row["label_tau"]
            pred = predicted_tokens_per_s(latency, {b: brute.stats[b] for b in candidates[k]}, config.temperature)
            predicted.append([pred[b] for b in candidates[k]])
            measured.append([s.new_tokens / ((prefill.prefill_ms + s.decode_ms) / 1e3)
                             for s in (brute.stats[b] for b in candidates[k])])
            cand_lists.append(candidates[k])
            speed_rows.append({"id": prompt.id, "candidates": candidates[k], "predicted_tokens_per_s": predicted[-1],
                               "measured_tokens_per_s": measured[-1],
                               "measured_decode_ms": [brute.stats[b].decode_ms for b in candidates[k]],
                               "predicted_decode_ms": [latency.decode_ms(*costs.steps_of(brute.stats[b]), brute.stats[b].new_tokens,
                                                                         config.temperature) for b in candidates[k]]})

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    ar = mean(ar_ms)
    results = {
        "n_prompts": len(prompts),
        "max_new_tokens": config.max_new_tokens,
        "mean_new_tokens": mean(new_tokens),
        "temperature": config.temperature,
        "device": str(decoder.device),
        "forward_path": decoder.forward_path(),  # the backend that ran and whether it is batch-invariant
        "dtype": str(decoder.lm_head.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "candidates": candidates,
        "ar_ms": ar,
        "brute_ms": {k: mean(v) for k, v in brute_ms.items()},
        "replay_ms": {k: mean(v) for k, v in replay_ms.items()},
        "brute_over_ar": {k: mean(v) / ar for k, v in brute_ms.items()},
        "replay_over_ar": {k: mean(v) / ar for k, v in replay_ms.items()},
        "latency_benchmark_s": latency_s,
    }
    if check:
        results["tau_agreement"] = pairs_equal / pairs
        results["output_agreement"] = outputs_equal / pairs
        results["pairs"] = pairs
        results["label_agreement"] = labels_equal / len(prompts)
        results["disagreements"] = disagreements
        results["latency_rank_agreement"] = rank_agreement(predicted, measured, cand_lists)
        results["speed_rows"] = speed_rows
    return results


def report(results: dict) -> str:
    """A short human-readable table of the results."""
    lines = [f"label cost per prompt vs one AR decode ({results['n_prompts']} prompts, "
             f"{results['mean_new_tokens']:.0f} new tokens, AR {results['ar_ms']:.0f} ms, {results['device']}, "
             f"{results['threads']} threads)"]
    for k in results["replay_over_ar"]:
        lines.append(f"  K={k:<2d} replay {results['replay_over_ar'][k]:5.2f}x   brute {results['brute_over_ar'][k]:5.2f}x   "
                     f"candidates {results['candidates'][k]}")
    if "tau_agreement" in results:
        lines.append(f"  tau_agreement {results['tau_agreement']:.3f}  label_agreement {results['label_agreement']:.3f}  "
                     f"disagreements {len(results['disagreements'])}")
        lines.append(f"  {results['dtype']}: speculative output == B=1 output in {results['output_agreement']:.3f} of "
                     f"{results['pairs']} (prompt, B) decodes; replay == brute force in {results['tau_agreement']:.3f}")
        for d in results["disagreements"][:10]:
            lines.append(f"    {d['id']} B={d['block_size']} step {d['step']} brute tau {d['brute_tau']} replay tau "
                         f"{d['replay_tau']} target gap {d['target_gap']} draft gap {d['draft_gap']}")
        r = results["latency_rank_agreement"]
        lines.append(f"  latency model vs measured tokens/s: spearman {r['spearman']:.3f}  kendall {r['kendall']:.3f}  "
                     f"fastest-B agreement {r['best_agreement']:.3f}")
    return "\n".join(lines)


@stage("bench_label")
def main(cfg: DictConfig) -> None:
    run = init_wandb(cfg, job_type="bench-label")
    results = bench_label(cfg)
    print(report(results))
    if cfg.get("out"):
        print(write_json(json.loads(json.dumps(results)), cfg.out))
    if run is not None:
        run.summary.update({f"replay_over_ar/{k}": v for k, v in results["replay_over_ar"].items()})
        run.summary.update({f"brute_over_ar/{k}": v for k, v in results["brute_over_ar"].items()})
        run.finish()


if __name__ == "__main__":
    main()
