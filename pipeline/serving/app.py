"""The OpenAI-compatible FastAPI app over an ``Engine``.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as
server-sent events: one ``data: {chunk}`` per text delta, then a final chunk with ``finish_reason``,
the ``blockpilot`` extension and, with ``stream_options.include_usage``, ``usage``; then
``data: [DONE]``), and ``GET /health``. Every error uses OpenAI's body ``{"error": {"message", "type",
"param", "code"}}``: 400 for bad input (validation errors, malformed JSON, invalid UTF-8, nesting too deep,
unsupported fields, a request's own chat template, a Host header not in ``allowed_hosts``), 401 for a
missing or wrong API key, 404 for an unknown model or path, 405 for a wrong method, 413 for a body over
``max_body_bytes``, 503 when the queue is full, 500 when a decode fails (the server keeps serving).

Guards (``ServeOptions``, from ``conf/serve.yaml``): the Host header must name an allowed host (loopback
names and ``serve.host`` by default, against DNS rebinding); with ``serve.api_key`` every ``/v1`` request
needs ``Authorization: Bearer <key>``; bodies are capped (``serve.max_body_bytes``) and prompts too
(``serve.max_prompt_chars``); tokenisation and chat templates run off the event loop; a client that goes
away (streaming or not) stops its decode after the current step.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import json
import logging
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pipeline.prompts import messages_input_ids
from pipeline.serving.engine import Completion, Engine, Job, JobCancelled, QueueFull
from pipeline.serving.schemas import (ChatCompletionRequest, CompletionRequest, RequestError, SamplingRequest, Usage,
                                      new_id, now)

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""Host names accepted by default besides ``serve.host`` (DNS-rebinding guard)."""

API_KEY_ENV = "BLOCKPILOT_API_KEY"
"""The environment variable read when ``serve.api_key`` is null."""


@dataclass
class ServeOptions:
    """The app's guards and limits (``conf/serve.yaml``'s ``serve.*``; ``pipeline.serve.serve_options``).

    Attributes:
        host: the address the server binds (``serve.host``); accepted as a Host-header name, and a non-loopback one
            without ``api_key`` logs a warning.
        api_key: when set, every ``/v1`` request needs ``Authorization: Bearer <api_key>`` (else 401).
        allowed_hosts: Host-header names accepted (port ignored; ``*.example.com`` patterns; ``*`` accepts any);
            None: ``LOOPBACK_HOSTS`` + ``host``.
        max_body_bytes: the largest request body (bytes); larger gets 413.
        max_prompt_chars: the largest prompt (characters over all messages, or of a completion prompt); more gets 400
            before tokenisation.
        allow_request_chat_template: accept a request's own ``chat_template`` (it runs on the server: only for trusted
            clients; vLLM's ``--trust-request-chat-template``).
    """

    host: str = "127.0.0.1"
    api_key: str | None = None
    allowed_hosts: list[str] | None = None
    max_body_bytes: int = 4 << 20
    max_prompt_chars: int = 1_000_000
    allow_request_chat_template: bool = False
    hosts: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self):
        if self.max_body_bytes < 1 or self.max_prompt_chars < 1:
            raise ValueError(f"serve.max_body_bytes and serve.max_prompt_chars must be >= 1, got {self.max_body_bytes} "
                             f"and {self.max_prompt_chars}")
        names = list(self.allowed_hosts) if self.allowed_hosts is not None else [*LOOPBACK_HOSTS, self.host]
        self.hosts = tuple(_host_name(str(h)) for h in names if str(h))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or name) reaches only this machine."""
    if _host_name(host) == "localhost":
        return True
    try:
        return ipaddress.ip_address(_host_name(host)).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """``host`` lower-cased without brackets (``[::1]`` -> ``::1``)."""
    return host.strip().lower().removeprefix("[").removesuffix("]")


def _header_host(value: str) -> str:
    """The host of a Host header without its port: ``example.com:8000`` -> ``example.com``, ``[::1]:80`` -> ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":")[0]
    return value


def host_allowed(header: str, allowed: tuple[str, ...]) -> bool:
    """Whether a Host header value names one of ``allowed`` (``*``: any; ``*.x.org``: any subdomain of x.org)."""
    host = _header_host(header)
    if not host:
        return False
    for pattern in allowed:
        if pattern == "*" or host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:])):
            return True
    return False


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-style error body with ``status``."""
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def body_too_large(limit: int) -> JSONResponse:
    return error_response(413, f"the request body is larger than this server's limit of {limit} bytes "
                          "(serve.max_body_bytes)", code="body_too_large")


class GuardMiddleware:
    """ASGI middleware: refuses a Host header outside ``options.hosts`` (400, DNS rebinding), with ``options.api_key``
    a ``/v1`` request without ``Authorization: Bearer <key>`` (401), and a body over ``options.max_body_bytes`` (413:
    at once from its Content-Length, else as soon as the bytes read pass the limit), in OpenAI's error body."""

    def __init__(self, app: ASGIApp, options: ServeOptions):
        self.app, self.options = app, options

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            host = headers.get("host", "")
            if not host_allowed(host, self.options.hosts):
                response = error_response(400, f"Host header {host!r} is not allowed here; add the name clients use to "
                                          "serve.allowed_hosts (['*'] accepts any)", code="invalid_host")
                return await response(scope, receive, send)
            key = self.options.api_key
            if key and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
                scheme, _, token = headers.get("authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
                    response = error_response(401, "missing or incorrect API key: send the header "
                                              "'Authorization: Bearer <serve.api_key>'", code="invalid_api_key",
                                              headers={"WWW-Authenticate": "Bearer"})
                    return await response(scope, receive, send)
            limit = self.options.max_body_bytes
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                return await body_too_large(limit)(scope, receive, send)
            received = 0

            async def limited_receive():
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise StarletteHTTPException(413)  # the app's handler answers in OpenAI's body
                return message

            return await self.app(scope, limited_receive, send)
        await self.app(scope, receive, send)


def _usage(n_prompt: int, completion: Completion) -> dict:
    c = len(completion.output_ids)
    return Usage(prompt_tokens=n_prompt, completion_tokens=c, total_tokens=n_prompt + c).model_dump()


def _extensions(req: SamplingRequest, completion: Completion) -> dict:
    info = completion.info.model_copy(update={"token_ids": completion.output_ids if req.return_token_ids else None})
    out = {"blockpilot": info.model_dump(exclude_none=True)}
    if req.return_meta_info:  # SGLang's field, read by `dflash benchmark openai`
        out["meta_info"] = {"spec_accept_length": completion.info.tau, "spec_verify_ct": completion.info.steps,
                            "completion_tokens": len(completion.output_ids)}
    return out


async def wait_disconnect(request: Request) -> None:
    """Return when the client of ``request`` has gone away (its body already read; ASGI ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _template_parameters(tokenizer) -> set[str]:
    """The named parameters of ``tokenizer.apply_chat_template`` (not template variables)."""
    try:
        return {n for n, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    except (TypeError, ValueError, AttributeError):
        return set()


def create_app(engine: Engine, options: ServeOptions | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` behind ``options``' guards (default ``ServeOptions()``: loopback Host names
    only, no API key). Starting on a non-loopback ``options.host`` without an API key logs a warning naming
    ``serve.api_key``.

    On shutdown (the ASGI lifespan) it cancels admitted requests that are still waiting or running (uvicorn has
    already let connections finish, up to ``serve.shutdown_timeout_s``), waits for the worker and flushes the
    recorder (``engine.drain``): uvicorn re-raises SIGTERM/SIGINT after a graceful shutdown, so code after
    ``uvicorn.run`` may never run. The caller still owns the engine (``engine.close()``)."""
    options = options or ServeOptions()
    if not is_loopback(options.host) and not options.api_key:
        log.warning("serve.host=%s is reachable from other machines and serve.api_key is not set (nor %s): anyone who "
                    "can reach the port can use this server; set serve.api_key", options.host, API_KEY_ENV)
    if options.allowed_hosts is None and _host_name(options.host) in ("0.0.0.0", "::", ""):
        log.warning("serve.host=%s listens on every interface, but only Host headers %s are accepted: list the names "
                    "clients use in serve.allowed_hosts (['*'] accepts any)", options.host, list(options.hosts))
    reserved = _template_parameters(engine.tokenizer) - {"chat_template"}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        cancelled = engine.cancel_all()
        if cancelled:
            log.info("shutdown: cancelled %d unfinished request(s)", cancelled)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while engine.in_flight and loop.time() < deadline:  # each finishing request queues its recording first
            await asyncio.sleep(0.02)
        await loop.run_in_executor(None, engine.drain)
        if engine.recorder is not None:
            log.info("recorder: %s", engine.recorder.stats())

    app = FastAPI(title="BlockPilot", summary="DFlash speculative decoding with a per-request block size, OpenAI API",
                  lifespan=lifespan)
    app.state.engine, app.state.options = engine, options
    app.add_middleware(GuardMiddleware, options=options)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            error = (first.get("ctx") or {}).get("error", "")
            position = first.get("loc", ("body", "?"))[-1]
            return error_response(400, f"the request body is not valid JSON ({error} at character {position})")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", "invalid request"))
        return error_response(400, message, param=where or None)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return error_response(exc.status, str(exc), param=exc.param, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status, headers, code = exc.status_code, getattr(exc, "headers", None), None
        if status == 404:
            message, code = f"Invalid URL ({request.method} {request.url.path})", "not_found"
        elif status == 405:
            allowed = (headers or {}).get("Allow", "")
            message, code = f"method {request.method} is not allowed on {request.url.path} (allowed: {allowed})", \
                "method_not_allowed"
        elif status == 413:
            return body_too_large(options.max_body_bytes)
        elif status == 400 and exc.__cause__ is not None:
            cause = exc.__cause__
            if isinstance(cause, RecursionError):
                message = "the request body's JSON is nested too deeply"
            elif isinstance(cause, UnicodeDecodeError):
                message = f"the request body is not valid UTF-8 ({cause.reason} at byte {cause.start})"
            else:
                message = f"the request body could not be parsed as JSON: {cause}"
        else:
            message = str(exc.detail)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return error_response(status, message, kind=kind, code=code, headers=headers)

    @app.exception_handler(Exception)
    async def _crashed(request: Request, exc: Exception):
        log.exception("request %s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")

    @app.get("/health")
    async def health():
        recorder = engine.recorder.stats() if engine.recorder is not None else None
        running = engine.running
        return {"status": "ok", "in_flight": engine.in_flight, "running": running,
                "waiting": max(0, engine.in_flight - running), "served": engine.served, "failed": engine.failed,
                "aborted": engine.aborted, "recorder": recorder, "forward_path": engine.decoder.forward_path()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0, "owned_by": "blockpilot"}]}

    def check_request(req: SamplingRequest) -> None:
        """Checks that need no tokenisation: the model, unsupported fields, the block size."""
        if req.model != engine.model_name:
            raise RequestError(f"model {req.model!r} is not served here; this server serves {engine.model_name!r} "
                               "(GET /v1/models)", status=404, param="model", code="model_not_found")
        req.check_supported()
        engine.check_block_size(req.block_size)

    def check_prompt_chars(n: int, param: str) -> None:
        if n > options.max_prompt_chars:
            raise RequestError(f"the prompt has {n} characters, above this server's limit of {options.max_prompt_chars} "
                               "(serve.max_prompt_chars): shorten it", param=param, code="context_length_exceeded")

    def make_job(req: SamplingRequest, input_ids, request_id: str) -> Job:
        n = int(input_ids.shape[-1])
        if n == 0:
            raise RequestError("the prompt is empty after tokenization: send some text", param="prompt")
        config = engine.decode_config(n, req.token_limit, req.temperature, req.seed)
        return Job(request_id, input_ids, config, list(req.stop or []), req.block_size)

    async def run_watched(request: Request, job: Job) -> Completion:
        """``engine.run(job)``, cancelling the job when the client goes away (or this handler is cancelled)."""
        task = asyncio.ensure_future(engine.run(job))
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                log.info("request %s: the client went away; aborting its decode", job.request_id)
                job.cancelled.set()
            return await task
        finally:
            watcher.cancel()
            if not task.done():
                job.cancelled.set()

    async def respond(request: Request, req: SamplingRequest, job: Job, chat: bool):
        obj = "chat.completion" if chat else "text_completion"
        n_prompt = int(job.input_ids.shape[-1])
        if not req.stream:
            try:
                completion = await run_watched(request, job)
            except QueueFull as err:
                return error_response(503, str(err), kind="server_overloaded", code="queue_full")
            except JobCancelled as err:
                return error_response(499, str(err), code="client_closed_request")  # nobody is listening
            except Exception as err:  # noqa: BLE001 - one failed decode must not stop the server
                log.exception("request %s failed", job.request_id)
                return error_response(500, f"decoding failed: {err}", kind="server_error")
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": completion.text},
                          "finish_reason": completion.finish_reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": completion.text, "finish_reason": completion.finish_reason, "logprobs": None}
            return {"id": job.request_id, "object": obj, "created": now(), "model": engine.model_name,
                    "choices": [choice], "usage": _usage(n_prompt, completion), **_extensions(req, completion)}
        if engine.full():  # refuse before the 200 of a stream is sent
            return error_response(503, engine.full_message(),
                                  kind="server_overloaded", code="queue_full")
        return StreamingResponse(stream_events(request, req, job, chat, n_prompt), media_type="text/event-stream")

    async def stream_events(request: Request, req: SamplingRequest, job: Job, chat: bool, n_prompt: int) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = now()
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        job.on_text = lambda text: loop.call_soon_threadsafe(deltas.put_nowait, text)

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {"id": job.request_id, "object": obj, "created": created, "model": engine.model_name, "choices": [choice]}

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        task = asyncio.ensure_future(engine.run(job))
        watcher = asyncio.ensure_future(wait_disconnect(request))
        watcher.add_done_callback(lambda w: w.cancelled() or job.cancelled.set())  # the client went away while queued
        try:
            if chat:
                yield event(chunk("", role=True))
            while True:
                getter = asyncio.ensure_future(deltas.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield event(chunk(getter.result()))
                    continue
                getter.cancel()
                while not deltas.empty():
                    yield event(chunk(deltas.get_nowait()))
                break
            try:
                completion = task.result()
            except QueueFull as err:
                yield event({"error": {"message": str(err), "type": "server_overloaded", "param": None, "code": "queue_full"}})
            except JobCancelled as err:
                yield event({"error": {"message": str(err), "type": "invalid_request_error", "param": None,
                                       "code": "client_closed_request"}})
            except Exception as err:  # noqa: BLE001
                log.exception("request %s failed", job.request_id)
                yield event({"error": {"message": f"decoding failed: {err}", "type": "server_error", "param": None, "code": None}})
            else:
                final = chunk(None if chat else "", completion.finish_reason) | _extensions(req, completion)
                if req.stream_options is not None and req.stream_options.include_usage:
                    final["usage"] = _usage(n_prompt, completion)
                yield event(final)
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            job.cancelled.set()  # the client went away (or we are done): stop decoding after this step
            if not task.done():
                await asyncio.wait({task})
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a cancelled job's JobCancelled is expected

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_request(req)
        if req.tools:
            raise RequestError("tools are not supported; omit tools", param="tools")
        kwargs = dict(req.chat_template_kwargs or {})
        template = req.chat_template if req.chat_template is not None else kwargs.pop("chat_template", None)
        kwargs.pop("chat_template", None)
        if template is not None:
            if not options.allow_request_chat_template:
                raise RequestError("a request's own chat_template is refused: it would run on this server. Omit it (the "
                                   "model's template is used), or start the server with "
                                   "serve.allow_request_chat_template=true for trusted clients", param="chat_template")
            kwargs["chat_template"] = str(template)
        clash = sorted(set(kwargs) & reserved)
        if clash:
            raise RequestError(f"chat_template_kwargs may hold template variables only (e.g. enable_thinking), not "
                               f"{clash}", param="chat_template_kwargs")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        if not any(m["content"].strip() for m in messages):
            raise RequestError("every message is empty: send some text", param="messages")
        check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        try:  # off the event loop: a long prompt or a slow template must not stall other requests
            input_ids = await run_in_threadpool(messages_input_ids, engine.tokenizer, messages, **kwargs)
        except Exception as err:  # noqa: BLE001 - a template error is the request's fault
            raise RequestError(f"the chat template rejected these messages: {err}", param="messages") from err
        return await respond(request, req, make_job(req, input_ids, new_id("chatcmpl")), chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_request(req)
        if req.echo or req.suffix:
            raise RequestError("echo and suffix are not supported; omit them", param="echo" if req.echo else "suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError(f"one prompt per request (batch 1); got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty: send some text", param="prompt")
            check_prompt_chars(len(prompt), "prompt")
            encoded = await run_in_threadpool(engine.tokenizer, prompt, return_tensors="pt")
            input_ids = encoded["input_ids"].reshape(1, -1)
        else:
            if len(prompt) > engine.decoder.max_context:
                raise RequestError(f"the prompt has {len(prompt)} tokens; this model's context is "
                                   f"{engine.decoder.max_context} tokens: shorten the prompt", param="prompt",
                                   code="context_length_exceeded")
            vocab = engine.decoder.lm_head.shape[0]
            if any(not 0 <= int(t) < vocab for t in prompt):
                raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            input_ids = torch.tensor([list(prompt)], dtype=torch.long)
        return await respond(request, req, make_job(req, input_ids, new_id("cmpl")), chat=False)

    return app
