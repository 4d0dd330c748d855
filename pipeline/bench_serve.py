"""Benchmark of the real server with a real client (the ``openai`` package), on the embedded default.

    python -m pipeline.bench_serve                                  # starts `python -m pipeline.serve` itself
    python -m pipeline.bench_serve bench.base_url=http://127.0.0.1:8000 bench.max_tokens=64 'bench.concurrency=[1,8]'

Three parts, in order:
1. identity: the first ``data.limit`` prompts of ``data`` (HumanEval by default) as chat completions at
   T=0, streamed and not; each text must equal the eval stage's ``ar`` decode of the same prompt
   (``decode_prompt`` with B=1, run in this process) token for token (``blockpilot.token_ids``), and the
   response must carry the chosen B and tau;
2. load: at every concurrency c of ``bench.concurrency``, ``bench.requests`` streamed requests through c
   client threads: tokens/s (completion tokens / wall time), mean tau, latency and TTFT percentiles (ms);
3. burst: ``bench.burst`` requests at once; all must complete (the queue holds them).
Writes ``bench.out`` (JSON) and prints a summary. Every wait is bounded (``bench.timeout_s``).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hydra
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def start_server(cfg: DictConfig) -> tuple[subprocess.Popen, str]:
    """``python -m pipeline.serve`` on 127.0.0.1:``bench.port`` with ``bench.server_args``; waits for ``/health``.

    Raises:
        RuntimeError: when the server exits or is not up within ``bench.startup_s``.
    """
    import httpx

    port = int(cfg.bench.port)
    args = [sys.executable, "-m", "pipeline.serve", "serve.host=127.0.0.1", f"serve.port={port}", *cfg.bench.server_args]
    log.info("starting %s", " ".join(args))
    proc = subprocess.Popen(args, cwd=str(Path(__file__).resolve().parents[1]))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + float(cfg.bench.startup_s)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError(f"the server was not up within {cfg.bench.startup_s} s")


def one_request(client, model: str, text: str, max_tokens: int, stream: bool) -> dict:
    """One chat completion at T=0; returns text, token ids, the blockpilot extension, latency and TTFT (ms)."""
    t0 = time.perf_counter()
    body = dict(model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
                extra_body={"return_token_ids": True})
    if not stream:
        response = client.chat.completions.create(**body)
        info = response.model_extra["blockpilot"]
        latency = (time.perf_counter() - t0) * 1e3
        return {"text": response.choices[0].message.content, "info": info, "latency_ms": latency, "ttft_ms": latency,
                "completion_tokens": response.usage.completion_tokens}
    parts, ttft, info, usage = [], None, None, None
    for chunk in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
            parts.append(chunk.choices[0].delta.content)
        extra = chunk.model_extra or {}
        if "blockpilot" in extra:
            info = extra["blockpilot"]
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    latency = (time.perf_counter() - t0) * 1e3
    return {"text": "".join(parts), "info": info, "latency_ms": latency, "ttft_ms": ttft or latency,
            "completion_tokens": usage if usage is not None else len(info["token_ids"])}


def load_level(client, model: str, texts: list[str], max_tokens: int, concurrency: int, requests: int,
               timeout_s: float) -> dict:
    """``requests`` streamed requests (prompts cycled) through ``concurrency`` threads; throughput and percentiles."""
    jobs = [texts[i % len(texts)] for i in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(one_request, client, model, t, max_tokens, True) for t in jobs]
        results = [f.result(timeout=timeout_s) for f in futures]
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    steps = sum(r["info"]["steps"] for r in results)
    accepted = sum(r["info"]["tau"] * r["info"]["steps"] for r in results)
    lat = [r["latency_ms"] for r in results]
    ttft = [r["ttft_ms"] for r in results]
    return {"concurrency": concurrency, "requests": requests, "completion_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "tau": accepted / steps if steps else 0.0,
            "block_sizes": sorted({r["info"]["block_size"] for r in results}),
            "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99)},
            "ttft_ms": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p99": percentile(ttft, 99)},
            "request_ms_mean": statistics.fmean(r["info"]["prefill_ms"] + r["info"]["schedule_ms"] + r["info"]["decode_ms"]
                                                for r in results),
            "tpot_ms_mean": statistics.fmean((r["latency_ms"] - r["ttft_ms"]) / max(1, r["completion_tokens"] - 1)
                                             for r in results)}


def server_stats(url: str, timeout_s: float) -> dict:
    """The server's ``/health`` once its queue is empty and, with a recorder, every served request is recorded or skipped
    (polled at most ``timeout_s``)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        recorder = health.get("recorder")
        done = health["in_flight"] == 0 and (not recorder or recorder["recorded"] + recorder["skipped"] >= health["served"])
        if done or time.monotonic() > deadline:
            return health
        time.sleep(1)


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
    references = []
    if b.identity:
        decoder = build_decoder(cfg.model)  # the eval stage's `ar` decode, in this process, before any load
        config = DecodeConfig(int(b.max_tokens), 0.0, int(cfg.decode.seed))
        for p in prompts:
            references.append(decode_prompt(decoder, p, lambda: FixedSchedule(1), config)[0].output_ids)
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
        out["load"] = [load_level(client, model, texts, int(b.load_max_tokens), int(c), int(b.requests), float(b.timeout_s))
                       for c in b.concurrency]
        for level in out["load"]:
            log.info("concurrency %d: %.2f tokens/s, tau %.2f, latency p50 %.0f ms p90 %.0f ms, TTFT p50 %.0f ms",
                     level["concurrency"], level["tokens_per_s"], level["tau"], level["latency_ms"]["p50"],
                     level["latency_ms"]["p90"], level["ttft_ms"]["p50"])
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


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_serve")
def main(cfg: DictConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = bench_serve(cfg)
    if cfg.bench.out:
        from pipeline.evaluation.report import write_json

        print(write_json(results, cfg.bench.out))
    print(json.dumps({k: v for k, v in results.items() if k != "identity"}, indent=2))


if __name__ == "__main__":
    main()
