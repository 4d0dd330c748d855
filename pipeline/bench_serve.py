"""Benchmark of the real server with a real client (the ``openai`` package), on the embedded default.

    python -m pipeline.bench_serve                                  # starts `python -m pipeline.serve` itself
    python -m pipeline.bench_serve bench.base_url=http://127.0.0.1:8000 bench.max_tokens=64 'bench.concurrency=[1,8]'
    python -m pipeline.bench_serve 'bench.server_args=[serve.max_batch=16,serve.policy=budget]' bench.out=PATH  # batching

Three parts, in order:
1. identity: the first ``data.limit`` prompts of ``data`` (HumanEval by default) as chat completions at
   T=0, streamed and not; each text must equal the eval stage's ``ar`` decode of the same prompt
   (``decode_prompt`` with B=1, run in this process) token for token (``blockpilot.token_ids``), and the
   response must carry the chosen B and tau;
2. load: at every concurrency c of ``bench.concurrency``, ``bench.requests`` streamed requests through c
   client threads (closed loop, or Poisson arrivals at ``bench.rate`` per second): tokens/s (completion tokens / wall
   time), mean tau, latency, TTFT and TPOT percentiles (ms), and ``exact_match``: the share of requests whose token ids
   equal their batch-1 ``ar`` decode (with ``bench.identity``);
3. burst: ``bench.burst`` requests at once; all must complete (the queue holds them).
Writes ``bench.out`` (JSON) and prints a summary. Every wait is bounded (``bench.timeout_s``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess

from omegaconf import DictConfig

from pipeline.cli import stage
from pipeline.evaluation.serving import load_level, one_request, server_stats, start_server

log = logging.getLogger(__name__)


def bench_serve(cfg: DictConfig) -> dict:
    """Run the three parts of the module docstring; returns the results dict.

    Raises:
        AssertionError: when a served text is not token-identical to the eval stage's decode, or a burst request fails.
    """
    from openai import OpenAI

    from pipeline.decoding import DecodeConfig, FixedSchedule
    from pipeline.decoding.conversation import decode_prompt
    from pipeline.decoding.build import build_decoder
    from pipeline.prompts import load_prompt_sets

    b = cfg.bench
    prompts = load_prompt_sets(cfg.data.sets, cfg.data.limit, cfg.data.seed, cfg.data.get("offset", 0))
    texts = [p.turns[0] for p in prompts]
    references, load_references = [], None
    if b.identity:
        decoder = build_decoder(cfg.model)  # the eval stage's `ar` decode, in this process, before any load
        config = DecodeConfig(int(b.max_tokens), 0.0, int(cfg.decode.seed))
        for p in prompts:
            references.append(decode_prompt(decoder, p, lambda: FixedSchedule(1), config)[0].output_ids)
        if int(b.load_max_tokens) == int(b.max_tokens):
            load_references = references
        else:
            load_config = DecodeConfig(int(b.load_max_tokens), 0.0, int(cfg.decode.seed))
            load_references = [decode_prompt(decoder, p, lambda: FixedSchedule(1), load_config)[0].output_ids
                               for p in prompts]
        tokenizer = decoder.target.tokenizer
        del decoder
    proc = None
    url = b.base_url
    if not url:
        proc, url = start_server(cfg)
    try:
        key = os.environ.get("BLOCKPILOT_API_KEY") or "none"  # the server reads the same variable (serve.api_key)
        client = OpenAI(base_url=f"{url}/v1", api_key=key, timeout=float(b.timeout_s), max_retries=0)
        model = client.models.list().data[0].id
        out: dict = {"base_url": url, "model": model, "max_tokens": int(b.max_tokens), "prompts": [p.id for p in prompts]}
        if b.identity:
            rows = []
            for p, text, ref in zip(prompts, texts, references):
                for stream in (False, True):
                    r = one_request(client, model, text, int(b.max_tokens), stream)
                    same = r["info"]["token_ids"] == ref and r["text"] == tokenizer.decode(ref, skip_special_tokens=True)
                    rows.append({"id": p.id, "stream": stream, "identical": same, "block_size": r["info"]["block_size"],
                                 "tau": r["info"]["tau"], "steps": r["info"]["steps"], "tokens": len(ref)})
                    log.info("%s stream=%s: identical %s, B=%d, tau %.2f", p.id, stream, same, r["info"]["block_size"],
                             r["info"]["tau"])
            out["identity"] = rows
            assert all(r["identical"] for r in rows), "served text differs from the eval stage's decode"
        rate = b.get("rate")
        out["server_args"] = list(b.server_args)
        out["load"] = [load_level(client, model, texts, int(b.load_max_tokens), int(c), int(b.requests), float(b.timeout_s),
                                  load_references, float(rate) if rate else None, int(cfg.seed))
                       for c in b.concurrency]
        for level in out["load"]:
            log.info("concurrency %d: %.2f tokens/s, tau %.2f, TPOT p50 %.0f ms, TTFT p50 %.0f ms, latency p50 %.0f ms, "
                     "exact match with batch-1 ar %s", level["concurrency"], level["tokens_per_s"], level["tau"],
                     level["tpot_ms_p50"], level["ttft_ms"]["p50"], level["latency_ms"]["p50"], level["exact_match"])
        if b.burst:
            burst = load_level(client, model, texts, int(b.burst_max_tokens), int(b.burst), int(b.burst), float(b.timeout_s))
            out["burst"] = burst
            log.info("burst of %d concurrent requests: all completed in %.1f s", b.burst, burst["wall_s"])
        out["server"] = server_stats(url, float(b.timeout_s))
        recorder = out["server"].get("recorder")
        if recorder:
            decode_ms = [level["request_ms_mean"] for level in out["load"] if level["concurrency"] == 1]
            log.info("recorder: %d requests recorded, %.0f ms per request after its response (a request at "
                     "concurrency 1 took %s ms)", recorder["recorded"], recorder["record_ms_mean"],
                     f"{decode_ms[0]:.0f}" if decode_ms else "-")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return out


@stage("bench_serve")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = bench_serve(cfg)
    if cfg.bench.out:
        from pipeline.evaluation.report import write_json

        print(write_json(results, cfg.bench.out))
    print(json.dumps({k: v for k, v in results.items() if k != "identity"}, indent=2))


if __name__ == "__main__":
    main()
