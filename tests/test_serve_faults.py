"""The server under faults and hostile requests (issue 24, items 5, 6 and 8), on the tiny models.

In-process (FastAPI TestClient / httpx ASGI transport): OpenAI error bodies for every error, body and prompt limits,
the API key, the Host-header guard, refused request chat templates and unsupported fields, 64-bit seeds, tokenisation
off the event loop. A real uvicorn server in a thread: clients that go away (streaming or not) stop their decode, also 10 of 50 concurrent
streamed clients of a continuous-batching server.
A real ``python -m pipeline.serve`` subprocess: SIGTERM while recording leaves readable label shards; resident memory
over 200 requests.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from conftest import composed
from test_serve import CANDIDATES, MODEL, PROMPTS, ar_reference, engine_for, serve_overrides
from pipeline import PROJECT_ROOT
from pipeline.decoding import DecodeConfig, SpeculativeDecoder
from pipeline.labeling.store import read_labels, read_shard
from pipeline.serve import serve_options
from pipeline.serving.app import create_app
from pipeline.serving.guards import ServeOptions
from pipeline.serving.engine import Engine
from policy_fixtures import served_method

ERROR_KEYS = {"message", "type", "param", "code"}
CHAT = "/v1/chat/completions"


def chat_body(text: str = "hi", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def openai_error(response, status: int) -> dict:
    """The ``error`` object of an OpenAI error body with ``status`` (exactly OpenAI's four keys)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["message"]
    return body["error"]


@contextmanager
def serving(decoder, options: ServeOptions | None = None, **engine_kwargs):
    engine = engine_for(decoder, **{"max_queue": 4, "default_max_tokens": 8, **engine_kwargs})
    with TestClient(create_app(engine, options), base_url="http://localhost") as client:
        yield client, engine
    engine.close()


# -- item 5 / 8(f): malformed bodies and every error in OpenAI's error body ----------------------------------------


@pytest.mark.parametrize("name,method,path,content,headers,status", [
    ("truncated JSON", "POST", CHAT, b'{"model": "tiny", "messages": [', {"content-type": "application/json"}, 400),
    ("not JSON", "POST", CHAT, b"hello", {"content-type": "application/json"}, 400),
    ("invalid UTF-8", "POST", CHAT, b'{"model": "tiny\xff\xfe", "messages": []}', {"content-type": "application/json"}, 400),
    ("deep JSON", "POST", CHAT, b"[" * 100_000 + b"]" * 100_000, {"content-type": "application/json"}, 400),
    ("JSON array", "POST", CHAT, b"[1, 2]", {"content-type": "application/json"}, 400),
    ("unknown path", "POST", "/v1/nothing", b"{}", {"content-type": "application/json"}, 404),
    ("unknown root path", "GET", "/admin", None, {}, 404),
    ("wrong method", "GET", CHAT, None, {}, 405),
    ("oversized body", "POST", CHAT, b'{"model": "' + b"x" * 300_000 + b'"}', {"content-type": "application/json"}, 413),
])
def test_malformed_and_oversized_bodies_get_a_4xx_in_openais_error_body(trained_decoder, name, method, path, content,
                                                                         headers, status):
    with serving(trained_decoder, ServeOptions(max_body_bytes=256 * 1024)) as (client, _):
        error = openai_error(client.request(method, path, content=content, headers=headers), status)
        assert error["type"] == "invalid_request_error"
        if name == "deep JSON":
            assert "nested too deeply" in error["message"]
        if name == "invalid UTF-8":
            assert "UTF-8" in error["message"]
        if status == 413:
            assert "serve.max_body_bytes" in error["message"]
        assert client.post(CHAT, json=chat_body()).status_code == 200  # the server keeps serving


def test_a_chunked_body_over_the_limit_gets_413_without_a_content_length(trained_decoder):
    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(64):
            yield b"y" * 8192
        yield b'"}]}'

    with serving(trained_decoder, ServeOptions(max_body_bytes=256 * 1024)) as (client, _):
        response = client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in response.request.headers
        openai_error(response, 413)


def test_a_prompt_over_max_prompt_chars_is_refused_before_tokenisation(trained_decoder):
    with serving(trained_decoder, ServeOptions(max_prompt_chars=1000)) as (client, _):
        error = openai_error(client.post(CHAT, json=chat_body("a" * 1001)), 400)
        assert error["param"] == "messages" and "serve.max_prompt_chars" in error["message"]
        error = openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "b" * 1001}), 400)
        assert error["param"] == "prompt"
        assert client.post(CHAT, json=chat_body("a" * 999)).status_code in (200, 400)  # within the limit: the context decides
        too_many = openai_error(client.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 5000}), 400)
        assert too_many["code"] == "context_length_exceeded"


# -- item 6: API key ------------------------------------------------------------------------------------------------


def test_with_an_api_key_every_v1_request_needs_the_bearer_token(trained_decoder):
    with serving(trained_decoder, ServeOptions(api_key="s3cret")) as (client, _):
        for path, method, body in [("/v1/models", "GET", None), (CHAT, "POST", chat_body()),
                                   ("/v1/completions", "POST", {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
                                   ("/v1/unknown", "GET", None)]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Basic s3cret"}):
                response = client.request(method, path, json=body, headers=headers)
                error = openai_error(response, 401)
                assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
        auth = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=auth).json()["data"][0]["id"] == MODEL
        assert client.post(CHAT, json=chat_body(), headers=auth).status_code == 200
        assert client.get("/health").status_code == 200  # liveness checks need no key, as in vLLM
    with serving(trained_decoder) as (client, _):  # no key configured: open
        assert client.get("/v1/models").status_code == 200


def test_the_api_key_comes_from_the_config_or_the_environment(monkeypatch):
    monkeypatch.delenv("BLOCKPILOT_API_KEY", raising=False)
    with composed("serve", []) as cfg:
        assert serve_options(cfg).api_key is None
        monkeypatch.setenv("BLOCKPILOT_API_KEY", "from-env")
        assert serve_options(cfg).api_key == "from-env"
    with composed("serve", ["serve.api_key=from-config"]) as cfg:
        assert serve_options(cfg).api_key == "from-config"
    with composed("serve", ["serve.max_body_bytes=0"]) as cfg, pytest.raises(ValueError, match="max_body_bytes"):
        serve_options(cfg)


def test_a_non_loopback_host_without_a_key_logs_a_warning_naming_the_setting(trained_decoder, caplog):
    engine = engine_for(trained_decoder)
    with caplog.at_level(logging.WARNING, logger="pipeline.serving.app"):
        create_app(engine, ServeOptions(host="127.0.0.1"))
        create_app(engine, ServeOptions(host="localhost"))
        create_app(engine, ServeOptions(host="0.0.0.0", api_key="k", allowed_hosts=["*"]))
        assert not caplog.records
        create_app(engine, ServeOptions(host="0.0.0.0"))
    engine.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any("serve.api_key" in m and "0.0.0.0" in m for m in messages)
    assert any("serve.allowed_hosts" in m for m in messages)


# -- item 8(g): Host header ------------------------------------------------------------------------------------------


def test_only_configured_host_names_are_accepted(trained_decoder):
    with serving(trained_decoder) as (client, _):
        for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST"):
            assert client.get("/v1/models", headers={"host": host}).status_code == 200, host
        for host in ("evil.example.com", "evil.example.com:8000", "127.0.0.1.nip.io", "localhost.evil.com"):
            error = openai_error(client.get("/v1/models", headers={"host": host}), 400)
            assert error["code"] == "invalid_host" and "serve.allowed_hosts" in error["message"]
        openai_error(client.get("/health", headers={"host": "evil.example.com"}), 400)
    with serving(trained_decoder, ServeOptions(host="gpu-box.lan")) as (client, _):
        assert client.get("/v1/models", headers={"host": "gpu-box.lan:8000"}).status_code == 200
    with serving(trained_decoder, ServeOptions(allowed_hosts=["api.example.com", "*.internal"])) as (client, _):
        assert client.get("/v1/models", headers={"host": "api.example.com"}).status_code == 200
        assert client.get("/v1/models", headers={"host": "a.b.internal"}).status_code == 200
        openai_error(client.get("/v1/models", headers={"host": "localhost"}), 400)  # an explicit list replaces the default
    with serving(trained_decoder, ServeOptions(allowed_hosts=["*"])) as (client, _):
        assert client.get("/v1/models", headers={"host": "anything.example"}).status_code == 200


# -- item 8(a): request chat templates ----------------------------------------------------------------------------


def test_a_requests_own_chat_template_is_refused_unless_allowed(trained_decoder):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = trained_decoder.target.tokenizer
    with serving(trained_decoder) as (client, _):
        for body in (chat_body(chat_template=template), chat_body(chat_template_kwargs={"chat_template": template}),
                     chat_body(chat_template="{% for i in range(10**9) %}{% endfor %}")):
            error = openai_error(client.post(CHAT, json=body), 400)
            assert error["param"] == "chat_template" and "serve.allow_request_chat_template" in error["message"]
        error = openai_error(client.post(CHAT, json=chat_body(chat_template_kwargs={"tokenize": False})), 400)
        assert error["param"] == "chat_template_kwargs"
        default = client.post(CHAT, json=chat_body("hello there")).json()["usage"]["prompt_tokens"]
    with serving(trained_decoder, ServeOptions(allow_request_chat_template=True)) as (client, _):
        out = client.post(CHAT, json=chat_body("hello there", chat_template=template))
        assert out.status_code == 200, out.text
        own = len(tokenizer("hello there", add_special_tokens=False)["input_ids"])
        assert out.json()["usage"]["prompt_tokens"] == own != default


# -- item 8(b): tokenisation off the event loop ----------------------------------------------------------------------


class GatedTokenizer:
    """The real tokenizer whose chat template waits on ``gate`` (stands for a slow template or a huge prompt)."""

    def __init__(self, tokenizer):
        self._tokenizer, self.gate, self.inside = tokenizer, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.inside.set()
        try:
            self.gate.wait(timeout=20)  # on the event loop, nothing else could run until this returns
            return self._tokenizer.apply_chat_template(*args, **kwargs)
        finally:
            self.inside.clear()


def test_tokenisation_runs_off_the_event_loop(trained_decoder):
    engine = engine_for(trained_decoder, default_max_tokens=8)
    gated = engine.tokenizer = GatedTokenizer(engine.tokenizer)
    app = create_app(engine)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=60) as c:
            slow = asyncio.create_task(c.post(CHAT, json=chat_body(PROMPTS[0], max_tokens=8, return_token_ids=True)))
            while not gated.inside.is_set():
                await asyncio.sleep(0.01)
            health = await c.get("/health")
            still_inside = gated.inside.is_set()  # /health answered while the template was still rendering
            gated.gate.set()
            return health, still_inside, await slow

    try:
        health, still_inside, slow = asyncio.run(scenario())
    finally:
        gated.gate.set()
        engine.close()
    assert health.status_code == 200 and still_inside
    assert slow.json()["blockpilot"]["token_ids"] == ar_reference(trained_decoder, PROMPTS[0], 8)


# -- item 8(e): unsupported fields ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_object"}), ("presence_penalty", 0.5), ("frequency_penalty", -1),
    ("logit_bias", {"42": 10}), ("tool_choice", "auto"), ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("best_of", 2), ("top_logprobs", 3), ("min_p", 0.1), ("repetition_penalty", 1.2), ("logprobs", True),
])
def test_unsupported_fields_are_refused_naming_the_field(trained_decoder, field, value):
    with serving(trained_decoder) as (client, _):
        for path, body in ((CHAT, chat_body()), ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4})):
            error = openai_error(client.post(path, json={**body, field: value}), 400)
            assert error["param"] == field and field in error["message"]


def test_the_no_op_values_of_unsupported_fields_are_accepted(trained_decoder):
    noop = {"response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
            "tool_choice": "none", "best_of": 1, "top_logprobs": 0, "logprobs": False, "repetition_penalty": 1.0,
            "unknown_field": "ignored"}
    with serving(trained_decoder) as (client, _):
        assert client.post(CHAT, json=chat_body(**noop)).status_code == 200


def test_stop_strings_are_bounded(trained_decoder):
    with serving(trained_decoder) as (client, _):
        assert openai_error(client.post(CHAT, json=chat_body(stop=["x" * 257])), 400)["param"] == "stop"
        assert client.post(CHAT, json=chat_body(stop=["x" * 256])).status_code == 200


# -- item 8(d): seeds ----------------------------------------------------------------------------------------------


def test_every_64_bit_seed_is_accepted_and_reproducible_and_larger_ones_get_400(trained_decoder):
    text = PROMPTS[2]
    with serving(trained_decoder) as (client, _):
        for seed in (2 ** 62, 2 ** 63, 2 ** 64 - 1, -(2 ** 63), 2 ** 43 + 1):
            body = chat_body(text, max_tokens=12, temperature=1.0, seed=seed, return_token_ids=True)
            response = client.post(CHAT, json=body)
            assert response.status_code == 200, (seed, response.text)
            assert response.json()["blockpilot"]["token_ids"] == ar_reference(trained_decoder, text, 12, 1.0, seed)
            assert client.post(CHAT, json=body).json()["blockpilot"]["token_ids"] == response.json()["blockpilot"]["token_ids"]
        for seed in (2 ** 64, -(2 ** 63) - 1, 10 ** 40):
            assert openai_error(client.post(CHAT, json=chat_body(seed=seed)), 400)["param"] == "seed"


# -- /health ---------------------------------------------------------------------------------------------------------


def test_health_names_the_forward_path_read_once_on_the_engines_thread(trained_decoder, monkeypatch):
    """/health answers the forward path read when the engine was built: on the event loop's thread it would run the
    kernel's code there, and a torch parallel region on a second thread slows every later decode step (libgomp)."""
    expected = json.loads(json.dumps(trained_decoder.forward_path()))
    with serving(trained_decoder) as (client, _):
        monkeypatch.setattr(trained_decoder, "forward_path", lambda: pytest.fail("forward_path read per /health"))
        health = client.get("/health").json()
    assert health["forward_path"] == expected
    assert "backend" in health["forward_path"] and health["aborted"] == 0


# -- items 5 and 8(c): clients that go away, on a real server --------------------------------------------------------


class SlowDecoder:
    """A real decoder (stop tokens off, so every decode runs to max_tokens) that sleeps ``delay`` s per request step
    (each accepted verify) and counts the prefills and steps it ran: a decode that is not stopped takes
    ``max_tokens * delay`` seconds at B=1."""

    def __init__(self, decoder: SpeculativeDecoder, delay: float = 0.02):
        decoder.stop_ids = set()
        self._decoder, self.delay = decoder, delay
        self.started = threading.Event()
        self.prefills = self.steps = 0

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def prefill_steps(self, *args, **kwargs):
        self.prefills += 1
        yield from self._decoder.prefill_steps(*args, **kwargs)

    @property
    def forward(self):
        return SlowForward(self)


class SlowForward:
    """The decoder's forwards, its verify sleeping ``delay`` s per request in the step (``SlowDecoder``)."""

    def __init__(self, slow: SlowDecoder):
        self._slow, self._forward = slow, slow._decoder.forward

    def __getattr__(self, name):
        return getattr(self._forward, name)

    def target(self, ids, *args, **kwargs):
        slow = self._slow
        slow.started.set()
        slow.steps += len(ids)
        time.sleep(slow.delay * len(ids))
        return self._forward.target(ids, *args, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(app):
    """``app`` on a real uvicorn server in a thread; yields its port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(60)


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


MAX_TOKENS = 400  # 400 steps of B=1 at 20 ms: 8 s unless the decode stops


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_its_decode_and_frees_its_slot(tiny, stream):
    slow = SlowDecoder(tiny.decoder("llama", "trained"))
    engine = Engine(slow, served_method("ar", slow), MODEL, max_queue=2, default_max_tokens=8, max_tokens=MAX_TOKENS)
    body = json.dumps({"model": MODEL, "prompt": "def add(a, b):", "max_tokens": MAX_TOKENS, "stream": stream})
    try:
        with live_server(create_app(engine)) as port:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
            if stream:
                response = conn.getresponse()
                assert response.status == 200
                while not response.readline().startswith(b"data: "):  # the first text chunk arrived
                    pass
                response.close()
            else:
                assert slow.started.wait(60)  # decoding; the client gives up (as on a read timeout)
            conn.close()
            wait_for(lambda: engine.in_flight == 0, "the slot to be freed")
            assert slow.steps < MAX_TOKENS  # stopped early, not after 400 tokens
            assert engine.aborted == 1 and engine.failed == 0
            follow = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                json={"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8})
            assert follow.status_code == 200 and follow.json()["usage"]["completion_tokens"] == 8
            assert follow.json()["choices"][0]["finish_reason"] == "length"
    finally:
        engine.close()


def test_a_request_whose_client_left_while_queued_is_dropped(tiny):
    slow = SlowDecoder(tiny.decoder("llama", "trained"))
    engine = Engine(slow, served_method("ar", slow), MODEL, max_queue=2, default_max_tokens=8, max_tokens=MAX_TOKENS)
    try:
        with live_server(create_app(engine)) as port:
            first = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            first.request("POST", "/v1/completions", headers={"content-type": "application/json"},
                          body=json.dumps({"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 100}))
            assert slow.started.wait(60)
            queued = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            queued.request("POST", "/v1/completions", headers={"content-type": "application/json"},
                           body=json.dumps({"model": MODEL, "prompt": "def mul(a, b):", "max_tokens": MAX_TOKENS}))
            wait_for(lambda: engine.in_flight == 2, "the second request to queue")
            queued.close()
            response = first.getresponse()
            assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 100
            wait_for(lambda: engine.in_flight == 0, "the queue to empty")
            assert slow.prefills == 1 and engine.aborted == 1  # the queued request never decoded
    finally:
        engine.close()


CLIENTS, LEAVING, SHORT, LONG = 50, 10, 12, 400  # every 5th client leaves; a leaver would otherwise decode 400 tokens


def test_fifty_streamed_clients_on_a_batching_server_ten_of_them_leaving_mid_stream(tiny):
    """A real uvicorn server over an ``Engine`` (8 requests per step, fixed B = 8): 50 concurrent streamed chat
    completions; 10 clients close their connection after their first text chunk. The other 40 get exactly the text of
    their batch-1 ``ar`` decode, nobody gets a 5xx, the leavers' decodes end as ``abort`` at once, and afterwards
    ``/health`` shows nothing running or waiting."""
    from pipeline.prompts import messages_input_ids

    decoder = tiny.decoder("llama", "trained")
    decoder.stop_ids = set()  # every decode runs to max_tokens: a leaver is still decoding when it goes
    tokenizer = decoder.target.tokenizer
    texts = PROMPTS + ["Write a function that returns the product of two numbers.", "0123456789 + - * /"]
    references = {t: decoder.generate(messages_input_ids(tokenizer, [{"role": "user", "content": t}]), 1,
                                      DecodeConfig(SHORT)).output_ids for t in texts}
    engine = Engine(decoder, served_method("fixed", decoder), MODEL, max_queue=CLIENTS, default_max_tokens=SHORT,
                         max_tokens=LONG, max_batch=8)

    async def client(port: int, i: int) -> dict:
        leaves = i % (CLIENTS // LEAVING) == 0
        body = {"model": MODEL, "messages": [{"role": "user", "content": texts[i % len(texts)]}], "stream": True,
                "max_tokens": LONG if leaves else SHORT, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        out = {"leaves": leaves, "text": "", "chunks": []}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:  # one connection each
            async with c.stream("POST", CHAT, json=body) as response:
                out["status"] = response.status_code
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    out["chunks"].append(chunk)
                    out["text"] += (chunk["choices"][0]["delta"].get("content") or "") if chunk["choices"] else ""
                    if leaves and out["text"]:
                        break  # the client goes away mid-stream: leaving the blocks closes its connection
        return out

    async def clients(port: int) -> list[dict]:
        return await asyncio.gather(*(client(port, i) for i in range(CLIENTS)))

    try:
        with live_server(create_app(engine)) as port:
            start = time.monotonic()
            results = asyncio.run(clients(port))
            wait_for(lambda: engine.in_flight == 0, "every slot to be freed", 60)
            elapsed = time.monotonic() - start
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
    finally:
        engine.close()
    assert [r["status"] for r in results] == [200] * CLIENTS  # no 5xx (nor 503: 8 running + 42 waiting fit)
    stayed = [(i, r) for i, r in enumerate(results) if not r["leaves"]]
    assert len(stayed) == CLIENTS - LEAVING
    for i, r in stayed:
        reference = references[texts[i % len(texts)]]
        final = r["chunks"][-1]
        assert final["blockpilot"]["token_ids"] == reference, i
        assert r["text"] == tokenizer.decode(reference, skip_special_tokens=True), i
        assert [c for c in r["chunks"] if c["choices"] and c["choices"][0]["finish_reason"]][-1]["choices"][0][
            "finish_reason"] == "length"
    assert all(r["text"] and not any(c.get("usage") for c in r["chunks"]) for r in results if r["leaves"])
    assert engine.aborted == LEAVING and engine.failed == 0 and engine.served == CLIENTS
    assert health["in_flight"] == health["running"] == health["waiting"] == 0
    assert health["aborted"] == LEAVING and health["failed"] == 0
    assert not engine.batch.active and max(v[2] for v in engine.batch.rows) == 8  # full batches, all slots free now
    decoded = sum(n for _, n in engine.batch.step_log)  # tokens of every batched step (prefill tokens aside)
    assert decoded < (CLIENTS - LEAVING) * SHORT + LEAVING * LONG // 4, decoded  # the leavers stopped early
    print(f"\n{CLIENTS} streamed clients on max_batch=8, {LEAVING} leaving: {elapsed:.1f} s, {decoded} tokens decoded")


# -- item 5: a real `python -m pipeline.serve`: SIGTERM while recording, memory over 200 requests --------------------


@contextmanager
def serve_process(tmp_path: Path, overrides: list[str]):
    """``python -m pipeline.serve`` on a free port with ``overrides``; yields (process, base url)."""
    port = free_port()
    args = [sys.executable, "-m", "pipeline.serve", "serve.host=127.0.0.1", f"serve.port={port}", "serve.num_threads=1",
            f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    log_file = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(args, cwd=PROJECT_ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"the server exited: {(tmp_path / 'server.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the server did not answer /health"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log_file.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_sigterm_during_a_recorded_decode_leaves_every_label_shard_readable(tiny, tmp_path, capsys):
    from test_label import synthetic_latency

    latency = synthetic_latency(tmp_path / "latency.json")
    record_dir = tmp_path / "labels" / "served"
    overrides = serve_overrides(tiny, record_dir, latency, "serve.shutdown_timeout_s=0.2", "serve.policy=ar")
    with serve_process(tmp_path, overrides) as (proc, url):
        ids = [httpx.post(f"{url}{CHAT}", timeout=120, json=chat_body(t, max_tokens=16)).json()["id"] for t in PROMPTS]
        lines: list[str] = []

        def long_stream():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                                  json={"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 400, "stream": True}) as r:
                    for line in r.iter_lines():
                        lines.append(line)
            except httpx.TransportError:
                lines.append("<connection closed>")

        client = threading.Thread(target=long_stream)
        client.start()
        wait_for(lambda: any(line.startswith("data: ") for line in lines), "the first streamed chunk", 120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
        client.join(60)
        assert not client.is_alive() and lines[-1] in ("data: [DONE]", "<connection closed>", "")
    log_text = (tmp_path / "server.log").read_text()
    shards = sorted(record_dir.glob("shard-*.parquet"))
    assert shards, log_text[-3000:]
    for shard in shards:
        read_shard(shard)  # raises BadShardError for a truncated file
    assert not list(record_dir.glob(".tmp-*")), "a shard write was cut off"
    rows = read_labels(record_dir)
    assert set(ids) <= set(rows["id"]) and len(rows) == len(ids) + 1  # the long request too, finished or aborted
    assert all(list(c) == CANDIDATES for c in rows["candidates"])
    finals = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    reasons = [c["choices"][0]["finish_reason"] for c in finals if c["choices"][0]["finish_reason"]]
    with capsys.disabled():
        print(f"\nSIGTERM mid-stream: the running request ended with {reasons or lines[-1:]}, {len(rows)} rows in "
              f"{len(shards)} readable shards")


@pytest.mark.slow
def test_200_sequential_requests_keep_resident_memory_within_5_percent(tiny, tmp_path, capsys):
    overrides = [f"model.target={tiny.target_dir('llama')}", f"model.drafter={tiny.drafter_dir('llama', 'trained')}",
                 f"model.name={MODEL}", "serve.default_max_tokens=16", "serve.policy=fixed"]
    with serve_process(tmp_path, overrides) as (proc, url), httpx.Client(base_url=url, timeout=120) as client:
        rss = {}
        for i in range(200):
            text = f"{PROMPTS[i % 3]} (request {i})"
            if i % 2:
                response = client.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 16,
                                                                "stream": i % 4 == 1})
            else:
                response = client.post(CHAT, json=chat_body(text, max_tokens=16, stream=i % 4 == 2))
            assert response.status_code == 200, response.text
            if i + 1 in (20, 200):
                rss[i + 1] = rss_bytes(proc.pid)
    growth = rss[200] / rss[20] - 1
    with capsys.disabled():
        print(f"\nserver RSS after 20 requests: {rss[20] / 2**20:.1f} MiB, after 200: {rss[200] / 2**20:.1f} MiB "
              f"({growth:+.2%})")
    assert growth <= 0.05


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_requests_steps(tiny):
    """``model.prefill_chunk``: ``prefill_steps`` yields once per chunk (None, then the ``PrefillResult`` over the whole
    prompt); the engine prefills a long prompt chunk by chunk while another request decodes (batched steps run
    between its chunks, one chunk between two steps), and both texts equal their batch-1 decodes on the same decoder,
    whose own prefill takes the same chunks."""
    import math

    from pipeline.prompts import messages_input_ids

    decoder = tiny.decoder("llama", "trained")
    decoder.stop_ids = set()
    decoder.prefill_chunk = 4
    tokenizer = decoder.target.tokenizer
    texts = {"short": ("Hi", 300), "long": ("Count slowly from one to twenty, then back again, please: " * 3, 8)}
    ids = {k: messages_input_ids(tokenizer, [{"role": "user", "content": t}]) for k, (t, _) in texts.items()}
    n = ids["long"].numel()
    assert n > 24
    steps = list(decoder.prefill_steps(ids["long"], DecodeConfig(8)))
    assert steps[:-1] == [None] * (math.ceil(n / 4) - 1)
    assert steps[-1].cache.get_seq_length() == n and steps[-1].features.shape[1] == n
    references = {k: decoder.generate(ids[k], 1, DecodeConfig(m)).output_ids for k, (_, m) in texts.items()}
    engine = Engine(decoder, served_method("ar", decoder), MODEL, max_batch=4, default_max_tokens=8)
    chunks_at: list[int] = []  # the batched step count when each chunk of the long prompt ran
    prefill_steps = decoder.prefill_steps

    def watched(input_ids, *args, **kwargs):
        for out in prefill_steps(input_ids, *args, **kwargs):
            if input_ids.numel() == n:
                chunks_at.append(engine.batch.steps)
            yield out

    decoder.prefill_steps = watched
    app = create_app(engine)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", timeout=120) as c:
            async def post(key: str, delay: float):
                await asyncio.sleep(delay)
                text, max_tokens = texts[key]
                body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                        "temperature": 0, "return_token_ids": True}
                return key, await c.post(CHAT, json=body)
            return await asyncio.gather(post("short", 0.0), post("long", 0.05))

    try:
        responses = asyncio.run(scenario())
    finally:
        engine.close()
    for key, response in responses:
        assert response.status_code == 200, response.text
        assert response.json()["blockpilot"]["token_ids"] == references[key], key
    assert len(chunks_at) == math.ceil(n / 4)
    assert all(b > a for a, b in zip(chunks_at, chunks_at[1:])), chunks_at  # a batched step between every two chunks
