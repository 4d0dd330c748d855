"""Benchmark of the real server with a real client (the ``openai`` package), on the embedded default.

    python -m pipeline.bench_serve                                  # starts `python -m pipeline.serve` itself
    python -m pipeline.bench_serve bench.base_url=http://127.0.0.1:8000 bench.max_tokens=64 'bench.concurrency=[1,8]'
    python -m pipeline.bench_serve 'bench.server_args=[serve.max_batch=16,serve.policy=budget]' bench.out=PATH  # batching

Every server of ``bench.servers`` (ours with ``kind: blockpilot`` and its ``args``; vLLM's with ``kind: vllm`` and
its ``options``, ``pipeline.peers.vllm_server.VllmServer``) is started in turn on ``bench.port`` and gets the same
prompts, client and token counts; vLLM's acceptance comes from its ``/metrics`` counters. Three parts, in order:
1. identity: the first ``data.limit`` prompts of ``data`` (HumanEval by default) as chat completions at
   T=0, streamed and not; each text must equal the eval stage's ``ar`` decode of the same prompt
   (``decode_prompt`` with B=1, run in this process on the server's own ``model.*`` args) token for token (``blockpilot.token_ids``), and the
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

from omegaconf import DictConfig, OmegaConf

from pipeline.cli import stage
from pipeline.config_checks import validate_config
from pipeline.evaluation.serving import bench_server, markdown, served

log = logging.getLogger(__name__)


def bench_serve(cfg: DictConfig) -> dict:
    """Run the three parts of the module docstring on every server of ``bench.servers`` (or the one server of
    ``bench.server_args`` / ``bench.base_url``); returns the results dict (``servers``: one entry per server; with a
    single server its ``identity``, ``load``, ``burst`` and ``server`` also at the top level).

    Raises:
        AssertionError: when a served text is not token-identical to the eval stage's decode, or a burst request fails.
        ValueError: for ``bench.base_url`` with more than one server (one running server cannot be several).
    """
    validate_config(cfg, "bench_serve")  # before any model loads
    from pipeline.decoding import DecodeConfig, FixedSchedule
    from pipeline.decoding.build import build_decoder
    from pipeline.decoding.conversation import decode_prompt
    from pipeline.prompts import load_prompt_sets

    b = cfg.bench
    prompts = load_prompt_sets(cfg.data.sets, cfg.data.limit, cfg.data.seed, cfg.data.get("offset", 0))
    servers = [dict(s) for s in (b.get("servers") or [])] or [{"name": "server", "kind": "blockpilot",
                                                               "args": list(b.server_args)}]
    known: dict[str, tuple] = {}  # a server's model config (ours: model.* of its args) -> its `ar` references

    def references_of(spec) -> tuple:
        """(references, load references, tokenizer) of the eval stage's `ar` decode on the server's own model config
        (its ``model.*`` args: a server on other products, e.g. ``model.precision=exact``, is held to its own ``ar``),
        in this process, before the server starts; (None, None, None) without ``bench.identity``."""
        if not b.identity:
            return None, None, None
        args = [str(a) for a in spec.get("args") or []] if spec.get("kind", "blockpilot") == "blockpilot" else []
        model = OmegaConf.merge(cfg.model, OmegaConf.from_dotlist([a[len("model."):] for a in args
                                                                   if a.startswith("model.")]))
        key = OmegaConf.to_yaml(model)
        if key not in known:
            decoder = build_decoder(model)

            def ar(max_tokens: int) -> list[list[int]]:
                config = DecodeConfig(int(max_tokens), 0.0, int(cfg.decode.seed))
                return [decode_prompt(decoder, p, lambda: FixedSchedule(1), config)[0].output_ids for p in prompts]

            references = ar(b.max_tokens)
            load = references if int(b.load_max_tokens) == int(b.max_tokens) else ar(b.load_max_tokens)
            known[key] = (references, load, decoder.target.tokenizer)
            del decoder
        return known[key]

    out: dict = {"max_tokens": int(b.max_tokens), "load_max_tokens": int(b.load_max_tokens),
                 "prompts": [p.id for p in prompts], "servers": {}}
    for spec in servers:
        log.info("bench_serve: server %s (%s)", spec.get("name"), spec)
        references, load_references, tokenizer = references_of(spec)
        if b.base_url:
            entry = bench_server(cfg, spec, str(b.base_url), dict, prompts, references, load_references, tokenizer)
        else:
            with served(spec, cfg) as (url, counters):
                entry = bench_server(cfg, spec, url, counters, prompts, references, load_references, tokenizer)
        out["servers"][str(spec.get("name"))] = entry
    if len(servers) == 1:
        out.update(next(iter(out["servers"].values())))
    return out


@stage("bench_serve")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated benchmark stops the servers it started
    results = bench_serve(cfg)
    table = markdown(results)
    if cfg.bench.out:
        from pathlib import Path

        from pipeline.evaluation.report import write_json

        out = write_json(results, cfg.bench.out)
        Path(out).with_suffix(".md").write_text(table + "\n")
        print(out)
    print(json.dumps({k: v for k, v in results.items() if k not in ("identity", "servers")}, indent=2))
    print(table)


if __name__ == "__main__":
    main()
