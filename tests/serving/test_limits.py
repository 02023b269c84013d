"""`moe_jax.serving.limits`: a body is parsed within bounds the context sets, every string and list counted wherever
it is (roles, names, tool schemas, unknown fields), and refused at the first value over a bound; and the app in
front of a stub manager refuses what those bounds refuse, before anything reaches the engine."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("pydantic")

from moe_jax.serving.limits import SHOWN_CHARS, RequestLimits, parse_bounded, shown  # noqa: E402
from moe_jax.serving.protocol import InvalidRequest  # noqa: E402

SMALL = RequestLimits(max_values=50, max_items=10, max_chars=100, max_depth=4, max_number_chars=8)


def refusal(raw: bytes, limits: RequestLimits = SMALL) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_bounded(raw, limits)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("text", [
    '{"a": [1, -2, 3.5, -4e-2, 1E3, true, false, null], "b": {"c": {}, "d": []}, "e": ""}',
    ' [ "\\u00e9\\ud83d\\ude00\\n\\"", {"k": [[]]} ] ', '"only a string"', "0", "-0.5", "null",
    '{"dup": 1, "dup": 2}', json.dumps({"prompt": "caf\u00e9 \u4e2d\u6587", "ids": list(range(9))}),
])
def test_what_it_parses_is_what_json_loads_parses(text):
    assert parse_bounded(text.encode(), RequestLimits()) == json.loads(text)


@pytest.mark.parametrize("raw, message", [
    (b'{"a": 1,}', "not valid JSON"), (b"[1 2]", "not valid JSON"), (b'{"a" 1}', "not valid JSON"),
    (b"[01]", "not valid JSON"), (b"[-Infinity]", "not valid JSON"), (b'{"a": 1} x', "not valid JSON"),
    (b"", "not valid JSON"), (b'"open', "not valid JSON"), (b'["a\x01"]', "not valid JSON"),
    (b'{1: 2}', "not valid JSON"), (b"\xef\xbb\xbf{}", "not valid JSON"),
])
def test_malformed_json_is_a_400_that_says_so(raw, message):
    assert message in refusal(raw, RequestLimits()).message


@pytest.mark.parametrize("raw, bound", [
    (b"[" + b"1," * 10 + b"1]", "an array of more than 10 items"),
    (json.dumps({f"k{i}": 0 for i in range(11)}).encode(), "an object of more than 10 members"),
    (json.dumps([[0] * 9] * 6).encode(), "more than 50 values"),
    (json.dumps({"a": "x" * 60, "b": "y" * 41}).encode(), "more than 100 characters"),
    (json.dumps({"k" * 101: 0}).encode(), "more than 100 characters"),   # keys count too
])
def test_each_bound_is_refused_as_more_than_the_context_can_use(raw, bound):
    error = refusal(raw)
    assert bound in error.message and error.code == "context_length_exceeded"


def test_nesting_and_long_numbers_are_refused():
    assert "nests too deeply" in refusal(b"[[[[[1]]]]]").message
    assert parse_bounded(b"[[[[1]]]]", SMALL) == [[[[1]]]]
    assert "a number of 9 characters" in refusal(b"[123456789]").message
    assert parse_bounded(b"[12345678]", SMALL) == [12345678]


def test_every_string_counts_wherever_it_is():
    """A chat message's role and name, a tool's schema and a field the server ignores count as its content does."""
    limits = RequestLimits.for_context(64, 1)
    for where in ({"role": "r" * limits.max_chars}, {"name": "n" * limits.max_chars}):
        body = {"messages": [{"role": "user", "content": "hi"} | where]}
        assert refusal(json.dumps(body).encode(), limits).code == "context_length_exceeded"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"d": "x" * limits.max_chars}}}]
    assert refusal(json.dumps({"messages": [], "tools": tools}).encode(), limits).code == "context_length_exceeded"
    assert refusal(json.dumps({"prompt": "a", "ignored": ["z"] * 2000}).encode(), limits).code == \
        "context_length_exceeded"
    assert refusal(json.dumps({"messages": [{}] * 100_000}).encode(), limits).code == "context_length_exceeded"


def test_the_bounds_follow_from_the_context_and_fit_the_largest_request():
    limits = RequestLimits.for_context(4096, 16)
    assert limits.prompt_chars == 4096 * 16 * 2 and limits.max_items == 4096
    largest_text = {"prompt": "\U0001f600" * limits.prompt_chars, "stop": ["s" * 256] * 16, "max_tokens": 1}
    raw = json.dumps(largest_text).encode()   # every character escaped (ensure_ascii): 12 bytes each
    assert len(raw) <= limits.body_bytes and parse_bounded(raw, limits)["prompt"] == largest_text["prompt"]
    ids = json.dumps({"prompt": [151_000] * 4095, "max_tokens": 1}).encode()
    assert len(parse_bounded(ids, limits)["prompt"]) == 4095
    assert RequestLimits.for_context(64, None).prompt_chars == 64 * 64 * 2   # an unknown longest token: 64


def test_echoed_text_is_cut():
    assert shown("m" * SHOWN_CHARS) == "m" * SHOWN_CHARS
    assert shown("m" * (1 << 20)) == "m" * SHOWN_CHARS + "..."


# ---- the app over a stub manager: refused before the engine --------------------------------------------------------
def stub_app(max_model_len: int = 64):
    pytest.importorskip("fastapi")
    from moe_jax.serving import build_app
    from moe_jax.tokenization import CheckpointTokenizer

    manager = SimpleNamespace(engine=SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=256))),
                              add_request=lambda *a, **k: pytest.fail("a refused request reached the manager"))
    tokenizer = CheckpointTokenizer(encode=lambda text: list(text.encode()), decode=lambda ids: bytes(ids).decode(),
                                    apply_chat_template=lambda messages: [1, 2, 3], max_token_chars=1)
    return build_app(manager, tokenizer, model_name="tiny", max_model_len=max_model_len)


def ask(app, method: str, path: str, **kwargs):
    httpx = pytest.importorskip("httpx")

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(run())


def test_the_app_refuses_what_the_bounds_refuse_before_the_engine():
    app = stub_app()
    limits = RequestLimits.for_context(64, 1)
    role = {"messages": [{"role": "u" * 1000, "content": "hi"}]}   # within the body's bounds, not the prompt's
    response = ask(app, "POST", "/v1/chat/completions", json=role)
    counted = re.search(r"the messages has (\d+) characters", response.json()["error"]["message"])
    assert response.status_code == 400 and counted and int(counted.group(1)) >= 1002   # the role counts
    many = ask(app, "POST", "/v1/chat/completions", json={"messages": [{}] * 100_000})
    assert many.status_code == 400 and many.json()["error"]["code"] == "context_length_exceeded"
    for count, refusal in ((2000, "an array of more than 1024 items"),
                           (100_000, f"more than {limits.max_commas} commas")):
        ids = ask(app, "POST", "/v1/completions", content=b'{"prompt": [' + b"1," * count + b"1]}",
                  headers={"content-type": "application/json"})   # the longer read only up to the commas' bound
        assert ids.status_code == 400 and refusal in ids.json()["error"]["message"], count
    too_big = ask(app, "POST", "/v1/completions", content=b" " * (limits.body_bytes + 1),
                  headers={"content-type": "application/json"})
    assert too_big.status_code == 413   # the default body limit is the bounds' largest body
    for field, value in (("max_tokens", True), ("temperature", False), ("top_p", True), ("seed", True)):
        response = ask(app, "POST", "/v1/completions", json={"prompt": "a", field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, field


def test_an_unknown_model_name_is_echoed_cut_to_64_characters():
    app = stub_app()
    for response in (ask(app, "POST", "/v1/completions", json={"model": "m" * 60_000, "prompt": "a"}),
                     ask(app, "GET", "/v1/models/" + "m" * 5000)):
        error = response.json()["error"]
        assert response.status_code == 404 and error["code"] == "model_not_found"
        assert "m" * SHOWN_CHARS + "..." in error["message"] and len(error["message"]) < 200
