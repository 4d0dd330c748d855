"""The OpenAI-compatible routes over an ``Engine`` (``request.app.state.engine``; the app is ``pipeline.serving.app``).

``GET /health``, ``GET /metrics`` (Prometheus text, vLLM's names: ``pipeline.serving.metrics``), ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as server-sent events: one ``data: {chunk}`` per
text delta, the first sent with the first token and carrying the chat role, then a final chunk with
``finish_reason``, the ``blockpilot`` extension, vLLM's ``metrics.speculative_decoding`` and, with
``stream_options.include_usage``, ``usage``; then ``data: [DONE]``). A request is checked (``check_request``:
the model, unsupported fields, the block size; ``check_prompt_chars``), tokenised off the event loop, turned into a
``Job`` (``make_job``) and answered by ``respond``; a client that goes away (streaming or not) stops its decode after
the current step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from pipeline.prompts import messages_input_ids
from pipeline.serving.engine import Completion, Engine, Job, JobCancelled, QueueFull
from pipeline.serving.guards import ServeOptions, error_response
from pipeline.serving.metrics import resident_memory, speculative_decoding
from pipeline.serving.schemas import (ChatCompletionRequest, CompletionRequest, PromptTokensDetails, RequestError,
                                      SamplingRequest, Usage, new_id, now)

log = logging.getLogger(__name__)
router = APIRouter()


def _usage(n_prompt: int, completion: Completion) -> dict:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens`` (the prompt tokens taken from the prefix cache) only
    when there are some, as vLLM reports it."""
    c = len(completion.output_ids)
    cached = int(completion.stats.cached_tokens)
    details = PromptTokensDetails(cached_tokens=cached) if cached else None
    return Usage(prompt_tokens=n_prompt, completion_tokens=c, total_tokens=n_prompt + c,
                 prompt_tokens_details=details).model_dump(exclude_none=True)


def _extensions(req: SamplingRequest, completion: Completion) -> dict:
    info = completion.info.model_copy(update={"token_ids": completion.output_ids if req.return_token_ids else None})
    out = {"blockpilot": info.model_dump(exclude_none=True),
           "metrics": {"speculative_decoding": speculative_decoding(completion.stats)}}  # vLLM's per-request object
    if req.return_meta_info:  # SGLang's field, read by `dflash benchmark openai`
        out["meta_info"] = {"spec_accept_length": completion.info.tau, "spec_verify_ct": completion.info.steps,
                            "completion_tokens": len(completion.output_ids)}
    return out


async def wait_disconnect(request: Request) -> None:
    """Return when the client of ``request`` has gone away (its body already read; ASGI ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.get("/health")
async def health(request: Request):
    """The process's resident memory (bytes now, and the most since the server was loaded and warmed), the engine's
    counters, the recorder's, the prefix cache's (bytes, entries, queries, hits; null when off) and the forward path."""
    engine = request.app.state.engine
    recorder = engine.recorder.stats() if engine.recorder is not None else None
    prefixes = getattr(engine.decoder, "prefix_cache", None)
    running = engine.running
    resident, peak = resident_memory()  # bytes now and the most since the server was warmed (None off Linux)
    return {"status": "ok", "resident_bytes": resident, "peak_resident_bytes": peak, "in_flight": engine.in_flight,
            "running": running,
            "waiting": max(0, engine.in_flight - running), "served": engine.served, "failed": engine.failed,
            "aborted": engine.aborted, "recorder": recorder,
            "prefix_cache": prefixes.stats() if prefixes is not None else None, "forward_path": engine.forward_path,
            "max_batch": engine.max_batch, "kv_cache": {"budget_bytes": engine.kv_budget,
                                                        "reserved_bytes": engine.scheduler.kv_reserved}}


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus text in vLLM's names (``pipeline.serving.metrics``), what ``vllm bench serve`` and AIPerf scrape."""
    engine = request.app.state.engine
    running = engine.running
    body, content_type = request.app.state.metrics.render(running, max(0, engine.in_flight - running),
                                                          getattr(engine.decoder, "prefix_cache", None))
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def models(request: Request):
    engine = request.app.state.engine
    return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0, "owned_by": "blockpilot"}]}


def check_request(engine: Engine, req: SamplingRequest) -> None:
    """Checks that need no tokenisation: the model, unsupported fields, the block size."""
    if req.model != engine.model_name:
        raise RequestError(f"model {req.model!r} is not served here; this server serves {engine.model_name!r} "
                           "(GET /v1/models)", status=404, param="model", code="model_not_found")
    req.check_supported()
    engine.check_block_size(req.block_size)


def check_prompt_chars(options: ServeOptions, n: int, param: str) -> None:
    if n > options.max_prompt_chars:
        raise RequestError(f"the prompt has {n} characters, above this server's limit of {options.max_prompt_chars} "
                           "(serve.max_prompt_chars): shorten it", param=param, code="context_length_exceeded")


def make_job(engine: Engine, req: SamplingRequest, input_ids, request_id: str) -> Job:
    n = int(input_ids.shape[-1])
    if n == 0:
        raise RequestError("the prompt is empty after tokenization: send some text", param="prompt")
    config = engine.decode_config(n, req.token_limit, req.temperature, req.seed)
    return Job(request_id, input_ids, config, list(req.stop or []), req.block_size)


async def run_watched(request: Request, job: Job) -> Completion:
    """``engine.run(job)``, cancelling the job when the client goes away (or this handler is cancelled)."""
    engine = request.app.state.engine
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
    """The answer to a checked request: its completion, or a stream of server-sent events."""
    engine = request.app.state.engine
    obj = "chat.completion" if chat else "text_completion"
    n_prompt = int(job.input_ids.shape[-1])
    if not req.stream:
        try:
            completion = await run_watched(request, job)
        except QueueFull as err:
            return overloaded(engine, str(err))
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
        return overloaded(engine, engine.full_message())
    return StreamingResponse(stream_events(request, req, job, chat, n_prompt), media_type="text/event-stream")


def overloaded(engine: Engine, message: str):
    """503 with ``Retry-After`` (seconds, ``Engine.retry_after_s``): every slot and queue place is taken."""
    return error_response(503, message, kind="server_overloaded", code="queue_full",
                          headers={"Retry-After": str(engine.retry_after_s())})


async def stream_events(request: Request, req: SamplingRequest, job: Job, chat: bool, n_prompt: int) -> AsyncIterator[str]:
    """A streamed completion: one ``data: {chunk}`` per text delta, a final chunk, then ``data: [DONE]``."""
    engine = request.app.state.engine
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
    first = True  # the first chunk goes out with the first token (vLLM's), the role riding on it: TTFT tools time it

    def delta_event(text: str) -> str:
        nonlocal first
        out, first = event(chunk(text, role=first)), False
        return out

    try:
        while True:
            getter = asyncio.ensure_future(deltas.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield delta_event(getter.result())
                continue
            getter.cancel()
            while not deltas.empty():
                yield delta_event(deltas.get_nowait())
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
            final = chunk(None if chat else "", completion.finish_reason, role=first) | _extensions(req, completion)
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


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    engine, options = request.app.state.engine, request.app.state.options
    check_request(engine, req)
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
    clash = sorted(set(kwargs) & request.app.state.reserved)
    if clash:
        raise RequestError(f"chat_template_kwargs may hold template variables only (e.g. enable_thinking), not "
                           f"{clash}", param="chat_template_kwargs")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    if not any(m["content"].strip() for m in messages):
        raise RequestError("every message is empty: send some text", param="messages")
    check_prompt_chars(options, sum(len(m["content"]) for m in messages), "messages")
    try:  # off the event loop: a long prompt or a slow template must not stall other requests
        input_ids = await run_in_threadpool(messages_input_ids, engine.tokenizer, messages, **kwargs)
    except Exception as err:  # noqa: BLE001 - a template error is the request's fault
        raise RequestError(f"the chat template rejected these messages: {err}", param="messages") from err
    return await respond(request, req, make_job(engine, req, input_ids, new_id("chatcmpl")), chat=True)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    engine, options = request.app.state.engine, request.app.state.options
    check_request(engine, req)
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
        check_prompt_chars(options, len(prompt), "prompt")
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
    return await respond(request, req, make_job(engine, req, input_ids, new_id("cmpl")), chat=False)

