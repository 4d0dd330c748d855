"""The server's guards in front of every route: allowed Host names, the API key, the body limit, OpenAI's error body.

``ServeOptions`` holds them (``conf/serve.yaml``'s ``serve.*``); ``GuardMiddleware`` applies them to every request
before a route runs: a Host header outside ``serve.allowed_hosts`` gets 400 (DNS rebinding), a ``/v1`` request
without ``Authorization: Bearer <serve.api_key>`` 401, a body over ``serve.max_body_bytes`` 413; every error uses
OpenAI's body (``error_response``).
"""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

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
        self.hosts = tuple(host_name(str(h)) for h in names if str(h))


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or name) reaches only this machine."""
    if host_name(host) == "localhost":
        return True
    try:
        return ipaddress.ip_address(host_name(host)).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
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
