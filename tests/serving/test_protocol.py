"""`moe_jax.serving.protocol`: every bound is checked before a request can reach the engine, and malformed bodies
of any kind are 400s that say what is wrong."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic")

from moe_jax.serving.protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    parse_json,
    parse_request,
)


def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, {"prompt": "a"} | fields)


def refused(model, body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(model, body)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("raw, message", [
    (b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),         # int() digit limit
    (b'{"prompt": "a\\ud800b"}', "lone UTF-16 surrogate"),
    (b'{"prompt": "a", "temperature": NaN}', "not valid JSON"),
    (b'{"prompt": "a", "temperature": Infinity}', "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    (b'{"prompt": "\xff"}', "not UTF-8"),
    (b'{"prompt": "a", ', "not valid JSON"),
])
def test_malformed_bodies_are_400s_that_say_why(raw, message):
    with pytest.raises(InvalidRequest, match=message) as caught:
        parse_json(raw)
    assert caught.value.status == 400


@pytest.mark.parametrize("field, value", [
    ("top_k", 2 ** 31), ("top_k", -2), ("temperature", -0.5), ("temperature", 1e999), ("top_p", 0), ("top_p", 1.5),
    ("seed", 2 ** 64), ("seed", -(2 ** 63) - 1), ("max_tokens", 0), ("n", 17), ("n", 0), ("n", True),
    ("best_of", 3), ("logprobs", 21), ("logprobs", True), ("logprobs", -1), ("stop", [""]), ("stop", ["x"] * 17),
    ("stop", "y" * 257), ("temperature", True), ("seed", False), ("presence_penalty", 2.5),
    ("frequency_penalty", -2.1), ("presence_penalty", True), ("logit_bias", {"a": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"1": 100.5}), ("logit_bias", {"1": True}), ("logit_bias", {str(i): 1 for i in range(301)}),
    ("logit_bias", [1]), ("repetition_penalty", 0), ("min_tokens", -1), ("min_tokens", 17),
    ("stop_token_ids", [-1]), ("stop_token_ids", list(range(17))),
])
def test_out_of_range_fields_are_refused_by_name(field, value):
    assert refused(CompletionRequest, {"prompt": "a", field: value}).param == field


def test_sampling_controls_reach_the_manager_by_name():
    body = completion(logprobs=4, n=3, best_of=3, presence_penalty=-2, frequency_penalty=2,
                      logit_bias={"7": -100, "0": 100}, repetition_penalty=1.3, min_tokens=16, stop_token_ids=[5])
    assert body.n == 3 and completion(echo=True).echo
    assert body.controls() == dict(logprobs=True, top_logprobs=4, logit_bias={7: -100.0, 0: 100.0},
                                   presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.3, min_tokens=16,
                                   stop_token_ids=(5,))
    assert completion().controls() == dict(logprobs=False, top_logprobs=0, logit_bias={}, presence_penalty=0.0,
                                           frequency_penalty=0.0, repetition_penalty=1.0, min_tokens=0,
                                           stop_token_ids=())
    messages = [{"role": "user", "content": "hi"}]
    chat = parse_request(ChatCompletionRequest, {"messages": messages, "logprobs": True, "top_logprobs": 20})
    assert (chat.controls()["logprobs"], chat.controls()["top_logprobs"]) == (True, 20)
    assert parse_request(ChatCompletionRequest, {"messages": messages, "logprobs": True}).logprob_count() == 0
    assert parse_request(ChatCompletionRequest, {"messages": messages, "return_routing": True}).controls()[
        "return_routing"] is True
    assert parse_request(ChatCompletionRequest, {"messages": messages}).logprob_count() is None
    for bad, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                       ({"max_tokens": 3, "min_tokens": 4}, "min_tokens")]:
        with pytest.raises(InvalidRequest) as caught:
            parse_request(ChatCompletionRequest, {"messages": messages, **bad})
        assert caught.value.param == param
    with pytest.raises(InvalidRequest) as caught:
        parse_request(CompletionRequest, {"prompt": "a", "echo": True, "logprobs": 0})
    assert caught.value.param == "echo" and "prompt's log probabilities" in caught.value.message


def test_the_largest_values_in_range_are_accepted():
    body = completion(top_k=2 ** 31 - 1, seed=2 ** 64 - 1, stop=["z" * 256] * 16, logprobs=None, best_of=1)
    assert body.sampling()["top_k"] == 2 ** 31 - 1 and len(body.stop_strings()) == 16
    assert completion(seed=-(2 ** 63)).seed == -(2 ** 63)


@pytest.mark.parametrize("temperature", [0, 1e-40, 9.9e-6])
def test_a_temperature_below_1e_5_is_greedy(temperature):
    assert completion(temperature=temperature).sampling() == dict(do_sample=False, temperature=1.0, top_k=0,
                                                                  top_p=1.0)


def test_sampling_fields_reach_the_manager_by_name():
    """temperature and top_p are not swapped; top_k -1 and 0 are off."""
    assert completion(temperature=0.7, top_p=0.3, top_k=5).sampling() == dict(do_sample=True, temperature=0.7,
                                                                              top_k=5, top_p=0.3)
    assert completion(temperature=1e-5, top_k=-1).sampling()["top_k"] == 0
    assert completion().sampling() == dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)


def test_max_tokens_null_is_the_default_16_not_the_context():
    assert completion().max_tokens == 16
    assert parse_request(CompletionRequest, json.loads('{"prompt": "a", "max_tokens": null}')).max_tokens == 16
    assert completion(max_tokens=3).max_tokens == 3


def test_max_completion_tokens_wins_over_max_tokens_in_chat():
    messages = [{"role": "user", "content": "hi"}]
    both = parse_request(ChatCompletionRequest, {"messages": messages, "max_tokens": 9, "max_completion_tokens": 4})
    assert both.new_tokens() == 4
    assert parse_request(ChatCompletionRequest, {"messages": messages, "max_tokens": 9}).new_tokens() == 9
    assert parse_request(ChatCompletionRequest, {"messages": messages}).new_tokens() is None   # up to the context


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        parse_request(CompletionRequest, [1, 2])


@pytest.mark.parametrize("model, field", [
    (CompletionRequest, "max_tokens"), (CompletionRequest, "temperature"), (CompletionRequest, "top_p"),
    (CompletionRequest, "top_k"), (CompletionRequest, "seed"), (CompletionRequest, "n"),
    (CompletionRequest, "best_of"), (ChatCompletionRequest, "max_completion_tokens"),
    (ChatCompletionRequest, "max_tokens"),
])
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_where_a_number_is_due_is_refused(model, field, value):
    """pydantic would take `true` for 1 (`max_tokens: true`: one token)."""
    body = {"prompt": "a"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "a"}]}
    error = refused(model, body | {field: value})
    assert error.param == field and "a number is due" in error.message


def test_booleans_stay_booleans_where_they_are_due():
    assert completion(stream=True, echo=False).stream is True
    with pytest.raises(InvalidRequest, match="logprobs: a number is due, not false"):   # completions': a count
        completion(logprobs=False)


def test_structured_output_reaches_the_manager_as_a_grammar():
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = completion(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert '"json_schema"' in body.controls()["grammar"]
    assert "grammar" in completion(guided_regex="[0-9]+").controls()
    for field, value in (("response_format", {"type": "yaml"}), ("guided_regex", "(")):
        assert refused(CompletionRequest, {"prompt": "a", field: value}).param == field
