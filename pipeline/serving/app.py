"""The OpenAI-compatible FastAPI app over an ``Engine``: guards, error bodies, routes, shutdown.

Where things are: the routes (``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``,
``/metrics``) in ``pipeline.serving.routes``, the ``/metrics`` series in ``pipeline.serving.metrics``; the guards
every request passes first (allowed Host names, the API key, the body limit) in ``pipeline.serving.guards``; the
request and response bodies in ``pipeline.serving.schemas``; the engine in ``pipeline.serving.engine``. This module
assembles them (``create_app``) and maps every error to OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``: 400 for bad input (validation errors, malformed JSON, invalid UTF-8, nesting too deep, unsupported fields,
a request's own chat template, a Host header not in ``allowed_hosts``), 401 for a missing or wrong API key, 404 for an
unknown model or path, 405 for a wrong method, 413 for a body over ``max_body_bytes``, 400 for a request whose prompt and
``max_tokens`` need more KV cache than ``serve.kv_cache_mb`` (code ``kv_cache_exceeded``), 503 with ``Retry-After`` when
the queue is full, 500 when a decode fails (the server keeps serving). On shutdown every admitted request finishes or
ends with ``finish_reason`` ``abort`` (told it was cut).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.serving.engine import Engine
from pipeline.serving.guards import (API_KEY_ENV, GuardMiddleware, ServeOptions, body_too_large, host_name,
                                     error_response, is_loopback)
from pipeline.serving.metrics import ServeMetrics
from pipeline.serving.routes import router
from pipeline.serving.schemas import RequestError

log = logging.getLogger(__name__)


def _template_parameters(tokenizer) -> set[str]:
    """The named parameters of ``tokenizer.apply_chat_template`` (not template variables)."""
    try:
        return {n for n, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    except (TypeError, ValueError, AttributeError):
        return set()


def add_error_handlers(app: FastAPI, options: ServeOptions) -> None:
    """Answer every error in OpenAI's body (see the module doc)."""

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
    if options.allowed_hosts is None and host_name(options.host) in ("0.0.0.0", "::", ""):
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
    app.state.engine, app.state.options, app.state.reserved = engine, options, reserved
    app.state.metrics = ServeMetrics(engine.model_name)  # its own registry: apps in one process do not clash
    engine.listeners.append(app.state.metrics.observe)
    app.add_middleware(GuardMiddleware, options=options)
    add_error_handlers(app, options)
    app.include_router(router)
    return app
