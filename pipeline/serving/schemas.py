"""The OpenAI request/response schema the server speaks (the subset the decoder can honour).

Requests accept the usual fields of ``/v1/chat/completions`` and ``/v1/completions``; fields this server
cannot honour (``n`` > 1, ``top_p`` < 1, ``top_k`` > 0, ``logprobs``/``top_logprobs``, tools, ``response_format``,
penalties, ``logit_bias``, ``best_of`` > 1, ...: ``UNSUPPORTED``) are refused with a 400 naming the field, instead of
being silently ignored; their no-op values (``presence_penalty: 0``, ``response_format: {"type": "text"}``, ...) are
accepted. Other unknown fields are ignored. ``seed`` is any 64-bit integer (signed or unsigned). Two extension fields:
``block_size`` (request: force a fixed B for this request, overriding the configured policy) and
``blockpilot`` (response: the B chosen, tau and steps, see ``DecodeInfo``); with ``return_meta_info``
(SGLang's field, sent by ``dflash benchmark openai``) the response also carries ``meta_info`` with
``spec_accept_length`` (tau) and ``spec_verify_ct`` (verify steps).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_CHARS = 256
"""The longest stop string accepted (characters)."""

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
"""``seed`` may be any signed or unsigned 64-bit integer."""

UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "response_format": (({"type": "text"},), 'omit it or send {"type": "text"}: output is never constrained'),
    "presence_penalty": ((0, 0.0), "omit it or send 0: sampling draws from the model's own distribution"),
    "frequency_penalty": ((0, 0.0), "omit it or send 0: sampling draws from the model's own distribution"),
    "repetition_penalty": ((1, 1.0), "omit it or send 1: sampling draws from the model's own distribution"),
    "logit_bias": (({},), "omit it: logits are not biased"),
    "tool_choice": (("none",), 'omit it or send "none": tools are not supported'),
    "functions": (([],), "omit it: function calling is not supported"),
    "function_call": (("none",), 'omit it or send "none": function calling is not supported'),
    "best_of": ((1,), "omit it or send 1: one sequence per request"),
    "top_logprobs": ((0,), "omit it: logprobs are not supported"),
    "min_p": ((0, 0.0), "omit it or send 0: sampling draws from the full distribution"),
}
"""Fields this server cannot honour: (the values that change nothing and are accepted, the fix named in the 400).
``None`` (or the field's absence) is always accepted."""


class RequestError(ValueError):
    """A request the server refuses: ``status`` (4xx), ``param`` (the field at fault) and a message naming the fix."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class ChatMessage(BaseModel):
    """One chat message; ``content`` as a string or as OpenAI text parts (``[{"type": "text", "text": ...}]``)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]

    def text(self) -> str:
        """The message text (text parts joined).

        Raises:
            RequestError: for a non-text part (images, audio).
        """
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"only text content parts are supported, got type {part.get('type')!r}", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints.

    Attributes:
        max_tokens: cap on generated tokens (default: the server's ``serve.default_max_tokens``).
        temperature: 0 (greedy) to 2; position-keyed sampling, so the text does not depend on B. Omitted: the
            server's ``decode.temperature`` (0 by default, where OpenAI's default is 1).
        seed: sampling seed (default: ``decode.seed``); ignored at temperature 0.
        stop: up to 4 stop strings of at most ``MAX_STOP_CHARS`` characters; the text ends before the first one
            (finish_reason ``stop``).
        block_size: extension: force this fixed B for the request.
        return_token_ids: extension: add the output token ids to ``blockpilot.token_ids``.
    """

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    user: str | None = None
    block_size: int | None = Field(default=None, ge=1)
    return_token_ids: bool = False
    return_meta_info: bool = False
    response_format: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    best_of: Any = None
    top_logprobs: Any = None
    min_p: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):  # each streamed token checks every stop prefix: O(length^2)
            raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters")
        return stops

    def check_supported(self) -> None:
        """Raise ``RequestError`` for a field this server cannot honour (see the module docstring)."""
        if self.n not in (None, 1):
            raise RequestError(f"n={self.n} is not supported: the decoder runs one sequence per request; send n=1", param="n")
        if self.top_p not in (None, 1, 1.0):
            raise RequestError(f"top_p={self.top_p} is not supported: sampling draws from the full distribution "
                               "(position-keyed Gumbel-max); omit top_p or send 1", param="top_p")
        if self.top_k not in (None, 0, -1):
            raise RequestError(f"top_k={self.top_k} is not supported; omit top_k or send 0", param="top_k")
        if self.logprobs not in (None, False, 0):
            raise RequestError("logprobs are not supported; omit logprobs", param="logprobs")
        for name, (accepted, fix) in UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted):
                raise RequestError(f"{name}={value!r} is not supported by this server; {fix}", param=name)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``; ``chat_template_kwargs`` go to the tokenizer's chat template as template variables
    (e.g. ``enable_thinking``). A request's own template (``chat_template``, top level as in vLLM or inside
    ``chat_template_kwargs``) is refused unless the server allows it (``serve.allow_request_chat_template``)."""

    messages: list[ChatMessage]
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None
    tools: list | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value):
        if not value:
            raise ValueError("messages is empty: send at least one message, e.g. [{\"role\": \"user\", \"content\": \"Hi\"}]")
        return value


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a one-element list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None


class DecodeInfo(BaseModel):
    """The ``blockpilot`` extension of a response.

    Attributes:
        policy: the schedule that chose B (``fixed``, ``ar``, ``blockpilot``, ``ema``, or ``request`` for a
            request's own ``block_size``).
        block_size: B of the first step (the policy's choice after prefill); block_sizes: every B used.
        tau: mean acceptance length (tokens per verify step); steps: verify steps.
        prefill_ms, schedule_ms, decode_ms, queue_ms: wall times (ms); queue_ms is the wait before decoding.
        verify_widths: how many steps verified k drafts, by k (``{"0": plain steps, "3": ...}``; k = B-1 unless a
            verify-width or budget policy chose fewer).
        token_ids: the output token ids (with ``return_token_ids``).
    """

    policy: str
    block_size: int
    block_sizes: list[int]
    tau: float
    steps: int
    prefill_ms: float
    schedule_ms: float
    decode_ms: float
    queue_ms: float
    verify_widths: dict[str, int] = {}
    token_ids: list[int] | None = None

    @classmethod
    def of(cls, stats, policy: str, block_size: int, queue_ms: float) -> "DecodeInfo":
        """The extension of a finished request from its ``RequestStats`` (the policy's name, its first B, the ms it
        waited in the queue)."""
        widths: dict[str, int] = {}
        for k in stats.verify_widths:
            widths[str(int(k))] = widths.get(str(int(k)), 0) + 1
        return cls(policy=policy, block_size=int(block_size), block_sizes=sorted(set(stats.block_sizes)), tau=stats.tau,
                   steps=len(stats.taus), prefill_ms=stats.prefill_ms, schedule_ms=stats.schedule_ms,
                   decode_ms=stats.decode_ms, queue_ms=queue_ms, verify_widths=dict(sorted(widths.items(), key=lambda t: int(t[0]))))


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``: ``cached_tokens``, the prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """OpenAI's ``usage``; ``prompt_tokens_details`` only when some prompt tokens came from the prefix cache (vLLM's)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


def new_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
