"""What benchmark tools (``vllm bench serve``, AIPerf) read from the server, in vLLM's names and meanings.

``/metrics`` (Prometheus text, ``pipeline.serving.metrics``) against the responses' own per-request
``metrics.speculative_decoding`` and ``blockpilot`` fields; the first streamed chunk against the engine's own time of
the first token (an injected gate holds the prefill, so the verdict does not depend on the host's speed).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pipeline import PROJECT_ROOT
from pipeline.peers.vllm_server import VENV
from pipeline.serving.app import create_app
from pipeline.serving.metrics import speculative_decoding
from test_serve import MODEL, PROMPTS, engine_for, sse_events
from test_serve_faults import live_server

SPEC = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")
COUNTER = {"num_spec_steps": "vllm:spec_decode_num_drafts_total",
           "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
           "num_accepted_draft_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def scrape(client) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of ``GET /metrics``, parsed by prometheus_client's own parser."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def per_pos(samples: dict) -> dict[int, float]:
    return {int(dict(labels)["position"]): v for (name, labels), v in samples.items()
            if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}


def requests_made(client, bodies: list[tuple[str, dict]]) -> list[dict]:
    """Each body's final object (the response, or a stream's last chunk) with its ``usage``."""
    outs = []
    for path, body in bodies:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        outs.append(sse_events(response.text)[-1] if body.get("stream") else response.json())
    return outs


def bodies_for(n: int, own_block_size: bool = True) -> list[tuple[str, dict]]:
    out = []
    for i in range(n):
        stream = {"stream": True, "stream_options": {"include_usage": True}} if i % 2 else {}
        extra = {"block_size": 4} if i % 3 == 2 and own_block_size else {}
        if i % 4 == 3:
            out.append(("/v1/completions", {"model": MODEL, "prompt": PROMPTS[i % 3], "max_tokens": 20,
                                            **stream, **extra}))
        else:
            messages = [{"role": "user", "content": PROMPTS[i % 3]}]
            out.append(("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 20 + i,
                                                 **stream, **extra}))
    return out


def test_metrics_counters_are_the_sums_of_the_responses_speculative_decoding(trained_decoder):
    engine = engine_for(trained_decoder, max_queue=4, default_max_tokens=24)
    other = engine_for(trained_decoder, max_queue=4, default_max_tokens=24)  # a second app in the same process
    try:
        with TestClient(create_app(engine), base_url="http://localhost") as client, \
                TestClient(create_app(other), base_url="http://localhost") as idle:
            before = scrape(client)
            assert value(before, "vllm:spec_decode_num_drafts_total") == 0
            assert value(before, "vllm:num_requests_running") == 0 and value(before, "vllm:num_requests_waiting") == 0
            outs = requests_made(client, bodies_for(8))
            samples = scrape(client)
            assert value(scrape(idle), "vllm:request_success_total", finished_reason="length") == 0  # its own registry
    finally:
        engine.close()
        other.close()
    specs = [out["metrics"]["speculative_decoding"] for out in outs]
    for key in SPEC:
        assert value(samples, COUNTER[key]) == sum(s[key] for s in specs) > 0, key
    positions = per_pos(samples)
    width = max(len(s["num_accepted_tokens_per_pos"]) for s in specs)
    assert sorted(positions) == list(range(width))
    for i in range(width):
        assert positions[i] == sum(s["num_accepted_tokens_per_pos"][i] for s in specs
                                   if i < len(s["num_accepted_tokens_per_pos"]))
    assert positions[0] <= value(samples, "vllm:spec_decode_num_drafts_total")
    assert sum(positions.values()) == value(samples, "vllm:spec_decode_num_accepted_tokens_total")
    # by draft source: a fixed B's chains are the drafter's; the counters are the responses' sums
    for s in specs:
        assert s["by_source"] == ({"drafter": {"num_draft_tokens": s["num_draft_tokens"],
                                               "num_accepted_tokens": s["num_accepted_draft_tokens"]}}
                                  if s["num_draft_tokens"] else {})
    for name, key in (("blockpilot:spec_decode_num_draft_tokens_by_source_total", "num_draft_tokens"),
                      ("blockpilot:spec_decode_num_accepted_tokens_by_source_total", "num_accepted_draft_tokens")):
        assert value(samples, name, source="drafter") == sum(s[key] for s in specs) > 0, name
    # the request/token series
    reasons = ("stop", "length", "abort")
    assert sum(value(samples, "vllm:request_success_total", finished_reason=r) for r in reasons) == 8
    assert value(samples, "vllm:prompt_tokens_total") == sum(out["usage"]["prompt_tokens"] for out in outs)
    assert value(samples, "vllm:generation_tokens_total") == sum(out["usage"]["completion_tokens"] for out in outs)
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert value(samples, name) == 8, name
    assert value(samples, "vllm:request_time_per_output_token_seconds_count") == sum(
        out["usage"]["completion_tokens"] > 1 for out in outs)
    assert value(samples, "vllm:inter_token_latency_seconds_count") == sum(out["blockpilot"]["steps"] for out in outs)
    # acceptance length: vLLM's 1 + accepted / drafts from the counters is the responses' own tau over their drafting
    # steps (tau counts a plain step as 1: tau * steps = steps + accepted drafts)
    drafts, accepted = (value(samples, COUNTER[k]) for k in ("num_spec_steps", "num_accepted_draft_tokens"))
    taus = [(out["blockpilot"]["tau"], out["blockpilot"]["steps"], s) for out, s in zip(outs, specs)]
    for tau, steps, s in taus:
        assert tau * steps == pytest.approx(steps + s["num_accepted_draft_tokens"])
        assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_draft_tokens"] / s["num_spec_steps"])
        assert sum(s["acceptance_histogram"]) == s["num_spec_steps"]
        assert len(s["acceptance_histogram"]) == s["num_spec_tokens"] + 1
        if s["num_spec_steps"] == steps:  # every step drafted: vLLM's mean acceptance length is our tau
            assert s["mean_acceptance_length"] == pytest.approx(tau)
    assert any(s["num_spec_steps"] == steps for _, steps, s in taus)
    drafted_tau = sum(tau * steps - (steps - s["num_spec_steps"]) for tau, steps, s in taus) / drafts
    assert 1 + accepted / drafts == pytest.approx(drafted_tau)


def test_the_ar_policy_reports_zero_drafts(trained_decoder):
    engine = engine_for(trained_decoder, policy="ar", max_queue=4, default_max_tokens=16)
    try:
        with TestClient(create_app(engine), base_url="http://localhost") as client:
            outs = requests_made(client, bodies_for(4, own_block_size=False))
            samples = scrape(client)
    finally:
        engine.close()
    for out in outs:
        spec = out["metrics"]["speculative_decoding"]
        assert spec["num_spec_steps"] == spec["num_draft_tokens"] == spec["num_accepted_draft_tokens"] == 0
        assert spec["num_accepted_tokens_per_pos"] == [] and spec["mean_acceptance_length"] == 1.0
        assert out["blockpilot"]["tau"] == 1.0 and "blockpilot" in out
    for name in COUNTER.values():
        assert value(samples, name) == 0
    assert per_pos(samples) == {}
    assert value(samples, "vllm:generation_tokens_total") == sum(out["usage"]["completion_tokens"] for out in outs) > 0


def test_speculative_decoding_counts_only_steps_that_verified_drafts():
    class Stats:  # steps: k=3 accepted 2, a plain step, k=3 accepted 0, k=1 accepted 1
        taus, verify_widths, block_sizes = [3, 1, 1, 2], [3, 0, 3, 1], [4, 4, 4, 2]

    spec = speculative_decoding(Stats())
    assert spec == {"mean_acceptance_length": 1 + 3 / 3, "draft_acceptance_rate": 3 / 7,
                    "acceptance_histogram": [1, 1, 1, 0], "num_spec_steps": 3, "num_accepted_draft_tokens": 3,
                    "num_draft_tokens": 7, "num_spec_tokens": 3, "num_accepted_tokens_per_pos": [2, 1, 0],
                    "by_source": {}}


class SlowPrefill:
    """The real decoder whose prefill waits on ``gate`` before its last step, and notes when it yielded its result."""

    def __init__(self, decoder):
        self._decoder, self.gate, self.prefilled = decoder, threading.Event(), []

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def prefill_steps(self, *args, **kwargs):
        for result in self._decoder.prefill_steps(*args, **kwargs):
            if result is not None:
                assert self.gate.wait(timeout=60), "gate never opened"
                self.prefilled.append(time.perf_counter())
            yield result


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}]}),
    ("/v1/completions", {"prompt": PROMPTS[1]}),
])
def test_the_first_streamed_chunk_goes_out_with_the_first_token(trained_decoder, path, body):
    slow = SlowPrefill(trained_decoder)
    engine = engine_for(slow, max_queue=4, default_max_tokens=8)
    first_tokens: list[float] = []
    app = create_app(engine)
    engine.listeners.append(lambda done: first_tokens.append(done.first_token_s))
    arrived, first_chunk = [], threading.Event()

    def open_gate():  # once a chunk arrived (before the fix: the role chunk, sent before the prefill) or after 1 s
        first_chunk.wait(timeout=1.0)
        slow.gate.set()

    opener = threading.Thread(target=open_gate, daemon=True)
    try:
        with live_server(app) as port:
            opener.start()
            with httpx.stream("POST", f"http://127.0.0.1:{port}{path}", timeout=60,
                              json={"model": MODEL, "max_tokens": 8, "stream": True, **body}) as response:
                assert response.status_code == 200
                lines = []
                for line in response.iter_lines():
                    if line.startswith("data: ") and not arrived:
                        arrived.append(time.perf_counter())
                        first_chunk.set()
                    lines.append(line)
    finally:
        slow.gate.set()
        opener.join(10)
        engine.close()
    chunks = sse_events("\n".join(lines))
    assert len(slow.prefilled) == 1 and len(first_tokens) == 1
    assert arrived[0] >= slow.prefilled[0] and arrived[0] >= first_tokens[0]  # not before the prefill / first token
    if path == "/v1/chat/completions":
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["metrics"]["speculative_decoding"]["num_spec_steps"] >= 0


VLLM_BENCH_READS = """
import asyncio, dataclasses, json, sys
import aiohttp
from vllm.benchmarks.serve import fetch_spec_decode_metrics

async def main():
    async with aiohttp.ClientSession() as session:
        print(json.dumps(dataclasses.asdict(await fetch_spec_decode_metrics(sys.argv[1], session))))

asyncio.run(main())
"""


@pytest.mark.vllm
@pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason="no .venv-vllm (make vllm)")
def test_vllm_bench_serves_own_reader_reads_our_speculative_counters(trained_decoder):
    """``vllm bench serve``'s ``fetch_spec_decode_metrics`` (vLLM's environment, a subprocess) over our ``/metrics``."""
    engine = engine_for(trained_decoder, max_queue=4, default_max_tokens=16)
    app = create_app(engine)
    try:
        with live_server(app) as port:
            specs = []
            for text in PROMPTS:
                out = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                                 json={"model": MODEL, "messages": [{"role": "user", "content": text}]}).json()
                specs.append(out["metrics"]["speculative_decoding"])
            read = subprocess.run([str(VENV / "bin" / "python"), "-c", VLLM_BENCH_READS, f"http://127.0.0.1:{port}"],
                                  capture_output=True, text=True, timeout=300)
    finally:
        engine.close()
    assert read.returncode == 0, read.stderr[-2000:]
    got = json.loads(read.stdout.strip().splitlines()[-1])
    assert got["num_drafts"] == sum(s["num_spec_steps"] for s in specs) > 0
    assert got["num_draft_tokens"] == sum(s["num_draft_tokens"] for s in specs)
    assert got["num_accepted_tokens"] == sum(s["num_accepted_draft_tokens"] for s in specs)
    width = max(len(s["num_accepted_tokens_per_pos"]) for s in specs)
    assert {int(k): v for k, v in got["accepted_per_pos"].items()} == {
        i: sum(s["num_accepted_tokens_per_pos"][i] for s in specs if i < len(s["num_accepted_tokens_per_pos"]))
        for i in range(width)}


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason="no .venv-vllm (make vllm)")
def test_vllm_bench_serve_on_spec_bench_reports_our_acceptance(trained_decoder, tiny, tmp_path):
    """The field's tool end to end: ``vllm bench serve`` (``scripts/vllm_bench_serve.py``, vLLM's environment) runs
    Spec-Bench-layout prompts (``write_spec_bench_for``) against our server, and the acceptance length and
    accepted tokens it reports equal our server's own counters over the same requests."""
    from pipeline.prompts import write_spec_bench_for

    ours = tmp_path / "spec_bench.jsonl"
    ours.write_text("".join(json.dumps({"id": f"spec_bench-{i}-{cat}", "turns": [text], "source": "test"}) + "\n"
                            for i, (cat, text) in enumerate(zip(["qa", "qa", "summarization"], PROMPTS))))
    layout = write_spec_bench_for(ours, tmp_path / "vllm" / "spec_bench.jsonl")
    assert [json.loads(line)["category"] for line in layout.read_text().splitlines()] == ["qa", "qa", "summarization"]
    engine = engine_for(trained_decoder, max_queue=8, default_max_tokens=16)
    app = create_app(engine)
    try:
        with live_server(app) as port:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
            before = scrape(client)
            run = subprocess.run(
                [str(VENV / "bin" / "python"), str(PROJECT_ROOT / "scripts" / "vllm_bench_serve.py"),
                 "--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions",
                 "--model", MODEL, "--tokenizer", str(tiny.target_dir("llama")), "--dataset-name", "spec_bench",
                 "--dataset-path", str(layout), "--spec-bench-category", "qa", "--num-prompts", "2",
                 "--spec-bench-output-len", "16", "--max-concurrency", "1", "--save-result", "--result-dir",
                 str(tmp_path), "--result-filename", "result.json", "--disable-tqdm", "--seed", "0"],
                cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
            after = scrape(client)
    finally:
        engine.close()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 2
    drafts = value(after, COUNTER["num_spec_steps"]) - value(before, COUNTER["num_spec_steps"])
    accepted = value(after, COUNTER["num_accepted_draft_tokens"]) - value(before, COUNTER["num_accepted_draft_tokens"])
    assert drafts > 0 and result["spec_decode_num_drafts"] == drafts
    assert result["spec_decode_accepted_tokens"] == accepted
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)


AIPERF = PROJECT_ROOT / ".venv-aiperf" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not AIPERF.exists(), reason="no .venv-aiperf (make aiperf; make test installs it)")
def test_aiperf_on_spec_bench_reports_our_acceptance(trained_decoder, tiny, tmp_path):
    """NVIDIA's AIPerf end to end (``.venv-aiperf``, a subprocess): Spec-Bench prompts in its ``single_turn`` layout
    (``write_spec_bench_for(..., tool="aiperf")``) streamed to our server; the acceptance it reads from the
    responses' ``metrics.speculative_decoding`` (its Spec Decode table) equals our server's own counters."""
    from pipeline.prompts import write_spec_bench_for

    ours = tmp_path / "spec_bench.jsonl"
    ours.write_text("".join(json.dumps({"id": f"spec_bench-{i}-{cat}", "turns": [text], "source": "test"}) + "\n"
                            for i, (cat, text) in enumerate(zip(["qa", "qa", "summarization"], PROMPTS))))
    layout = write_spec_bench_for(ours, tmp_path / "aiperf" / "spec_bench.jsonl", tool="aiperf")
    assert [json.loads(line) for line in layout.read_text().splitlines()] == [{"text": t} for t in PROMPTS[:3]]
    # AIPerf 0.13 reads a local tokenizer folder as a hub id when HF_HUB_OFFLINE is set (as this suite sets it); online,
    # a local folder loads from disk with no request
    online = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    engine = engine_for(trained_decoder, max_queue=8, default_max_tokens=16)
    app = create_app(engine)
    out = tmp_path / "aiperf-out"
    try:
        with live_server(app) as port:
            client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
            before = scrape(client)
            run = subprocess.run(
                [str(AIPERF), "-m", "aiperf", "profile", "--model", MODEL, "--url", f"http://127.0.0.1:{port}",
                 "--endpoint-type", "chat", "--streaming", "--concurrency", "1", "--request-count", "3",
                 "--input-file", str(layout), "--custom-dataset-type", "single_turn",
                 "--tokenizer", str(tiny.target_dir("llama")), "--output-tokens-mean", "16",
                 "--extra-inputs", "temperature:0", "--ui", "none", "--random-seed", "0", "--artifact-dir", str(out)],
                cwd=tmp_path, capture_output=True, text=True, timeout=600, env=online)
            after = scrape(client)
    finally:
        engine.close()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == 3
    drafts = value(after, COUNTER["num_spec_steps"]) - value(before, COUNTER["num_spec_steps"])
    accepted = value(after, COUNTER["num_accepted_draft_tokens"]) - value(before, COUNTER["num_accepted_draft_tokens"])
    assert drafts > 0 and result["total_spec_decode_steps"]["avg"] == drafts
    assert sum(result["pooled_spec_decode_acceptance_histogram"].values()) == drafts
    assert result["spec_decode_token_weighted_acceptance_length"]["avg"] == pytest.approx(1 + accepted / drafts)
