"""Structured output through the server: response_format json_schema / json_object and vLLM's guided_regex /
guided_json, on the live server's tiny checkpoint (byte-level tokenizer, no EOS token; one device, 16 slots so
n=16 choices decode together)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("jinja2", reason="chat templates are rendered with jinja2")
pytest.importorskip("llguidance")

import jax  # noqa: E402

from moe_jax import AutoModelForCausalLM  # noqa: E402
from moe_jax.tokenization import load_checkpoint_tokenizer  # noqa: E402

from .live import NAME, serving, write_checkpoint  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("structured") / "tiny")
    tokenizer = load_checkpoint_tokenizer(checkpoint, instead="-")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, devices=jax.devices()[:1], progress=False)
    manager = model.init_continuous_batching(decode=tokenizer.decode, max_slots=16, page_size=8, max_model_len=128,
                                             prefill_chunk=16)
    with serving(model, manager, tokenizer) as served:
        yield served


def valid(value) -> bool:
    return isinstance(value, dict) and set(value) == {"a"} and type(value["a"]) is int and 0 <= value["a"] <= 99


# heavy: guided_json is the suite's in the test above
@pytest.mark.heavy
def test_json_schema_outputs_always_validate(served):
    """112 completions sampled at temperature 1 (7 requests of n=16, chat and completions): each ends ("stop")
    as JSON that validates against the schema."""
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    texts = []
    for i in range(7):
        if i % 2:
            reply = served.client.completions.create(model=NAME, prompt=f"Give a number {i}:", n=16, max_tokens=24,
                                                     temperature=1.0, seed=i,
                                                     extra_body={"response_format": response_format})
            texts += [(choice.finish_reason, choice.text) for choice in reply.choices]
        else:
            reply = served.client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": f"A number {i}, as JSON"}], n=16, max_tokens=24,
                temperature=1.0, seed=i, response_format=response_format)
            texts += [(choice.finish_reason, choice.message.content) for choice in reply.choices]
    assert len(texts) == 112
    for reason, text in texts:
        assert reason == "stop" and valid(json.loads(text)), (reason, text)


def test_guided_regex_json_object_and_guided_json(served):
    reply = served.client.completions.create(model=NAME, prompt="Code:", n=8, max_tokens=16, temperature=1.0,
                                             extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2,4}"})
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", choice.text), choice.text
    reply = served.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "JSON"}], n=8,
                                                  max_tokens=60, temperature=1.0,
                                                  response_format={"type": "json_object"})
    for choice in reply.choices:   # any object: one that does not close within max_tokens is cut ("length")
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict), choice.message.content
    reply = served.client.completions.create(model=NAME, prompt="x", n=4, max_tokens=24, temperature=1.0,
                                             extra_body={"guided_json": SCHEMA})
    assert all(choice.finish_reason == "stop" and valid(json.loads(choice.text)) for choice in reply.choices)


def test_bad_structured_output_is_a_400(served):
    def post(body):
        response = httpx.post(f"{served.url}/v1/completions", json={"prompt": "a"} | body)
        return response.status_code, response.json()["error"]

    for body, words in [({"response_format": {"type": "xml"}}, "not supported"),
                        ({"response_format": {"type": "json_schema"}}, "needs json_schema"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema":
                                                                                     {"type": "foo"}}}}, "not valid"),
                        ({"guided_regex": "[a-"}, "not valid"),
                        ({"guided_regex": "a", "guided_json": SCHEMA}, "at most one")]:
        status, error = post(body)
        assert status == 400 and words in error["message"], (body, error)
        assert error["param"] in ("response_format", "guided_regex", "guided_json")
    reply = served.client.completions.create(model=NAME, prompt="a", max_tokens=2,
                                             extra_body={"response_format": {"type": "text"}})
    assert reply.choices[0].finish_reason == "length"
