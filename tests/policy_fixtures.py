"""Label fixtures for the dataset/train/eval/notebook tests, written directly in the label schema.

Two kinds: synthetic rows with a planted rule (the best block size is a deterministic function of the
prefill entropy), and real rows measured by decoding a few prompts with a tiny target and drafter at
every candidate block size (what the label stage records, at T=0, one repeat).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

TOPK = 24
# the label schema's columns in the label stage's order (``prefill_ms`` is its extra column)
COLUMNS = ["id", "source_set", "prompt_tokens", "candidates", "tau", "new_tokens", "decode_ms", "tokens_per_s", "label_tau",
           "label_speed", "topk_ids", "topk_logprobs", "full_logits", "vocab_size", "entropy", "prefill_ms", "shard",
           "num_shards"]
CONF_COLUMNS = ["conf_block", "conf_column", "conf_p", "conf_ok", "conf_top_p", "conf_rank"]


def label_row(prompt_id: str, source_set: str, logits: torch.Tensor, candidates: list[int], tau: list[float],
              tokens_per_s: list[float], prompt_tokens: int = 10, store_full: bool = True, prefill_ms: float = 1.0) -> dict:
    """One label row (schema of the label stage) from a prefill logits row [V] and the per-candidate measurements."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, -1)
    top = logprobs.topk(min(TOPK, logits.shape[-1]))
    tau_arr, speed = np.asarray(tau, float), np.asarray(tokens_per_s, float)
    return {
        "id": prompt_id, "source_set": source_set, "prompt_tokens": int(prompt_tokens), "candidates": list(candidates),
        "tau": tau_arr.tolist(), "new_tokens": [32.0] * len(candidates), "decode_ms": (32.0 / speed * 1e3).tolist(),
        "tokens_per_s": speed.tolist(),
        "label_tau": int(candidates[int(np.argmax(tau_arr))]),  # argmax: first maximum = smaller B on ties
        "label_speed": int(candidates[int(np.argmax(speed))]),
        "topk_ids": top.indices.tolist(), "topk_logprobs": top.values.tolist(),
        "full_logits": logits.half().numpy().tobytes() if store_full else None,
        "vocab_size": int(logits.shape[-1]), "entropy": float(torch.special.entr(logprobs.exp()).sum()),
        "prefill_ms": float(prefill_ms), "shard": 0, "num_shards": 1,
    }


def write_labels(directory: Path, rows: list[dict], meta: dict, num_shards: int = 2) -> Path:
    """Write ``rows`` as ``shard-XXXXX.parquet`` files plus ``meta.json`` (the label stage's layout)."""
    directory.mkdir(parents=True, exist_ok=True)
    for s in range(num_shards):
        part = [dict(r, shard=s, num_shards=num_shards) for i, r in enumerate(rows) if i % num_shards == s]
        if part:
            extra = [c for c in CONF_COLUMNS if c in part[0]]  # the verify-width samples, when the rows have them
            pd.DataFrame(part)[COLUMNS + extra].to_parquet(directory / f"shard-{s:05d}.parquet")
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def planted_labels(directory: Path, n: int = 480, vocab: int = 320, candidates=(2, 3, 4, 5, 6), seed: int = 0,
                   sets=("code", "math", "chat"), store_full: bool = False) -> tuple[Path, list[float]]:
    """Synthetic rows whose best B is set by the prefill entropy: 5 entropy bins -> the 5 candidates.

    Returns:
        (labels directory, the entropy bin edges [4], nats).
    """
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, generator=g) * 6.0 + 0.05
    logits = torch.randn(n, vocab, generator=g) * scales[:, None]
    entropy = torch.special.entr(torch.softmax(logits, -1)).sum(-1).numpy()
    edges = np.quantile(entropy, [0.2, 0.4, 0.6, 0.8]).tolist()
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        best = int(np.digitize(entropy[i], edges))  # low entropy -> class 0
        tau = 2.0 + 0.3 * rng.random(len(candidates))
        tau[best] += 1.0
        speed = 50.0 + 5 * rng.random(len(candidates))
        speed[len(candidates) - 1 - best] += 20.0
        rows.append(label_row(f"{sets[i % len(sets)]}-{i:04d}", sets[i % len(sets)], logits[i], list(candidates),
                              tau.tolist(), speed.tolist(), prompt_tokens=10 + i % 7, store_full=store_full))
    meta = {"target": "synthetic-target", "drafter": "synthetic-drafter", "training_block_size": 4,
            "candidates": list(candidates), "temperature": 0.0, "repeats": 1, "max_new_tokens": 32, "mode": "measure",
            "topk": TOPK, "store_full_logits": store_full, "latency_model": None}
    return write_labels(directory, rows, meta), edges


PROMPTS = {  # most close to the tiny drafter's training text (drafts accepted, tau(B) rising past B=8), some not
    "code": ["def add(a, b):", "b): return a + b", "a + b Natalia sold clips to", "Write a function that returns the sum of a list.",
             "quick brown fox jumps over the", "0123456789 + - *"],
    "math": ["to 48 of", "sold clips to 48 of her", "friends in April, and then she", "What is 48 + 24 ?",
             "then she sold half as many", "fox jumps over"],
}


def write_prompt_sets(directory: Path) -> list[dict]:
    """Two JSONL prompt sets (``code``, ``math``) of six prompts each; returns the ``data.sets`` config."""
    directory.mkdir(parents=True, exist_ok=True)
    sets = []
    for name, texts in PROMPTS.items():
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": f"{name}-{i}", "turns": [t]}) + "\n" for i, t in enumerate(texts)))
        sets.append({"name": name, "source": str(path)})
    return sets


def measured_labels(directory: Path, decoder, prompt_sets: list[dict], candidates: list[int], max_new_tokens: int,
                    target_name: str, drafter_name: str) -> Path:
    """Label every prompt by decoding it at each candidate B (T=0): what the label stage records, with the replay's
    verify-width samples."""
    from pipeline.decoding import DecodeConfig
    from pipeline.labeling.replay import replay, target_trace
    from pipeline.prompts import chat_input_ids, load_prompt_sets

    cfg = DecodeConfig(max_new_tokens=max_new_tokens)
    rows = []
    for prompt in load_prompt_sets(prompt_sets):
        ids = chat_input_ids(decoder.target.tokenizer, prompt.turns)
        prefill = decoder.prefill(ids, cfg)
        taus, speeds = [], []
        for b in candidates:
            stats = decoder.decode(decoder.prefill(ids, cfg), b, cfg)  # a prefill's cache serves one decode
            taus.append(stats.tau)
            speeds.append(stats.new_tokens / ((stats.prefill_ms + stats.decode_ms) / 1e3))
        row = label_row(prompt.id, prompt.source_set, prefill.last_logits, candidates, taus, speeds,
                        prompt_tokens=ids.shape[1], store_full=True, prefill_ms=prefill.prefill_ms)
        replayed = replay(decoder, target_trace(decoder, decoder.prefill(ids, cfg), cfg), candidates, cfg,
                          record_confidence=True)
        samples = [(b, *sample) for b in candidates for step in replayed[b].confidence for sample in step]
        for name, values in zip(CONF_COLUMNS, zip(*samples) if samples else [[]] * len(CONF_COLUMNS)):
            row[name] = list(values)
        rows.append(row)
    meta = {"target": target_name, "drafter": drafter_name, "training_block_size": decoder.drafter.block_size,
            "candidates": candidates, "temperature": 0.0, "repeats": 1, "max_new_tokens": max_new_tokens, "mode": "measure",
            "topk": TOPK, "store_full_logits": True, "latency_model": None}
    return write_labels(directory, rows, meta)


# -- a whole tiny pipeline run (labels -> dataset -> train -> eval), shared by the test modules ------------
CANDIDATES = [2, 4, 8, 12, 16]  # the trained tiny drafter's training block size (8) included
MAX_NEW_TOKENS = 24
RUN = "tiny"
ALL_METHODS = ["ar", "fixed", "best_fixed", "blockpilot", "full_vocab", "ema", "oracle", "verify_width", "hybrid", "tree", "mixed",
               "hf_generate", "hf_prompt_lookup"]


def tiny_overrides(run: dict) -> list[str]:
    """Hydra overrides that point the eval/dataset/train configs at a tiny run."""
    return [f"paths.data={run['data']}", f"run_name={RUN}", "logger.enabled=false", f"model.target={run['target']}",
            f"model.drafter={run['drafter']}", f"model.candidates={CANDIDATES}", f"decode.max_new_tokens={MAX_NEW_TOKENS}",
            "data=humaneval", "data.seed=null", sets_override(run["sets"]), "eval.warmup=false",
            "model.precision=exact"]


def sets_override(sets: list[dict]) -> str:
    """``data.sets=[{name: ..., source: '...'}, ...]`` in Hydra's override grammar."""
    return "data.sets=[" + ",".join(f"{{name:{s['name']},source:'{s['source']}'}}" for s in sets) + "]"


def build_tiny_run(base: Path, target_dir: str | Path, drafter_dir: str | Path) -> dict:
    """Build (once per ``base``) measured labels of 12 prompts for a tiny target and trained drafter, the topk and
    full_vocab datasets, both predictors and an eval of every method on the test split.

    Returns:
        paths: ``base``, ``data``, ``target``, ``drafter``, ``labels``, ``results`` (results.json), ``sets``.
    """
    marker = base / "run.json"
    if marker.exists():
        return json.loads(marker.read_text())
    from hydra import compose, initialize_config_dir

    from pipeline import PROJECT_ROOT
    from pipeline.policy.data import build_dataset
    from pipeline.evaluate import evaluate, load_eval_inputs, write_json
    from pipeline.decoding.build import build_decoder
    from pipeline.evaluation.report import write_report
    from pipeline.policy.training import train_predictor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a shared CPU
    try:
        base.mkdir(parents=True, exist_ok=True)
        run = {"base": str(base), "data": str(base / "data"), "target": str(target_dir), "drafter": str(drafter_dir),
               "sets": write_prompt_sets(base / "prompts")}
        run["labels"] = str(base / "data" / "labels" / RUN)
        with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
            cfg = compose("evaluate", overrides=tiny_overrides(run) + [f"eval.methods={ALL_METHODS}"])
            decoder = build_decoder(cfg.model)
            measured_labels(Path(run["labels"]), decoder, run["sets"], CANDIDATES, MAX_NEW_TOKENS, run["target"], run["drafter"])
            split = "dataset.fractions={train: 0.34, validation: 0.33, test: 0.33}"
            for features in ("topk", "full_vocab"):
                build_dataset(compose("dataset", overrides=[f"paths.data={run['data']}", f"run_name={RUN}", "logger.enabled=false",
                                                            f"features={features}", split]))
            for predictor in ("mlp", "full_vocab"):
                train_predictor(compose("train", overrides=[f"paths.data={run['data']}", f"run_name={RUN}", "logger.enabled=false",
                                                            f"predictor={predictor}", "trainer=smoke", "train.batch_size=4"]))
            inputs = load_eval_inputs(cfg, ALL_METHODS, decoder)
            results = evaluate(cfg, decoder, inputs=inputs)
        out = write_json(results, base / "data" / "eval" / RUN / "results.json")
        write_report(results, out.parent, inputs.labels)
        run["results"] = str(out)
    finally:
        torch.set_num_threads(threads)
    marker.write_text(json.dumps(run))
    return run


def served_method(name: str, decoder, block_size: int | None = None, options: dict | None = None,
                  predictor_dir: str | None = None, candidates=(2, 4, 8), inputs=None):
    """``serve.policy=name`` built as the server builds it: the one method table (``pipeline.policy.setup``) over a
    minimal config (``model.candidates``, the ``policy`` options); ``inputs`` already loaded are kept."""
    from omegaconf import OmegaConf

    from pipeline.policy import setup

    cfg = OmegaConf.create({"model": {"candidates": list(candidates), "drafter": None}, "policy": options or {}, "seed": 0})
    src = setup.Sources("serve", predictor_dir, block_size=block_size, block_size_key="serve.block_size")
    inputs = setup.load_inputs(cfg, decoder, [name], src, inputs)
    return setup.build_methods(cfg, decoder, inputs, [name], src)[name]
