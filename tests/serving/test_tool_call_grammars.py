"""Each tool-call syntax's forcing grammar (tool_choice "required" or a named function) accepts exactly the calls
its parser reads: a call in the syntax, token by token through llguidance with the markers as the tokenizer's
special tokens, is accepted to its end and parsed back to the same call; a call of another function or with
arguments outside the schema is refused."""

import json

import pytest

llg = pytest.importorskip("llguidance")

from tokenizers import AddedToken, Tokenizer  # noqa: E402

from moe_jax.serving.tool_calls import tool_call_parser  # noqa: E402
from moe_jax.tokenization import write_byte_tokenizer  # noqa: E402

FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"], "additionalProperties": False}},
             {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"], "additionalProperties": False}}]
DEEPSEEK = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city":"Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
HARMONY = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
CALLS = {"hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>',
         "deepseek_v3": DEEPSEEK, "harmony": HARMONY,
         "llama4_json": '{"name":"get_weather","parameters":{"city":"Paris"}}'}
SPECIAL = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁sep｜>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    write_byte_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL])
    return tokenizer


def accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = llg.LLMatcher(llg.LLTokenizer(tokenizer.to_str()), grammar, log_level=0)
    return all(matcher.consume_token(token) for token in tokenizer.encode(text).ids) and matcher.is_accepting()


@pytest.mark.parametrize("syntax", sorted(CALLS))
def test_the_forcing_grammar_takes_the_call_its_parser_reads(tokenizer, syntax):
    parser = tool_call_parser(syntax)
    grammar = parser.forcing_grammar(FUNCTIONS)
    call = CALLS[syntax]
    parsed = parser.parse(call)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]
    assert accepts(tokenizer, grammar, call)
    assert not accepts(tokenizer, grammar, call.replace("Paris", "Paris\" , \"x\":\"1"))   # outside the schema
    named = parser.forcing_grammar(FUNCTIONS[1:])                        # tool_choice naming `add` alone
    assert not accepts(tokenizer, named, call)


def test_llama4s_pythonic_syntax_has_no_forcing_grammar_yet():
    assert tool_call_parser("llama4_pythonic").forcing_grammar(FUNCTIONS) is None
