"""Structured output in the engine (`RequestSettings.grammar`, llguidance's token masks): sampled outputs always
follow their grammar and end where it does, and the rows without a grammar get what they get alone.

A tiny random qwen3_moe whose vocabulary (300) is larger than its byte tokenizer's (256): the padding ids are
never allowed."""

from __future__ import annotations

import json
import re

import jax
import pytest

from moe_jax import AutoModelForCausalLM
from moe_jax.inference import ContinuousBatchingConfig, Request, RequestSettings, ServingEngine
from moe_jax.tokenization import write_byte_tokenizer

llguidance = pytest.importorskip("llguidance")

from moe_jax.inference.grammar import json_object_grammar, json_schema_grammar, regex_grammar  # noqa: E402

CONFIG = dict(model_type="qwen3_moe", vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
              num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=128,
              tie_word_embeddings=False)
ENGINE = ContinuousBatchingConfig(max_slots=16, page_size=64, max_model_len=64, prefill_chunk=8)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
          "additionalProperties": False}
PROMPT = list(b"Answer: ")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = AutoModelForCausalLM.from_config(CONFIG, devices=jax.devices()[:1])
    model.init_params(0)
    directory = tmp_path_factory.mktemp("byte_tokenizer")
    write_byte_tokenizer(directory)
    engine = ServingEngine(model, ENGINE)
    engine.enable_grammars((directory / "tokenizer.json").read_text(), eos_token_ids=[])
    return engine


def run(engine, settings: list[RequestSettings], prompt=PROMPT) -> list[Request]:
    requests = [Request(f"r{i}", list(prompt), s) for i, s in enumerate(settings)]
    for request in requests:
        engine.add(request)
    for _ in range(500):
        if not engine.has_work():
            break
        engine.step()
    assert all(request.output.is_finished() for request in requests)
    return requests


def sampled(grammar: str, n: int, max_new_tokens: int = 40, seed: int = 0) -> list[RequestSettings]:
    return [RequestSettings(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0, seed=seed + i,
                            grammar=grammar) for i in range(n)]


def text(request: Request) -> str:
    return bytes(request.output.generated_tokens).decode("utf-8")


def test_json_schema_outputs_validate(engine):
    """100 completions sampled at temperature 1: every one ends ("stop") as a JSON object of the schema."""
    requests = run(engine, sampled(json_schema_grammar(SCHEMA), 100))
    for request in requests:
        assert request.output.finish_reason == "stop", text(request)
        value = json.loads(text(request))
        assert set(value) == {"a"} and isinstance(value["a"], int) and 0 <= value["a"] <= 99, value


def test_regex_and_json_object(engine):
    requests = run(engine, sampled(regex_grammar(r"[a-z]{2,5}-[0-9]{3}"), 8, seed=100)
                   + sampled(json_object_grammar(), 8, max_new_tokens=60, seed=200))
    for request in requests[:8]:
        assert request.output.finish_reason == "stop" and re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", text(request))
    for request in requests[8:]:   # any object: it may not close within the budget, but never leaves JSON
        assert max(request.output.generated_tokens) < 256
        if request.output.finish_reason == "stop":
            assert isinstance(json.loads(text(request)), dict), text(request)
        else:
            assert request.output.finish_reason == "length"   # cut, maybe inside a character
            assert bytes(request.output.generated_tokens).startswith(b"{")


def test_rows_without_grammar_unchanged(engine):
    """A batch mixing grammar rows and plain rows (sampled and greedy): the plain rows' tokens are theirs alone."""
    plain = [RequestSettings(max_new_tokens=12, do_sample=True, temperature=1.0, top_k=0, seed=7),
             RequestSettings(max_new_tokens=12)]
    alone = [request.output.generated_tokens for request in run(engine, plain)]
    mixed = run(engine, sampled(json_schema_grammar(SCHEMA), 3, seed=300) + plain)
    assert [request.output.generated_tokens for request in mixed[3:]] == alone
    assert all(json.loads(text(request))["a"] >= 0 for request in mixed[:3])


def test_grammar_rows_are_not_speculated():
    assert RequestSettings(grammar=regex_grammar("a+")).controls_logits(5)
    with pytest.raises(ValueError, match="not valid"):
        regex_grammar("[a-")
    with pytest.raises(ValueError, match="not valid"):
        json_schema_grammar({"type": "foo"})


def test_a_forced_tool_call_is_a_call_of_one_of_the_functions_with_arguments_by_their_schema(engine):
    """tool_choice "required" in Hermes syntax (`tool_calls.HermesParser.forcing_grammar`): every sampled output
    is one call that the parser reads, of a function named, with arguments its parameters' schema allows."""
    from moe_jax.serving.tool_calls import HermesParser

    functions = [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9}},
                                              "required": ["x"], "additionalProperties": False}},
                 {"name": "g", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]
    grammar = HermesParser().forcing_grammar(functions)
    requests = run(engine, sampled(grammar, 6, max_new_tokens=60), prompt=list(b"T: "))
    for request in requests:
        assert request.output.finish_reason == "stop"
        parsed = HermesParser().parse(bytes(request.output.generated_tokens).decode())
        assert parsed.content.strip() == "" and len(parsed.calls) == 1
        call = parsed.calls[0]
        arguments = json.loads(call.arguments)
        assert (call.name, sorted(arguments)) in (("f", ["x"]), ("g", []))
        assert call.name == "g" or 0 <= arguments["x"] <= 9
