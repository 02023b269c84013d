"""`AccessGuard`: what an HTTP request must pass before the API sees it (pure ASGI, so streams are untouched).

    app = AccessGuard(app, GuardSettings(api_key="sk-...", allowed_hosts=LOOPBACK_HOSTS))

In order: the headers themselves (at most `max_headers`, 431; Host, Authorization, Origin, Content-Type and
Content-Length at most once each, 400), the Host header (when `allowed_hosts` is set: a server bound to loopback
answers only to loopback names, so a page that rebinds its own domain's DNS to 127.0.0.1 cannot drive it), the
Origin header (a browser names the page's origin on every cross-origin request; none is allowed unless listed,
character for character, and listed origins get CORS headers), the API key (`Authorization: Bearer KEY`,
compared in constant time; /health is open, /metrics too when `metrics_public`), a JSON content type on POSTs (a
cross-origin form or `text/plain` POST needs no CORS preflight: refusing it closes that door), and the body: at
most `max_request_bytes` (413 from Content-Length alone, before reading), at most `max_body_commas` commas (400
as soon as they arrive) and read within `body_timeout` seconds (408). The body is read here and replayed to the
app. Every refusal is OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass, field

from .limits import shown
from .protocol import error_body

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# Seconds a client has to send its whole body (a slow-body client holds a connection and a task meanwhile).
DEFAULT_BODY_TIMEOUT_S = 30.0
# Headers a request may have (their bytes are bounded before this, by the server's HTTP protocol).
DEFAULT_MAX_HEADERS = 100
# Headers a request must not repeat: each decides who is asking or what the body is.
SINGLE_HEADERS = ("host", "authorization", "origin", "content-type", "content-length")


@dataclass(frozen=True)
class GuardSettings:
    """api_key: None (no key needed) or the key clients send as a bearer token; metrics_public: /metrics without
    the key; allowed_origins: browser origins allowed to call the API ("*": any); allowed_hosts: Host header names
    answered (None: any); max_request_bytes: the largest body (None: DEFAULT_MAX_REQUEST_BYTES; `build_app` lowers
    it to what its request limits allow); body_timeout: seconds to receive it; max_headers: the most headers a
    request may have; max_body_commas: the most commas a body may hold (None: any), counted as it arrives
    (`limits.RequestLimits.max_commas`: a body of token ids past the context is refused before the rest of it is
    read)."""

    api_key: str | None = None
    metrics_public: bool = False
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] | None = None
    max_request_bytes: int | None = None
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    max_headers: int = DEFAULT_MAX_HEADERS
    max_body_commas: int | None = None
    open_paths: frozenset[str] = field(default=frozenset({"/health"}))


class Refusal(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class AccessGuard:
    def __init__(self, app, settings: GuardSettings):
        self.app, self.settings = app, settings
        self.key = settings.api_key.encode() if settings.api_key else None
        self.any_origin = "*" in settings.allowed_origins

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        try:
            self._check_headers(scope["headers"], headers)
            self._check_host(headers.get("host"))
            origin = headers.get("origin")
            self._check_origin(origin)
            if scope["method"] == "OPTIONS" and origin is not None:   # a CORS preflight: no key, no body
                return await self._preflight(origin, headers, send)
            self._check_key(scope["path"], headers.get("authorization"))
            if scope["method"] == "POST":
                self._check_json(headers.get("content-type"))
                receive = await self._read_body(headers.get("content-length"), receive)
        except Refusal as refusal:
            return await self._refuse(refusal, origin=headers.get("origin"), send=send)
        if headers.get("origin") is not None:
            send = self._with_cors(send, headers["origin"])
        return await self.app(scope, receive, send)

    # ---- checks ---------------------------------------------------------------------------------------
    def _check_headers(self, raw: list, headers: dict) -> None:
        """At most `max_headers`, and each of SINGLE_HEADERS at most once (with two, which one counts would be up
        to whoever reads them: a proxy may have checked the first, this guard would read the last)."""
        if len(raw) > self.settings.max_headers:
            raise Refusal(431, f"the request has {len(raw)} headers; this server reads at most "
                               f"{self.settings.max_headers}.", code="request_header_fields_too_large")
        if len(headers) < len(raw):
            names = [name.decode("latin-1").lower() for name, _ in raw]
            twice = sorted({name for name in SINGLE_HEADERS if names.count(name) > 1})
            if twice:
                raise Refusal(400, f"the request has more than one {', '.join(twice)} header; send each once.",
                              code="duplicate_header")

    def _check_host(self, host: str | None) -> None:
        allowed = self.settings.allowed_hosts
        if allowed is None:
            return
        name = _host_name(host or "")
        if name not in allowed:
            raise Refusal(403, f"Host {shown(host or '')!r} is not a name of this server (it answers to "
                               f"{', '.join(allowed)}); a proxy in front of it must pass one of them.",
                          code="host_not_allowed")

    def _check_origin(self, origin: str | None) -> None:
        if origin is None or self.any_origin or origin in self.settings.allowed_origins:
            return
        raise Refusal(403, f"cross-origin requests from {shown(origin)!r} are not allowed (start the server with "
                           "--allowed-origins to allow a browser origin).", code="origin_not_allowed")

    def _check_key(self, path: str, authorization: str | None) -> None:
        if self.key is None or path in self.settings.open_paths or (
                path == "/metrics" and self.settings.metrics_public):
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
            raise Refusal(401, "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.",
                          code="invalid_api_key", headers={"www-authenticate": "Bearer"})

    @staticmethod
    def _check_json(content_type: str | None) -> None:
        media_type = (content_type or "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise Refusal(415, f"Content-Type {shown(content_type or 'none')!r}: the API reads JSON bodies; send "
                               "`Content-Type: application/json`.", code="unsupported_media_type")

    async def _read_body(self, content_length: str | None, receive):
        """The whole body within the limits -> a `receive` that replays it, then passes the rest through."""
        limit = self.settings.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES
        if content_length is not None:
            if not content_length.isdigit():
                raise Refusal(400, f"Content-Length {shown(content_length)!r} is not a byte count.")
            if int(content_length) > limit:
                raise Refusal(413, _too_large(int(content_length), limit), code="request_too_large")
        chunks, size, commas, more = [], 0, 0, True
        max_commas = self.settings.max_body_commas
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.body_timeout
        try:
            while more:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
                if message["type"] == "http.disconnect":
                    raise Refusal(400, "the client disconnected before sending its body.")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise Refusal(413, _too_large(size, limit), code="request_too_large")
                if max_commas is not None and (commas := commas + chunk.count(b",")) > max_commas:
                    raise Refusal(400, f"the request body holds more than {max_commas} commas: more values and text "
                                       "than a request to this server can use.", code="context_length_exceeded")
                chunks.append(chunk)
                more = message.get("more_body", False)
        except asyncio.TimeoutError:
            raise Refusal(408, f"the request body did not arrive within {self.settings.body_timeout:g} s.",
                          code="request_timeout") from None
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    # ---- responses ------------------------------------------------------------------------------------
    def _cors_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    def _with_cors(self, send, origin: str):
        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = message | {"headers": list(message.get("headers", [])) + self._cors_headers(origin)}
            await send(message)

        return send_with_cors

    async def _preflight(self, origin: str, headers: dict, send) -> None:
        allow = [(b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                 (b"access-control-allow-headers",
                  headers.get("access-control-request-headers", "authorization, content-type").encode("latin-1")),
                 (b"access-control-max-age", b"600")]
        await send({"type": "http.response.start", "status": 204, "headers": self._cors_headers(origin) + allow})
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, refusal: Refusal, *, origin: str | None, send) -> None:
        body = json.dumps(error_body(refusal.message, code=refusal.code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        headers += [(name.encode(), value.encode()) for name, value in refusal.headers.items()]
        if origin is not None and (self.any_origin or origin in self.settings.allowed_origins):
            headers += self._cors_headers(origin)
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _host_name(host: str) -> str:
    """The name of a Host header without its port ("[::1]:8000" -> "::1")."""
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _too_large(size: int, limit: int) -> str:
    return (f"the request body has {size} bytes; this server reads at most {limit} (--max-request-bytes).")
