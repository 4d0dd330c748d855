"""The OpenAI-compatible FastAPI app over an ``Engine``.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as
server-sent events: one ``data: {chunk}`` per text delta, then a final chunk with ``finish_reason``,
the ``blockpilot`` extension and, with ``stream_options.include_usage``, ``usage``; then
``data: [DONE]``), and ``GET /health``. Errors use OpenAI's body ``{"error": {"message", "type",
"param", "code"}}``: 400 for bad input (validation errors included), 404 for an unknown model, 503
when the queue is full, 500 when a decode fails (the server keeps serving).
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from pipeline.prompts import messages_input_ids
from pipeline.serving.engine import Completion, Engine, Job, QueueFull
from pipeline.serving.schemas import (ChatCompletionRequest, CompletionRequest, RequestError, SamplingRequest, Usage,
                                      new_id, now)

log = logging.getLogger(__name__)


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """An OpenAI-style error body with ``status``."""
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": code}})


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


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app serving ``engine``. On shutdown (the ASGI lifespan) it waits for queued work and flushes the
    recorder (``engine.drain``): uvicorn re-raises SIGTERM/SIGINT after a graceful shutdown, so code after
    ``uvicorn.run`` may never run. The caller still owns the engine (``engine.close()``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.drain)
        if engine.recorder is not None:
            log.info("recorder: %s", engine.recorder.stats())

    app = FastAPI(title="BlockPilot", summary="DFlash speculative decoding with a per-request block size, OpenAI API",
                  lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", "invalid request"))
        return error_response(400, message, param=where or None)

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return error_response(exc.status, str(exc), param=exc.param, code=exc.code)

    @app.get("/health")
    async def health():
        recorder = engine.recorder.stats() if engine.recorder is not None else None
        return {"status": "ok", "in_flight": engine.in_flight, "served": engine.served, "failed": engine.failed,
                "recorder": recorder}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0, "owned_by": "blockpilot"}]}

    def check_model(req: SamplingRequest) -> None:
        if req.model != engine.model_name:
            raise RequestError(f"model {req.model!r} is not served here; this server serves {engine.model_name!r} "
                               "(GET /v1/models)", status=404, param="model", code="model_not_found")

    def make_job(req: SamplingRequest, input_ids, request_id: str) -> Job:
        req.check_supported()
        engine.check_block_size(req.block_size)
        n = int(input_ids.shape[-1])
        if n == 0:
            raise RequestError("the prompt is empty after tokenization: send some text", param="prompt")
        config = engine.decode_config(n, req.token_limit, req.temperature, req.seed)
        return Job(request_id, input_ids, config, list(req.stop or []), req.block_size)

    async def respond(req: SamplingRequest, job: Job, chat: bool):
        obj = "chat.completion" if chat else "text_completion"
        n_prompt = int(job.input_ids.shape[-1])
        if not req.stream:
            try:
                completion = await engine.run(job)
            except QueueFull as err:
                return error_response(503, str(err), kind="server_overloaded", code="queue_full")
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
        if engine.in_flight >= 1 + engine.max_queue:  # refuse before the 200 of a stream is sent
            return error_response(503, f"the queue is full ({engine.max_queue} waiting + 1 running); retry later",
                                  kind="server_overloaded", code="queue_full")
        return StreamingResponse(stream_events(req, job, chat, n_prompt), media_type="text/event-stream")

    async def stream_events(req: SamplingRequest, job: Job, chat: bool, n_prompt: int) -> AsyncIterator[str]:
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
            job.cancelled.set()  # the client went away (or we are done): stop decoding after this step
            if not task.done():
                await asyncio.wait({task})

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        check_model(req)
        if req.tools:
            raise RequestError("tools are not supported; omit tools", param="tools")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        if not any(m["content"].strip() for m in messages):
            raise RequestError("every message is empty: send some text", param="messages")
        try:
            input_ids = messages_input_ids(engine.tokenizer, messages, **(req.chat_template_kwargs or {}))
        except Exception as err:  # noqa: BLE001 - a template error is the request's fault
            raise RequestError(f"the chat template rejected these messages: {err}", param="messages") from err
        return await respond(req, make_job(req, input_ids, new_id("chatcmpl")), chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req)
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
            input_ids = engine.tokenizer(prompt, return_tensors="pt")["input_ids"].reshape(1, -1)
        else:
            vocab = engine.decoder.lm_head.shape[0]
            if any(not 0 <= int(t) < vocab for t in prompt):
                raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            input_ids = torch.tensor([list(prompt)], dtype=torch.long)
        return await respond(req, make_job(req, input_ids, new_id("cmpl")), chat=False)

    return app
