"""The OpenAI-compatible server, in-process on tiny models (FastAPI TestClient / httpx ASGI transport).

References are independent of the server: ``decode_prompt`` with B=1 (plain autoregressive decoding,
what ``pipeline.evaluate``'s ``ar`` method runs) on the same prompt, and the label stage's
``label_prompt`` for the recorded rows.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from conftest import composed
from policy_fixtures import RUN, build_tiny_run, served_method
from pipeline.decoding import DecodeConfig, FixedSchedule
from pipeline.decoding.conversation import decode_prompt
from pipeline.labeling.oracle import LabelSettings, label_prompt
from pipeline.labeling.store import read_labels
from pipeline.prompts import Prompt, chat_input_ids
from pipeline.serve import build_engine
from pipeline.serving.app import create_app
from pipeline.serving.engine import Engine

MODEL = "tiny"
PROMPTS = [
    "Write a function that returns the sum of a list of numbers.",
    "def add(a, b):",
    "Natalia sold clips to 48 of her friends in April.",
]
CANDIDATES = [2, 4, 8]


def engine_for(decoder, policy: str = "fixed", **kwargs) -> Engine:
    return Engine(decoder, served_method(policy, decoder, candidates=CANDIDATES, predictor_dir=kwargs.pop("predictor_dir", None)),
                  MODEL, **kwargs)


def ar_reference(decoder, text: str, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """The eval stage's ``ar`` decode of one chat prompt: output token ids."""
    stats = decode_prompt(decoder, Prompt("p", [text], "tiny"), lambda: FixedSchedule(1), DecodeConfig(max_new_tokens, temperature, seed))
    return stats[0].output_ids


def sse_events(body: str) -> list:
    events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture
def client(trained_decoder):
    engine = engine_for(trained_decoder, max_queue=4, default_max_tokens=24)
    with TestClient(create_app(engine), base_url="http://localhost") as c:
        yield c
    engine.close()


def test_chat_completion_is_token_identical_to_the_ar_decode_streamed_and_not(client, trained_decoder):
    tokenizer = trained_decoder.target.tokenizer
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    for text in PROMPTS:
        reference = ar_reference(trained_decoder, text, 24)
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0,
                "return_token_ids": True}
        out = client.post("/v1/chat/completions", json=body).json()
        info = out["blockpilot"]
        assert info["token_ids"] == reference
        assert out["choices"][0]["message"]["content"] == tokenizer.decode(reference, skip_special_tokens=True)
        assert info["policy"] == "fixed" and info["block_size"] == 8  # the drafter's training block size
        assert info["steps"] >= 1 and info["tau"] >= 1
        assert out["usage"] == {"prompt_tokens": chat_input_ids(tokenizer, [text]).shape[1], "completion_tokens": len(reference),
                                "total_tokens": chat_input_ids(tokenizer, [text]).shape[1] + len(reference)}
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(streamed.text)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text_out = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text_out == out["choices"][0]["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == out["choices"][0]["finish_reason"]
        assert chunks[-1]["blockpilot"]["token_ids"] == reference and chunks[-1]["usage"] == out["usage"]


def test_tau_and_steps_match_the_decoders_own_stats(client, trained_decoder):
    text = PROMPTS[0]
    stats = trained_decoder.generate(chat_input_ids(trained_decoder.target.tokenizer, [text]), 8, DecodeConfig(24))
    out = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                                    "max_tokens": 24}).json()["blockpilot"]
    assert out["steps"] == len(stats.taus) and out["tau"] == pytest.approx(stats.tau)
    assert out["block_sizes"] == sorted(set(stats.block_sizes))
    forced = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                                       "max_tokens": 24, "block_size": 4}).json()["blockpilot"]
    assert forced["policy"] == "request" and forced["block_size"] == 4
    assert forced["tau"] == pytest.approx(trained_decoder.generate(
        chat_input_ids(trained_decoder.target.tokenizer, [text]), 4, DecodeConfig(24)).tau)


def test_completion_endpoint_streamed_and_not_with_stop_strings(client, trained_decoder):
    tokenizer = trained_decoder.target.tokenizer
    prompt = "def add(a, b):\n    return"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    reference = trained_decoder.generate(ids, 1, DecodeConfig(20)).output_ids
    full = tokenizer.decode(reference, skip_special_tokens=True)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "return_token_ids": True}
    out = client.post("/v1/completions", json=body).json()
    assert out["object"] == "text_completion" and out["blockpilot"]["token_ids"] == reference
    assert out["choices"][0]["text"] == full and out["usage"]["prompt_tokens"] == ids.shape[1]
    streamed = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in streamed) == full
    assert client.post("/v1/completions", json={**body, "prompt": ids[0].tolist()}).json()["choices"][0]["text"] == full
    stop = full.strip()[len(full.strip()) // 2:][:3]  # a string from the middle of the output
    assert stop and stop in full
    cut = full[: full.find(stop)]
    for stream in (False, True):
        response = client.post("/v1/completions", json={**body, "stop": [stop], "stream": stream})
        text = ("".join(c["choices"][0]["text"] for c in sse_events(response.text)) if stream
                else response.json()["choices"][0]["text"])
        assert text == cut
    finished = client.post("/v1/completions", json={**body, "stop": stop}).json()
    assert finished["choices"][0]["finish_reason"] == "stop"
    assert len(finished["blockpilot"]["token_ids"]) < len(reference) or full.endswith(stop)  # decoding ended early


def test_sampling_with_a_seed_is_lossless_and_reproducible(client, trained_decoder):
    text = PROMPTS[2]
    reference = ar_reference(trained_decoder, text, 24, temperature=1.0, seed=7)
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 1.0,
            "seed": 7, "return_token_ids": True}
    assert client.post("/v1/chat/completions", json=body).json()["blockpilot"]["token_ids"] == reference
    other = client.post("/v1/chat/completions", json={**body, "seed": 8}).json()["blockpilot"]["token_ids"]
    assert other == ar_reference(trained_decoder, text, 24, temperature=1.0, seed=8)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "   "}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "gpt-4o"}, 404, "model"),
    ("/v1/chat/completions", {"temperature": 3.5}, 400, "temperature"),
    ("/v1/chat/completions", {"temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sum " * 600}]}, 400, "messages"),
    ("/v1/chat/completions", {"n": 2}, 400, "n"),
    ("/v1/chat/completions", {"top_p": 0.5}, 400, "top_p"),
    ("/v1/chat/completions", {"block_size": 99}, 400, "block_size"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt"),
])
def test_bad_requests_get_a_4xx_with_a_message_and_the_server_keeps_serving(client, path, body, status, param):
    base = {"model": MODEL, "max_tokens": 4}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    response = client.post(path, json={**base, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    assert client.post(path, json=base).status_code == 200


def test_the_kv_cache_bound_refuses_what_cannot_fit_and_admits_the_rest_in_turn(trained_decoder):
    """``serve.kv_cache_mb``: a request whose prompt + max_tokens needs more KV cache than the whole bound gets a 400
    naming it; requests that fit one at a time (but not two) are decoded in turn, each the ``ar`` text, and never hold
    more than the bound together."""
    ids = chat_input_ids(trained_decoder.target.tokenizer, [PROMPTS[0]])
    per_request = (ids.shape[-1] + 16) * trained_decoder.kv_bytes_per_token
    config = trained_decoder.model.config
    assert trained_decoder.kv_bytes_per_token == (2 * config.num_hidden_layers * config.num_key_value_heads
                                                  * (config.hidden_size // config.num_attention_heads) * 4)
    engine = engine_for(trained_decoder, max_batch=4, kv_budget=int(1.5 * per_request))
    app = create_app(engine)
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 16,
            "return_token_ids": True}
    held = []
    step = engine.batch.step

    def watched_step():
        held.append((len(engine.batch.active), engine.scheduler.kv_reserved))
        return step()

    engine.batch.step = watched_step

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=60) as c:
            big = await c.post("/v1/chat/completions", json={**body, "max_tokens": 400})
            return big, await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(3)))

    try:
        big, answers = asyncio.run(scenario())
    finally:
        engine.close()
    assert big.status_code == 400 and "serve.kv_cache_mb" in big.json()["error"]["message"]
    assert big.json()["error"]["code"] == "kv_cache_exceeded"
    reference = ar_reference(trained_decoder, PROMPTS[0], 16)
    assert all(a.status_code == 200 and a.json()["blockpilot"]["token_ids"] == reference for a in answers)
    assert held and max(n for n, _ in held) == 1 and max(r for _, r in held) <= int(1.5 * per_request)


class GatedDecoder:
    """The real decoder whose prefill waits on an event (holds the worker so the queue fills deterministically);
    raises once when ``fail_next`` is set."""

    def __init__(self, decoder):
        self._decoder, self.gate, self.started, self.fail_next = decoder, threading.Event(), threading.Event(), False

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def prefill_steps(self, *args, **kwargs):  # the engine prefills chunk by chunk: this gates its first chunk
        self.started.set()
        assert self.gate.wait(timeout=60), "gate never opened"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        yield from self._decoder.prefill_steps(*args, **kwargs)


def test_a_full_queue_answers_503_and_queued_requests_complete(trained_decoder):
    gated = GatedDecoder(trained_decoder)
    engine = engine_for(gated, max_queue=1, default_max_tokens=8)
    app = create_app(engine)
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8, "return_token_ids": True}
    reference = ar_reference(trained_decoder, PROMPTS[0], 8)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=60) as c:
            first = asyncio.create_task(c.post("/v1/chat/completions", json=body))
            while not gated.started.is_set():  # the first request holds the worker
                await asyncio.sleep(0.01)
            second = asyncio.create_task(c.post("/v1/chat/completions", json=body))  # waits in the queue
            while engine.in_flight < 2:
                await asyncio.sleep(0.01)
            third = await c.post("/v1/chat/completions", json=body)
            streamed = await c.post("/v1/chat/completions", json={**body, "stream": True})
            gated.gate.set()
            return third, streamed, await first, await second

    try:
        third, streamed, first, second = asyncio.run(scenario())
    finally:
        gated.gate.set()
        engine.close()
    assert third.status_code == 503 and streamed.status_code == 503
    assert "queue is full" in third.json()["error"]["message"]
    assert int(third.headers["retry-after"]) >= 1 and int(streamed.headers["retry-after"]) >= 1
    for response in (first, second):
        assert response.status_code == 200 and response.json()["blockpilot"]["token_ids"] == reference


def test_twenty_concurrent_requests_complete_and_a_failed_decode_is_a_500(trained_decoder):
    gated = GatedDecoder(trained_decoder)
    gated.gate.set()
    engine = engine_for(gated, max_queue=32, default_max_tokens=8)
    app = create_app(engine)
    references = {t: ar_reference(trained_decoder, t, 8) for t in PROMPTS}

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=120) as c:
            gated.fail_next = True
            failed = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            bodies = [{"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[i % 3]}], "max_tokens": 8,
                       "return_token_ids": True, "stream": i % 2 == 1} for i in range(20)]
            return failed, await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))

    try:
        failed, responses = asyncio.run(scenario())
    finally:
        engine.close()
    assert failed.status_code == 500 and "injected failure" in failed.json()["error"]["message"]
    for i, response in enumerate(responses):
        assert response.status_code == 200
        ids = (sse_events(response.text)[-1] if i % 2 else response.json())["blockpilot"]["token_ids"]
        assert ids == references[PROMPTS[i % 3]]
    assert engine.served == 20 and engine.failed == 1 and engine.in_flight == 0


@pytest.fixture(scope="module")
def tiny_run(tiny, tmp_path_factory):
    return build_tiny_run(tmp_path_factory.getbasetemp() / "policy-run", tiny.target_dir("llama"), tiny.drafter_dir("llama", "trained"))


def test_blockpilot_policy_picks_the_predictors_block_size(tiny_run, trained_decoder):
    from pipeline.policy.export import load_predictor

    predictor_dir = Path(tiny_run["data"]) / "predictors" / RUN / "mlp"
    engine = engine_for(trained_decoder, "blockpilot", predictor_dir=str(predictor_dir), default_max_tokens=16)
    predictor = load_predictor(predictor_dir)
    tokenizer = trained_decoder.target.tokenizer
    with TestClient(create_app(engine), base_url="http://localhost") as c:
        for text in PROMPTS:
            ids = chat_input_ids(tokenizer, [text])
            expected = predictor.predict(trained_decoder.prefill(ids, DecodeConfig(16)).last_logits)
            out = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                                       "max_tokens": 16, "return_token_ids": True}).json()
            assert out["blockpilot"]["policy"] == "blockpilot" and out["blockpilot"]["block_size"] == expected
            assert out["blockpilot"]["token_ids"] == ar_reference(trained_decoder, text, 16)
    engine.close()
    with pytest.raises(FileNotFoundError, match="make train"):
        served_method("blockpilot", trained_decoder, predictor_dir=str(predictor_dir.parent / "missing"))


def test_verify_width_policy_serves_the_ar_text_and_needs_its_inputs(tiny_run, trained_decoder, tmp_path):
    """serve.policy=verify_width through the engine: lossless, with the run's calibration and a measured latency model."""
    from pipeline.policy.calibration import load_calibration
    from pipeline.policy import registry
    from pipeline.policy.registry import PolicyInputs
    from pipeline.timing.steps import measure

    calibration = load_calibration(Path(tiny_run["data"]) / "predictors" / RUN / "verify_width")
    latency = measure(trained_decoder, [8], [16, 64], repeats=1)
    policy = served_method("verify_width", trained_decoder, 8, options={"verify_width": {"max_skip": 2}},
                          inputs=PolicyInputs(calibration=calibration, latency=latency))
    engine = Engine(trained_decoder, policy, MODEL, default_max_tokens=20)
    with TestClient(create_app(engine), base_url="http://localhost") as c:
        for text in PROMPTS:
            out = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": text}],
                                                       "max_tokens": 20, "return_token_ids": True}).json()
            assert out["blockpilot"]["policy"] == "verify_width" and out["blockpilot"]["block_size"] == 8
            assert out["blockpilot"]["token_ids"] == ar_reference(trained_decoder, text, 20)
            widths = out["blockpilot"]["verify_widths"]  # steps by verified drafts k: every step counted, k <= B-1
            assert sum(widths.values()) == out["blockpilot"]["steps"] and all(0 <= int(k) <= 7 for k in widths)
    engine.close()
    with pytest.raises(ValueError, match="needs calibration, costs"):  # the registry's own check of its inputs
        registry.build("verify_width", registry.Context(trained_decoder, block_size=8, where="serve"))


def test_a_stale_cost_model_is_measured_again_only_while_no_request_waits(tiny, tiny_run, trained_decoder, tmp_path,
                                                                          monkeypatch):
    """A cost model found stale mid-stream is not measured while the stream runs: on an injected clock that every timed
    run moves 100 ms on, no gap between the stream's tokens exceeds 3x their median + 50 ms, and the measurement is
    taken once the server is idle. A measurement that a waiting request interrupts stores nothing and stays pending."""
    from conftest import SteadyClock

    from pipeline.serving.engine import Job
    from pipeline.timing import fixture

    costs_dir = tmp_path / "costs"
    overrides = [f"paths.data={tiny_run['data']}", f"run_name={RUN}", f"model.target={tiny.target_dir('llama')}",
                 f"model.drafter={tiny.drafter_dir('llama', 'trained')}", f"model.name={MODEL}", "serve.policy=budget",
                 "serve.warmup=false", "policy.budget.costs.rows=[1,4,8]", "policy.budget.costs.repeats=1",
                 "policy.budget.costs.context=16", f"policy.budget.costs.cache={costs_dir}", "serve.max_batch=2"]
    with composed("serve", overrides) as cfg:
        engine = build_engine(cfg, decoder=trained_decoder)
    watch = engine.watch
    assert watch.defer and not watch.pending
    clock = SteadyClock(tick_ms=100.0)  # a measurement while the stream runs would open a gap of seconds
    monkeypatch.setattr(fixture, "clock", clock)
    monitor, forced = watch.monitors["batch"], []
    observe = monitor.observe

    def stale_once(modelled_ms, observed_ms):  # the first batched step finds the model stale
        if not forced:
            forced.append(clock.reads)
            return "remeasure"
        return observe(modelled_ms, observed_ms)

    monkeypatch.setattr(monitor, "observe", stale_once)
    stamps = []
    ids = chat_input_ids(trained_decoder.target.tokenizer, [PROMPTS[0]])
    job = Job("stream", ids, DecodeConfig(24, 0.0, 0), on_text=lambda delta: stamps.append(clock()))
    completion = asyncio.run(engine.run(job))
    engine.drain()
    assert forced and completion.output_ids == ar_reference(trained_decoder, PROMPTS[0], 24)
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    assert len(gaps) >= 3 and gaps[-1] <= 3 * gaps[len(gaps) // 2] + 0.05, gaps
    assert not watch.pending and clock.reads > len(stamps) + 10  # measured after the stream, while idle
    engine.close()

    stored = {p: p.stat().st_mtime_ns for p in costs_dir.glob("*.json")}
    forced.clear()
    watch.step(10.0, (1, 0, 1, 0))  # stale again: deferred
    assert set(watch.pending) == {"batch"}
    checks = []
    assert not watch.measure_pending(lambda: checks.append(1) or len(checks) > 3)  # a request arrives mid-measurement
    assert set(watch.pending) == {"batch"} and {p: p.stat().st_mtime_ns for p in costs_dir.glob("*.json")} == stored
    forwards, real = [], trained_decoder.target_forward  # a request already waits: not one prompt prefilled for it
    monkeypatch.setattr(trained_decoder, "target_forward", lambda *a, **k: forwards.append(1) or real(*a, **k))
    assert not watch.measure_pending(lambda: True) and not forwards and set(watch.pending) == {"batch"}
    monkeypatch.setattr(trained_decoder, "target_forward", real)
    assert watch.measure_pending(lambda: False) and not watch.pending


def test_max_batch_auto_takes_the_knee_of_the_batched_step_costs(tiny, tiny_run, trained_decoder, tmp_path,
                                                                  steady_clock):
    """``serve.max_batch=auto`` (the default): the fewest requests reaching 95% of the most tokens/s of this machine's
    batched step costs; ``knee`` against the throughput curve computed by hand on a model of known shape."""
    from pipeline.costs.batched import BatchCostModel, knee

    costs = BatchCostModel([1, 256], [4.5, 132.0], [8], [2.0], verify_per_request_ms=0.1)  # verify(R) = 4 + 0.5 R
    rate = [n / (4.0 + 0.5 * n + 0.1 * (n - 1)) for n in range(1, 65)]
    assert knee(costs, 64) == next(n for n, r in enumerate(rate, 1) if r >= 0.95 * max(rate)) == 41
    assert knee(costs, 64, share=0.9) == 30
    assert knee(costs, 1) == 1 and knee(BatchCostModel([1, 2], [1.0, 2.0], [8], [2.0]), 64) == 1  # no gain: one
    with pytest.raises(ValueError, match="limit >= 1"):
        knee(costs, 0)
    overrides = [f"paths.data={tiny_run['data']}", f"run_name={RUN}", f"model.target={tiny.target_dir('llama')}",
                 f"model.drafter={tiny.drafter_dir('llama', 'trained')}", f"model.name={MODEL}", "serve.policy=ar",
                 "serve.warmup=false", "policy.budget.costs.rows=[1,2,4,8]", "policy.budget.costs.repeats=1",
                 "policy.budget.costs.context=16", f"policy.budget.costs.cache={tmp_path / 'costs'}",
                 "serve.max_batch_limit=8"]
    with composed("serve", overrides) as cfg:
        assert cfg.serve.max_batch == "auto"
        engine = build_engine(cfg, decoder=trained_decoder)
    try:
        measured = [p for p in (tmp_path / "costs").glob("batch-costs-*.json")]
        assert len(measured) == 1  # timed once up to serve.max_batch_limit, cached

        stored = BatchCostModel.from_dict(json.loads(measured[0].read_text())["batch_costs"])
        assert 1 <= engine.max_batch == knee(stored, 8) <= 8
    finally:
        engine.close()
    with composed("serve", [*overrides, "serve.max_batch=0"]) as cfg, pytest.raises(ValueError, match="auto"):
        build_engine(cfg, decoder=trained_decoder)


def test_budget_policy_serves_the_ar_texts_with_widths_chosen_jointly(tiny, tiny_run, trained_decoder, tmp_path,
                                                                     monkeypatch):
    """serve.policy=budget through build_engine: the BudgetPolicy of bench_batch (the run's verify-width calibration,
    this machine's batched step costs measured once and cached), lossless at T=0 whether a request was admitted to
    draft or to decode autoregressively; a bad cost-model block is refused before loading."""
    import asyncio

    import httpx

    from pipeline.policy.budget import BudgetPolicy

    overrides = [f"paths.data={tiny_run['data']}", f"run_name={RUN}", f"model.target={tiny.target_dir('llama')}",
                 f"model.drafter={tiny.drafter_dir('llama', 'trained')}", f"model.name={MODEL}", "serve.policy=budget",
                 "serve.warmup=false", "policy.budget.costs.rows=[1,4,8,16]", "policy.budget.costs.repeats=1",
                 "policy.budget.costs.context=16", f"policy.budget.costs.cache={tmp_path / 'costs'}"]

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was checked")

    monkeypatch.setattr("pipeline.decoding.build.build_decoder", refuse)
    with composed("serve", [*overrides, "serve.max_batch=4", "policy.budget.costs.rows=[]"]) as cfg, \
            pytest.raises(ValueError, match=r"policy.budget.costs.rows"):
        build_engine(cfg)
    with composed("serve", [*overrides, "serve.max_batch=4"]) as cfg:
        engine = build_engine(cfg, decoder=trained_decoder)
    budget = engine.policy.batch
    assert isinstance(budget, BudgetPolicy) and engine.batch.policy is budget and engine.max_batch == 4
    assert budget.skip_drafts and budget.max_skip == 8  # policy.verify_width's skip rule
    assert [p.name for p in (tmp_path / "costs").glob("batch-costs-*.json")]  # measured once, cached for the next start
    app = create_app(engine)
    texts = PROMPTS + ["Write a function that returns the product of two numbers.", "0123456789 + - * /"]

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=120) as c:
            bodies = [{"model": MODEL, "messages": [{"role": "user", "content": texts[i % len(texts)]}], "max_tokens": 20,
                       "temperature": 0, "return_token_ids": True, "stream": i % 2 == 1,
                       "stream_options": {"include_usage": True}} for i in range(8)]
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=b) for b in bodies))

    try:
        responses = asyncio.run(scenario())
        assert max(v[2] for v in engine.batch.rows) > 1  # requests shared steps
        assert budget.admitted and set(budget.admitted) <= {1, 2, 3, 4}  # each admission at its load
        assert all(0 <= k <= 7 for k in budget.widths)
    finally:
        engine.close()
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        info = (sse_events(response.text)[-1] if i % 2 else response.json())["blockpilot"]
        assert info["policy"] == "budget" and info["block_size"] in (1, 8)  # admitted to decode alone, or to draft
        assert info["token_ids"] == ar_reference(trained_decoder, texts[i % len(texts)], 20)
    assert engine.served == 8 and engine.failed == 0


@pytest.mark.parametrize("max_batch", [1, 4])
def test_the_server_decodes_on_the_thread_that_loaded_the_model(tiny, max_batch):
    """``python -m pipeline.serve`` builds and warms the engine on its decoder thread and decodes there
    (pipeline/serving/threads.py: one OpenMP team): every target forward of a served request runs on that thread, for
    one request at a time and batched alike."""
    from pipeline.serve import start_engine
    from pipeline.serving.threads import decoder_thread

    overrides = [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'trained')}",
                 f"model.name={MODEL}", "serve.policy=ar", f"serve.max_batch={max_batch}"]
    thread = decoder_thread()
    loader = thread.submit(threading.get_ident).result()
    with composed("serve", overrides) as cfg:
        engine = thread.submit(start_engine, cfg, thread).result()
    seen: set[int] = set()
    head = engine.decoder.head

    def spy(hidden):
        seen.add(threading.get_ident())
        return head(hidden)

    engine.decoder.head = spy
    try:
        with TestClient(create_app(engine), base_url="http://localhost") as c:
            for i, text in enumerate(PROMPTS[:2]):
                body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8,
                        "stream": i == 1}
                assert c.post("/v1/chat/completions", json=body).status_code == 200
    finally:
        engine.close()
        thread.shutdown()
    assert seen == {loader} and loader != threading.get_ident()
    assert engine.served == 2


def serve_overrides(tiny, record_dir: Path, latency: Path, *extra: str) -> list[str]:
    return [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'trained')}",
            f"model.name={MODEL}", "serve.record=true", f"serve.record_dir={record_dir}", f"serve.latency_path={latency}",
            "serve.record_flush_every=2", f"label.block_sizes={CANDIDATES}".replace(" ", ""), "label.topk=16",
            "serve.default_max_tokens=24", "serve.policy=fixed", "serve.max_batch=8", *extra]


def test_recorded_requests_are_the_label_stages_rows_and_feed_the_dataset_stage(tiny, trained_decoder, tmp_path):
    from test_label import synthetic_latency

    from pipeline.policy.data import build_dataset
    from pipeline.costs import load

    latency_path = synthetic_latency(tmp_path / "latency.json")
    record_dir = tmp_path / "labels" / "served"
    texts = PROMPTS + ["Write a function that returns the product of two numbers.", "0123456789 + - * /",
                       "The quick brown fox jumps over the lazy dog."]
    with composed("serve", serve_overrides(tiny, record_dir, latency_path)) as cfg:
        engine = build_engine(cfg, decoder=trained_decoder)
    with TestClient(create_app(engine), base_url="http://localhost") as c:
        ids = []
        for i, text in enumerate(texts):
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 24, "stream": i % 2 == 1}
            response = c.post("/v1/chat/completions", json=body)
            ids.append((sse_events(response.text)[-1] if i % 2 else response.json())["id"])
        skipped = c.post("/v1/chat/completions", json={**body, "temperature": 0.7, "stream": False})  # not this run's T
        assert skipped.status_code == 200
    # leaving the client runs the app's shutdown, which waits for the recordings and flushes them (no close needed)
    health = engine.recorder.stats()
    assert len(read_labels(record_dir)) == len(texts)
    engine.close()
    assert health["recorded"] == len(texts) and health["skipped"] == 1 and health["mismatches"] == 0
    rows = read_labels(record_dir).set_index("id")
    assert sorted(rows.index) == sorted(ids) and set(rows["source_set"]) == {"served"}
    settings = LabelSettings(candidates=CANDIDATES, max_new_tokens=24, topk=16)
    latency = load(latency_path)
    for rid, text in zip(ids, texts):  # the label stage's replay row of the same request
        expected = label_prompt(trained_decoder, chat_input_ids(trained_decoder.target.tokenizer, [text]), settings, latency).row
        got = rows.loc[rid]
        assert list(got["tau"]) == pytest.approx(expected["tau"]) and list(got["new_tokens"]) == expected["new_tokens"]
        assert got["label_tau"] == expected["label_tau"] and got["label_speed"] == expected["label_speed"]
        assert list(got["topk_ids"]) == expected["topk_ids"] and got["prompt_tokens"] == expected["prompt_tokens"]
    meta = json.loads((record_dir / "meta.json").read_text())
    assert meta["candidates"] == CANDIDATES and meta["mode"] == "replay" and meta["latency_model"]
    with composed("dataset", [f"dataset.labels_dir={record_dir}", f"dataset.out={tmp_path}/features", "logger.enabled=false",
                              "features.k=16", "dataset.fractions={train: 0.5, validation: 0.25, test: 0.25}"]) as dcfg:
        out = build_dataset(dcfg)
    info = json.loads((out / "blockpilot.json").read_text())
    assert sum(sum(c.values()) for c in info["counts"].values()) == len(texts) and info["candidates"] == CANDIDATES
    assert all(sum(info["counts"][s].values()) >= 1 for s in ("train", "validation", "test"))
    from pipeline.policy.training import train_predictor

    with composed("train", [f"train.features_dir={out}", f"train.out={tmp_path}/predictor", "trainer=smoke",
                            "train.batch_size=2", "logger.enabled=false", "features.k=16"]) as tcfg:
        predictor_dir = train_predictor(tcfg)
    policy = served_method("blockpilot", trained_decoder, predictor_dir=str(predictor_dir))  # servable
    assert policy().max_block_size == max(CANDIDATES)


def test_the_decoders_on_tokens_hook_sees_every_token_in_order_and_can_end_the_decode(trained_decoder):
    ids = chat_input_ids(trained_decoder.target.tokenizer, [PROMPTS[0]])
    full = trained_decoder.generate(ids, 8, DecodeConfig(24))
    seen: list[list[int]] = []
    again = trained_decoder.generate(ids, 8, DecodeConfig(24), on_tokens=lambda new: seen.append(list(new)))
    assert again.output_ids == full.output_ids and [t for step in seen for t in step] == full.output_ids
    assert [len(step) for step in seen[1:]] == full.taus  # the prefill's token, then one call per verify step
    halted = trained_decoder.generate(ids, 8, DecodeConfig(24), on_tokens=lambda new: True)
    assert halted.output_ids == full.output_ids[:1] and halted.taus == []  # ended right after the prefill's token


def test_a_policy_that_never_drafts_is_served_without_the_drafter(tiny, tiny_run, tmp_path):
    """A server whose policy never runs the drafter (``mixed`` on its free sources, the default; ``ar``) does not load
    it (issue 53: what the forward that runs needs): its decoder has none, its batched costs are measured with rows of
    several per request (the per-request cost apart from the rows'), and its texts equal the eval stage's ``ar`` with
    the drafter loaded; ``mixed`` drafting from the drafter loads it."""
    from pipeline.costs import BatchCostModel
    from pipeline.timing.batched import FREE_ROWS

    with_drafter = tiny.decoder("llama", "trained")
    overrides = [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'trained')}",
                 f"model.name={MODEL}", "serve.warmup=false", "serve.max_batch=auto", "serve.max_batch_limit=4",
                 "policy.budget.costs.rows=[1,2,4,8]", "policy.budget.costs.repeats=1",
                 "policy.budget.costs.context=16",
                 f"paths.costs={tmp_path / 'costs'}", "policy.verify_width.latency.context_buckets=[16]",
                 "policy.verify_width.latency.repeats=1", f"paths.data={tiny_run['data']}", f"run_name={RUN}"]
    with composed("serve", overrides) as cfg:
        assert cfg.serve.policy == "mixed" and "drafter" not in cfg.policy.mixed.sources
        engine = build_engine(cfg)
    try:
        assert engine.decoder.drafter is None and engine.decoder.forward_path()["drafter"] is None
        stored = [json.loads(p.read_text()) for p in (tmp_path / "costs").glob("batch-costs-*.json")]
        assert len(stored) == 1 and stored[0]["key"]["identity"]["drafter"] == "None"
        costs = BatchCostModel.from_dict(stored[0]["batch_costs"])
        assert costs.info["block_size"] == FREE_ROWS and costs.draft_ms == [0.0]
        with TestClient(create_app(engine), base_url="http://localhost") as c:
            for text in PROMPTS[:2]:
                out = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 16, "return_token_ids": True,
                                                           "messages": [{"role": "user", "content": text}]}).json()
                assert out["blockpilot"]["policy"] == "mixed"
                assert out["blockpilot"]["token_ids"] == ar_reference(with_drafter, text, 16)
    finally:
        engine.close()
    with composed("serve", [*overrides, "policy.mixed.sources=[drafter,ngram]", "serve.max_batch=1"]) as cfg:
        engine = build_engine(cfg)
    try:
        assert engine.decoder.drafter is not None
    finally:
        engine.close()
