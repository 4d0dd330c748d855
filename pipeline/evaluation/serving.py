"""The real server under load, through the ``openai`` client: start it, send chat completions (streamed or not,
closed loop or Poisson arrivals), and the figures of a load level (``pipeline.bench_serve``'s library).
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import DictConfig

from pipeline.evaluation.batched import percentile

log = logging.getLogger(__name__)


def start_server(cfg: DictConfig) -> tuple[subprocess.Popen, str]:
    """``python -m pipeline.serve`` on 127.0.0.1:``bench.port`` with ``bench.server_args``; waits for ``/health``.

    Raises:
        RuntimeError: when the server exits or is not up within ``bench.startup_s``.
    """
    import httpx

    port = int(cfg.bench.port)
    args = [sys.executable, "-m", "pipeline.serve", "serve.host=127.0.0.1", f"serve.port={port}", *cfg.bench.server_args]
    log.info("starting %s", " ".join(args))
    proc = subprocess.Popen(args, cwd=str(Path(__file__).resolve().parents[2]))
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
               timeout_s: float, references: list[list[int]] | None = None, rate: float | None = None,
               seed: int = 0) -> dict:
    """``requests`` streamed requests (prompts cycled) through ``concurrency`` client threads; throughput and percentiles.

    Args:
        references: per text, its batch-1 ``ar`` token ids at ``max_tokens`` (``exact_match`` is then the share of
            requests whose served token ids equal them; None: not reported).
        rate: None: closed loop (each thread sends its next request when the last one ends); else open loop: requests
            arrive at Poisson times of ``rate`` per second (seeded), at most ``concurrency`` in flight.
    Returns:
        tokens_per_s (completion tokens / wall s), tau, latency / TTFT percentiles (ms), TPOT p50/p99 (ms per token
        after the first), exact_match, and the run's sizes.
    """
    import random

    jobs = [texts[i % len(texts)] for i in range(requests)]
    arrivals = [0.0] * requests
    if rate:
        rng, t = random.Random(seed), 0.0
        for i in range(requests):
            arrivals[i] = t
            t += rng.expovariate(float(rate))
    t0 = time.perf_counter()

    def send(i: int) -> dict:
        wait = t0 + arrivals[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return one_request(client, model, jobs[i], max_tokens, True)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(send, i) for i in range(requests)]
        results = [f.result(timeout=timeout_s) for f in futures]
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    steps = sum(r["info"]["steps"] for r in results)
    accepted = sum(r["info"]["tau"] * r["info"]["steps"] for r in results)
    lat = [r["latency_ms"] for r in results]
    ttft = [r["ttft_ms"] for r in results]
    tpot = [(r["latency_ms"] - r["ttft_ms"]) / max(1, r["completion_tokens"] - 1) for r in results]
    exact = None
    if references is not None:
        exact = sum(r["info"]["token_ids"] == references[i % len(texts)] for i, r in enumerate(results)) / len(results)
    return {"concurrency": concurrency, "requests": requests, "completion_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "tau": accepted / steps if steps else 0.0,
            "block_sizes": sorted({r["info"]["block_size"] for r in results}),
            "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99)},
            "ttft_ms": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p99": percentile(ttft, 99)},
            "request_ms_mean": statistics.fmean(r["info"]["prefill_ms"] + r["info"]["schedule_ms"] + r["info"]["decode_ms"]
                                                for r in results),
            "tpot_ms_mean": statistics.fmean(tpot), "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99),
            "ttft_ms_p99": percentile(ttft, 99), "arrivals": "closed" if not rate else f"poisson {rate}/s",
            "exact_match": exact}


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
