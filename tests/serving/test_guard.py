"""`moe_jax.serving.guard.AccessGuard` in front of a tiny ASGI app that echoes the body it was given: the Host, Origin,
API key, content type and body checks, each refusal OpenAI's error object."""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")

from moe_jax.serving.guard import LOOPBACK_HOSTS, AccessGuard, GuardSettings  # noqa: E402

KEY = "sk-test-key"


async def echo(scope, receive, send):
    """Answers 200 with the body it read (so the guard's replay is checked too)."""
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})


def ask(settings: GuardSettings, method: str, path: str, **kwargs) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=AccessGuard(echo, settings))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(run())


def error_of(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


JSON = {"content-type": "application/json"}


def test_without_settings_a_json_post_passes_and_its_body_is_replayed():
    response = ask(GuardSettings(), "POST", "/v1/completions", content=b'{"prompt": "hi"}', headers=JSON)
    assert (response.status_code, response.content) == (200, b'{"prompt": "hi"}')


def test_the_api_key_is_required_except_on_health_and_public_metrics():
    settings = GuardSettings(api_key=KEY)
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"}):
        response = ask(settings, "POST", "/v1/completions", content=b"{}", headers=JSON | headers)
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    good = {"authorization": f"Bearer {KEY}"}
    assert ask(settings, "POST", "/v1/completions", content=b"{}", headers=JSON | good).status_code == 200
    assert ask(settings, "GET", "/health").status_code == 200
    assert ask(settings, "GET", "/v1/models").status_code == 401
    assert ask(settings, "GET", "/metrics").status_code == 401
    assert ask(GuardSettings(api_key=KEY, metrics_public=True), "GET", "/metrics").status_code == 200


def test_posts_must_be_json():
    """A cross-origin `text/plain` or form POST needs no CORS preflight in a browser: it is refused outright."""
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded"):
        headers = {} if content_type is None else {"content-type": content_type}
        response = ask(GuardSettings(), "POST", "/v1/completions", content=b'{"prompt": "a"}', headers=headers)
        assert response.status_code == 415 and error_of(response)["code"] == "unsupported_media_type"
    charset = {"content-type": "application/json; charset=utf-8"}
    assert ask(GuardSettings(), "POST", "/v1/completions", content=b"{}", headers=charset).status_code == 200


def test_a_foreign_origin_is_refused_and_an_allowed_one_gets_cors_headers():
    response = ask(GuardSettings(), "POST", "/v1/completions", content=b"{}",
                   headers=JSON | {"origin": "https://evil.example"})
    assert response.status_code == 403 and "--allowed-origins" in error_of(response)["message"]
    allowed = GuardSettings(allowed_origins=("https://app.example",))
    response = ask(allowed, "POST", "/v1/completions", content=b"{}", headers=JSON | {"origin": "https://app.example"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "https://app.example"
    preflight = ask(allowed, "OPTIONS", "/v1/completions",
                    headers={"origin": "https://app.example", "access-control-request-method": "POST",
                             "access-control-request-headers": "authorization, content-type"})
    assert preflight.status_code == 204 and "POST" in preflight.headers["access-control-allow-methods"]
    assert ask(allowed, "OPTIONS", "/v1/completions", headers={"origin": "https://evil.example"}).status_code == 403


def test_bound_to_loopback_only_loopback_host_names_are_answered():
    """DNS rebinding: a page's own domain resolved to 127.0.0.1 still sends its own name as Host."""
    settings = GuardSettings(allowed_hosts=LOOPBACK_HOSTS)
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000"):
        assert ask(settings, "GET", "/v1/models", headers={"host": host}).status_code == 200, host
    response = ask(settings, "GET", "/v1/models", headers={"host": "rebound.example:8000"})
    assert response.status_code == 403 and error_of(response)["code"] == "host_not_allowed"


def test_a_body_over_the_limit_is_413_from_its_content_length_or_as_it_arrives():
    settings = GuardSettings(max_request_bytes=1000)
    response = ask(settings, "POST", "/v1/completions", content=b"x" * 1001, headers=JSON)
    assert response.status_code == 413 and "at most 1000" in error_of(response)["message"]

    async def chunks():   # no Content-Length: counted as it arrives
        for _ in range(3):
            yield b"y" * 400

    response = ask(settings, "POST", "/v1/completions", content=chunks(), headers=JSON)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"
    assert ask(settings, "POST", "/v1/completions", content=b"z" * 1000, headers=JSON).status_code == 200


def test_a_body_that_does_not_arrive_in_time_is_408():
    async def slow():
        yield b'{"prompt": '
        await asyncio.sleep(0.5)
        yield b'"late"}'

    response = ask(GuardSettings(body_timeout=0.1), "POST", "/v1/completions", content=slow(), headers=JSON)
    assert response.status_code == 408 and error_of(response)["code"] == "request_timeout"
    assert json.loads(ask(GuardSettings(body_timeout=5), "POST", "/v1/completions", content=slow(),
                          headers=JSON).content) == {"prompt": "late"}


def test_an_allowed_origin_is_matched_exactly():
    """A prefix, an extension or another scheme or port of an allowed origin is another origin."""
    settings = GuardSettings(allowed_origins=("https://a.com",))
    for origin in ("https://a.com.evil.net", "https://a.co", "https://a.com:8443", "http://a.com", "https://b.a.com",
                   "https://a.com/", "null"):
        response = ask(settings, "POST", "/v1/completions", content=b"{}", headers=JSON | {"origin": origin})
        assert response.status_code == 403 and "access-control-allow-origin" not in response.headers, origin
    assert ask(settings, "POST", "/v1/completions", content=b"{}",
               headers=JSON | {"origin": "https://a.com"}).status_code == 200


def test_a_repeated_host_or_authorization_header_is_refused_not_last_wins():
    settings = GuardSettings(api_key=KEY, allowed_hosts=LOOPBACK_HOSTS)
    good = [("host", "127.0.0.1"), ("authorization", f"Bearer {KEY}")]
    assert ask(settings, "GET", "/v1/models", headers=good).status_code == 200
    for repeated in (("host", "rebound.example"), ("authorization", "Bearer other"), ("host", "127.0.0.1")):
        response = ask(settings, "GET", "/v1/models", headers=good + [repeated])
        assert response.status_code == 400 and error_of(response)["code"] == "duplicate_header", repeated
        assert f"more than one {repeated[0]} header" in error_of(response)["message"]
    response = ask(GuardSettings(), "POST", "/v1/completions", content=b"{}",
                   headers=[("content-type", "application/json"), ("content-type", "text/plain")])
    assert response.status_code == 400
    assert ask(GuardSettings(), "GET", "/v1/models", headers=[("x-a", "1"), ("x-a", "2")]).status_code == 200


def test_more_headers_than_the_limit_are_431_and_echoed_values_are_cut():
    headers = [(f"x-h{i}", "v") for i in range(10)]
    assert ask(GuardSettings(max_headers=20), "GET", "/v1/models", headers=headers).status_code == 200
    response = ask(GuardSettings(max_headers=10), "GET", "/v1/models", headers=headers)   # and httpx's own
    assert response.status_code == 431 and error_of(response)["code"] == "request_header_fields_too_large"
    response = ask(GuardSettings(allowed_hosts=LOOPBACK_HOSTS), "GET", "/v1/models", headers={"host": "h" * 20_000})
    assert response.status_code == 403 and len(error_of(response)["message"]) < 300


def test_a_body_with_more_commas_than_a_request_can_use_is_refused_before_the_rest_arrives():
    """Megabytes of token ids: counted as they arrive (each comma separates two values or is a character)."""
    sent = []

    async def token_ids():
        yield b'{"prompt": ['
        for _ in range(100):
            sent.append(1)
            yield b"1," * 1000

    response = ask(GuardSettings(max_body_commas=5000), "POST", "/v1/completions", content=token_ids(), headers=JSON)
    assert response.status_code == 400 and error_of(response)["code"] == "context_length_exceeded"
    assert len(sent) <= 7   # the rest was never read
    assert ask(GuardSettings(max_body_commas=5000), "POST", "/v1/completions", content=b'{"p": [' + b"1," * 4999
               + b"1]}", headers=JSON).status_code == 200
