"""``eval`` stage: decode a prompt set with several block-size methods and compare them.

    python -m pipeline.evaluate data=humaneval data.limit=20 decode.max_new_tokens=128 \
        decode.block_size=8 eval.methods=[ar,fixed] eval.out=data/eval/humaneval.json

Methods: ``ar`` (B=1) and ``fixed`` (``decode.block_size``, default the training block size).
Every method decodes every prompt with the same decoder; prompts are interleaved across methods so
machine noise hits all of them alike. Writes a JSON file with, per method, ``tau`` (mean acceptance
length over all steps, tokens), ``tokens_per_s`` (new tokens over prefill + decode time),
``speedup`` (vs ``ar`` in this run), ``tpot_ms``, ``lossless`` (every output token-identical to ``ar``),
``n_prompts`` and per-prompt rows.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from pipeline.decoding import DecodeConfig, FixedSchedule
from pipeline.decoding.conversation import decode_prompt
from pipeline.models.loading import build_decoder
from pipeline.prompts import load_prompt_sets
from pipeline.tracking import init_wandb

log = logging.getLogger(__name__)


def method_schedules(cfg: DictConfig, decoder) -> dict[str, Callable[[], object]]:
    """Schedule factories for the basic methods ``ar`` and ``fixed``."""
    trained_b = decoder.drafter.block_size if decoder.drafter is not None else 1
    fixed_b = int(cfg.decode.block_size or trained_b)
    return {"ar": lambda: FixedSchedule(1), "fixed": lambda: FixedSchedule(fixed_b)}


def summarize(rows: list[dict], reference: dict[str, list[int]] | None) -> dict:
    """Aggregate per-prompt rows of one method (see the module docstring for the keys)."""
    steps = sum(r["steps"] for r in rows)
    accepted = sum(r["tau"] * r["steps"] for r in rows)
    new_tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["prefill_ms"] + r["schedule_ms"] + r["decode_ms"] for r in rows) / 1e3
    decode_ms = sum(r["decode_ms"] for r in rows)
    out = {
        "n_prompts": len(rows),
        "tau": accepted / steps if steps else 0.0,
        "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / seconds if seconds else 0.0,
        "tpot_ms": decode_ms / max(1, new_tokens - len(rows)),
        "decode_ms": decode_ms,
        "schedule_ms": sum(r["schedule_ms"] for r in rows),
    }
    if reference is not None:
        out["lossless"] = all(r["output_ids"] == reference[r["id"]] for r in rows)
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
        "output_ids": [t for s in stats for t in s.output_ids],
    }


def evaluate(cfg: DictConfig, decoder=None, schedules: dict | None = None) -> dict:
    """Run the configured methods over the configured prompts and return the results dict."""
    torch.manual_seed(cfg.seed)
    decoder = decoder or build_decoder(cfg.model)
    prompts = load_prompt_sets(cfg.data.sets, cfg.data.limit, cfg.data.seed)
    available = schedules or method_schedules(cfg, decoder)
    methods = list(cfg.eval.methods)
    unknown = [m for m in methods if m not in available]
    if unknown:
        raise ValueError(f"unknown eval.methods {unknown}; available: {sorted(available)}")
    if "ar" not in methods:
        methods = ["ar"] + methods  # speedup and losslessness are measured against ar in the same run
    decode_cfg = DecodeConfig(cfg.decode.max_new_tokens, cfg.decode.temperature, cfg.decode.seed)
    if cfg.eval.warmup and prompts:
        for m in methods:
            decode_prompt(decoder, prompts[0], available[m], DecodeConfig(8, decode_cfg.temperature, decode_cfg.seed))
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    for prompt in tqdm(prompts, desc="eval", unit="prompt"):
        for m in methods:
            stats = decode_prompt(decoder, prompt, available[m], decode_cfg)
            rows[m].append(merge_turns(prompt.id, prompt.source_set, stats))
    reference = {r["id"]: r["output_ids"] for r in rows["ar"]}
    results = {"config": OmegaConf.to_container(cfg.decode, resolve=True), "methods": {}}
    for m in methods:
        results["methods"][m] = summarize(rows[m], reference)
    ar_speed = results["methods"]["ar"]["tokens_per_s"]
    for m in methods:
        results["methods"][m]["speedup"] = results["methods"][m]["tokens_per_s"] / ar_speed if ar_speed else 0.0
        results["methods"][m]["rows"] = [{k: v for k, v in r.items() if k != "output_ids"} for r in rows[m]]
    return results


def write_json(results: dict, out: str | Path) -> Path:
    """Write ``results`` atomically at ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, out)
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    run = init_wandb(cfg, job_type="eval")
    results = evaluate(cfg)
    out = write_json(results, cfg.eval.out)
    for m, r in results["methods"].items():
        log.info("%-10s tau %.2f  tok/s %.2f  speedup %.2fx  lossless %s", m, r["tau"], r["tokens_per_s"], r["speedup"], r.get("lossless"))
        if run is not None:
            run.summary.update({f"{m}/{k}": v for k, v in r.items() if isinstance(v, (int, float, bool))})
    if run is not None:
        run.finish()
    print(out)


if __name__ == "__main__":
    main()
