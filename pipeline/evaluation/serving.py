"""A real server under load, through the ``openai`` client: start ours or vLLM's, send chat completions (streamed or
not, closed loop or Poisson arrivals), and the figures of a load level (``pipeline.bench_serve``'s library).

``served(spec, cfg)`` starts one server of ``bench.servers`` (``kind: blockpilot``: ``python -m pipeline.serve``
with its ``args``; ``kind: vllm``: vLLM's OpenAI server through ``pipeline.peers.vllm_server.VllmServer`` with
its ``options``) and stops it afterwards; every server gets the same prompts, client and token counts.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def served(spec, cfg: DictConfig):
    """A server of ``bench.servers`` (``{name, kind, args | options}``) up on 127.0.0.1:``bench.port``; yields
    ``(url, stop counters)``: its base URL and a function returning vLLM's speculative-decoding counters (``/metrics``;
    ``{}`` for ours). Stops it afterwards.

    Raises:
        ValueError: for an unknown ``kind``.
        RuntimeError: when the server exits or is not up within ``bench.startup_s``.
    """
    kind = str(spec.get("kind", "blockpilot"))
    if kind == "blockpilot":
        proc, url = start_server(cfg, list(spec.get("args") or []))
        try:
            yield url, dict
        finally:
            stop_server(proc)
    elif kind == "vllm":
        from pipeline.peers.vllm_server import VllmServer

        options = dict(spec.get("options") or {})
        with VllmServer(port=int(cfg.bench.port), startup_timeout_s=float(cfg.bench.startup_s), **options) as server:
            yield server.url, server.spec_decode_counters
    else:
        raise ValueError(f"bench.servers entry {spec.get('name')!r}: kind must be blockpilot or vllm, got {kind!r}")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server ``start_server`` started (SIGTERM, then SIGKILL after 30 s)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_server(cfg: DictConfig, server_args: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """``python -m pipeline.serve`` on 127.0.0.1:``bench.port`` with ``server_args`` (default ``bench.server_args``);
    waits for ``/health``.

    Raises:
        RuntimeError: when the server exits or is not up within ``bench.startup_s``.
    """
    import httpx

    port = int(cfg.bench.port)
    extra = list(cfg.bench.server_args) if server_args is None else list(server_args)
    args = [sys.executable, "-m", "pipeline.serve", "serve.host=127.0.0.1", f"serve.port={port}", *extra]
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
    """One chat completion at T=0 on our server or vLLM's; returns the text, the output token ids (``return_token_ids``:
    our ``blockpilot.token_ids``, vLLM's ``choices[0].token_ids``), tau and steps where the server reports them (our
    ``blockpilot`` extension; vLLM's per-request ``metrics.speculative_decoding``, else None), latency and TTFT (ms)."""
    t0 = time.perf_counter()
    body = dict(model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
                extra_body={"return_token_ids": True})
    if not stream:
        response = client.chat.completions.create(**body)
        latency = (time.perf_counter() - t0) * 1e3
        choice = response.choices[0]
        return _figures(choice.message.content, [response.model_extra or {}], [choice.model_extra or {}], latency,
                        latency, response.usage.completion_tokens)
    parts, ttft, usage, extras, choice_extras = [], None, None, [], []
    for chunk in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = (time.perf_counter() - t0) * 1e3
            parts.append(chunk.choices[0].delta.content)
        extras.append(chunk.model_extra or {})
        if chunk.choices:
            choice_extras.append(chunk.choices[0].model_extra or {})
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    latency = (time.perf_counter() - t0) * 1e3
    return _figures("".join(parts), extras, choice_extras, latency, ttft or latency, usage)


def _figures(text: str, extras: list[dict], choice_extras: list[dict], latency_ms: float, ttft_ms: float,
             completion_tokens: int | None) -> dict:
    """``one_request``'s row from a response's (or its chunks') extension fields."""
    info = next((e["blockpilot"] for e in reversed(extras) if e.get("blockpilot")), None)
    metrics = next(((e.get("metrics") or {}).get("speculative_decoding") for e in reversed(extras)
                    if (e.get("metrics") or {}).get("speculative_decoding")), None)
    if info is not None:
        token_ids, tau, steps = info.get("token_ids"), info["tau"], info["steps"]
    else:
        pieces = [c.get("token_ids") for c in choice_extras if c.get("token_ids") is not None]
        token_ids = [t for piece in pieces for t in piece] if pieces else None
        steps = int(metrics.get("num_spec_steps") or 0) if metrics else None
        tau = float(metrics.get("mean_acceptance_length") or 0.0) if metrics else None
    if completion_tokens is None:
        completion_tokens = len(token_ids or [])
    return {"text": text, "token_ids": token_ids, "tau": tau, "steps": steps, "info": info, "spec": metrics,
            "latency_ms": latency_ms, "ttft_ms": ttft_ms, "completion_tokens": completion_tokens}


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
    with_steps = [r for r in results if r["steps"] is not None]
    steps = sum(r["steps"] for r in with_steps)
    accepted = sum(r["tau"] * r["steps"] for r in with_steps)
    lat = [r["latency_ms"] for r in results]
    ttft = [r["ttft_ms"] for r in results]
    tpot = [(r["latency_ms"] - r["ttft_ms"]) / max(1, r["completion_tokens"] - 1) for r in results]
    exact = None
    if references is not None:
        exact = sum(r["token_ids"] == references[i % len(texts)] for i, r in enumerate(results)) / len(results)
    ours = [r["info"] for r in results if r["info"] is not None]
    return {"concurrency": concurrency, "requests": requests, "completion_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "tau": accepted / steps if steps else None,
            "block_sizes": sorted({i["block_size"] for i in ours}),
            "latency_ms": {"p50": percentile(lat, 50), "p90": percentile(lat, 90), "p99": percentile(lat, 99)},
            "ttft_ms": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p99": percentile(ttft, 99)},
            "request_ms_mean": statistics.fmean(i["prefill_ms"] + i["schedule_ms"] + i["decode_ms"] for i in ours)
                               if ours else None,
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


WARMUP_PROMPT = "Name three colours of the rainbow."
"""The warm-up request of ``bench.warmup_requests``: outside every prompt set."""


def bench_server(cfg: DictConfig, spec, url: str, counters, prompts, references, load_references, tokenizer) -> dict:
    """``pipeline.bench_serve``'s three parts on one running server at ``url`` (``counters``: its speculative-decoding
    counters, see ``served``).

    Raises:
        AssertionError: when a served text is not token-identical to the eval stage's decode, or a burst request fails.
    """
    import os

    from openai import OpenAI

    b = cfg.bench
    texts = [p.turns[0] for p in prompts]
    key = os.environ.get("BLOCKPILOT_API_KEY") or "none"  # our server reads the same variable (serve.api_key)
    client = OpenAI(base_url=f"{url}/v1", api_key=key, timeout=float(b.timeout_s), max_retries=0)
    model = client.models.list().data[0].id
    out: dict = {"base_url": url, "model": model, "kind": str(spec.get("kind", "blockpilot")),
                 "args": list(spec.get("args") or []), "options": dict(spec.get("options") or {})}
    if references is not None and b.get("identity_requests", True):
        rows = []
        for p, text, ref in zip(prompts, texts, references):
            for stream in (False, True):
                r = one_request(client, model, text, int(b.max_tokens), stream)
                same = r["token_ids"] == ref and r["text"] == tokenizer.decode(ref, skip_special_tokens=True)
                rows.append({"id": p.id, "stream": stream, "identical": same, "tau": r["tau"], "steps": r["steps"],
                             "block_size": (r["info"] or {}).get("block_size"), "tokens": len(ref)})
                log.info("%s %s stream=%s: identical %s, tau %s", spec.get("name"), p.id, stream, same, r["tau"])
        out["identity"] = rows
        assert all(r["identical"] for r in rows), f"{spec.get('name')}: a served text differs from the eval stage's decode"
    for _ in range(int(b.get("warmup_requests", 0) or 0)):  # unmeasured: a cold machine's first touches
        one_request(client, model, WARMUP_PROMPT, 16, True)
    rate = b.get("rate")
    out["load"] = []
    for c in b.concurrency:
        before = counters()
        level = load_level(client, model, texts, int(b.load_max_tokens), int(c), int(b.requests), float(b.timeout_s),
                           load_references, float(rate) if rate else None, int(cfg.seed))
        after = counters()
        if after:  # vLLM: acceptance = 1 + accepted / drafts over this level's steps (its /metrics counters)
            delta = {k.split(":")[-1]: after[k] - before.get(k, 0.0) for k in after}
            level["spec_decode"] = delta
            drafts = delta.get("spec_decode_num_drafts_total", 0.0)
            if drafts:
                level["tau_metrics"] = 1 + delta.get("spec_decode_num_accepted_tokens_total", 0.0) / drafts
        out["load"].append(level)
        log.info("%s concurrency %d: %.2f tokens/s, tau %s, TPOT p50 %.0f ms, TTFT p50 %.0f ms, exact match %s",
                 spec.get("name"), level["concurrency"], level["tokens_per_s"], level.get("tau_metrics", level["tau"]),
                 level["tpot_ms_p50"], level["ttft_ms"]["p50"], level["exact_match"])
    if b.burst:
        out["burst"] = load_level(client, model, texts, int(b.burst_max_tokens), int(b.burst), int(b.burst),
                                  float(b.timeout_s))
        log.info("burst of %d concurrent requests: all completed in %.1f s", b.burst, out["burst"]["wall_s"])
    if out["kind"] == "blockpilot":
        out["server"] = server_stats(url, float(b.timeout_s))
    return out


def markdown(result: dict) -> str:
    """One row per server (ours named with what ran: its precision and batch size, from ``/health``): tokens/s at every
    concurrency, with the exact-match share, tau and TTFT p99 of each cell."""
    levels = sorted({level["concurrency"] for s in result["servers"].values() for level in s["load"]})
    lines = ["| server | " + " | ".join(f"c={c} tokens/s (exact, tau, TTFT p99 ms)" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for name, s in result["servers"].items():
        cells = []
        for c in levels:
            level = next((x for x in s["load"] if x["concurrency"] == c), None)
            if level is None:
                cells.append("")
                continue
            tau = level.get("tau_metrics", level["tau"])
            exact = level["exact_match"]
            cells.append(f"{level['tokens_per_s']:.1f} ({'-' if exact is None else f'{exact:.2f}'}, "
                         f"{'-' if tau is None else f'{tau:.2f}'}, {level['ttft_ms']['p99']:.0f})")
        health = s.get("server") or {}
        ran = (f" ({(health.get('forward_path') or {}).get('precision', '?')}, max_batch {health.get('max_batch', '?')})"
               if health else "")
        lines.append(f"| {name}{ran} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
