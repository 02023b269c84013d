"""Tool calls: each family's syntax parsed from literal model outputs (`moe_jax.serving.tool_calls`), tools and
tool-call messages through a Qwen3-style chat template, and the chat endpoint end to end with the OpenAI client
over a scripted manager (the tiny random model does not call tools by itself): its outputs are given texts, its
prompts are recorded, so the round trip call -> tool message -> next prompt is checked as the template renders it.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from moe_jax.chat_template import render_chat_template
from moe_jax.serving.tool_calls import (
    DEFAULT_PARSERS,
    PARSERS,
    Parsed,
    ToolCall,
    ToolCallStream,
    default_parser,
    tool_call_parser,
)
from moe_jax.tokenization import load_checkpoint_tokenizer, write_byte_tokenizer

WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# Qwen3's chat template's tool parts (its thinking parts left out), as its tokenizer_config.json has them.
QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content if message.content is string else '' %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}\
{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


# ---- parsers on literal outputs ----------------------------------------------------------------------------------

PARSED = {
    "hermes": [
        ("Let me check.\n" + HERMES_CALL, Parsed("Let me check.\n", [WEATHER])),
        (HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo"),
         Parsed("\n", [WEATHER, ToolCall("get_weather", '{"city": "Oslo"}')])),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', Parsed("", [WEATHER])),   # unclosed
        ("<tool_call>\n{not json}\n</tool_call>", Parsed("<tool_call>\n{not json}\n</tool_call>")),
        ('<tool_call>{"arguments": {}}</tool_call>', Parsed('<tool_call>{"arguments": {}}</tool_call>')),   # no name
        ("Just text.", Parsed("Just text.")),
    ],
    "deepseek_v3": [
        ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
         Parsed("Sure.", [WEATHER, ToolCall("now", "{}")])),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops\n```<｜tool▁call▁end｜>",
         Parsed("functionf\n```json\n{oops\n```")),   # special tokens are not content (as without tools)
        ("Hello.<｜end▁of▁sentence｜>", Parsed("Hello.")),
    ],
    "harmony": [
        ("<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary "
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', Parsed("", [WEATHER])),
        ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}<|call|>',
         Parsed("", [WEATHER])),
        ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>",
         Parsed("Hi!")),
        ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{broken<|call|>", Parsed("")),
        ("plain text", Parsed("plain text")),
    ],
    "llama4_pythonic": [
        ('[get_weather(city="Paris"), now()]', Parsed("", [WEATHER, ToolCall("now", "{}")])),
        ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', Parsed("", [WEATHER])),
        ("[f(x=open('a'))]", Parsed("[f(x=open('a'))]")),   # not a literal: not run, not a call
        ("[1] is a footnote", Parsed("[1] is a footnote")),
    ],
    "llama4_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', Parsed("", [WEATHER])),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}',
         Parsed("", [WEATHER, ToolCall("now", "{}")])),
        ('{"name": "f", "parameters": {"a": 1}} and more', Parsed('{"name": "f", "parameters": {"a": 1}} and more')),
        ("{not json", Parsed("{not json")),
    ],
}


@pytest.mark.parametrize("name, text, expected", [(name, text, expected) for name, cases in PARSED.items()
                                                  for text, expected in cases])
def test_each_parser_reads_its_familys_calls_and_leaves_malformed_ones_as_content(name, text, expected):
    assert tool_call_parser(name).parse(text) == expected


@pytest.mark.parametrize("name, text", [(name, text) for name, cases in PARSED.items() for text, _ in cases])
def test_streamed_character_by_character_adds_up_to_the_whole_parse(name, text):
    parser = tool_call_parser(name)
    stream, content, calls = ToolCallStream(parser), "", []
    for i, character in enumerate(text):
        delta, new = stream.feed(character, i == len(text) - 1)
        content, calls = content + delta, calls + new
    assert Parsed(content, calls) == parser.parse(text)


def test_streaming_sends_text_before_a_call_at_once_and_each_call_when_it_ends():
    stream = ToolCallStream(tool_call_parser("hermes"))
    assert stream.feed("Let me check. <tool", False) == ("Let me check. ", [])   # "<tool" may begin a marker
    assert stream.feed(HERMES_CALL[5:-3], False) == ("", [])
    assert stream.feed(HERMES_CALL[-3:] + "\n<tool_call>", False) == ("", [WEATHER])
    assert stream.feed('{"name": "now"}</tool_call>', True) == ("\n", [ToolCall("now", "{}")])


def test_the_registry_and_the_defaults_by_model_type():
    from moe_jax.cli.serve import TOOL_CALL_PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS) and set(DEFAULT_PARSERS.values()) <= set(PARSERS)
    assert (default_parser("qwen3_moe"), default_parser("deepseek_v3"), default_parser("gpt_oss")) == (
        "hermes", "deepseek_v3", "harmony")
    assert default_parser("mixtral") is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_call_parser("nope")


# ---- the chat template -------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]
RENDERED = ("<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>\n\nFor each function call, return a "
            "json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>\n"
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            "<|im_start|>assistant\n" + HERMES_CALL + "<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")


def template_messages(messages):
    from moe_jax.serving.protocol import ChatCompletionRequest, parse_request

    return [m.as_template_input() for m in parse_request(ChatCompletionRequest, {"messages": messages}).messages]


@pytest.mark.parametrize("transformers", [True, False], ids=["transformers", "tokenizers-only"])
def test_tools_and_tool_messages_render_as_the_template_expects(tmp_path, monkeypatch, transformers):
    pytest.importorskip("jinja2")
    if not transformers:
        monkeypatch.setitem(sys.modules, "transformers", None)   # as if transformers were not installed
    messages = template_messages(CONVERSATION)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}   # JSON text -> an object
    assert render_chat_template(QWEN3_TEMPLATE, messages, tools=TOOLS) == RENDERED
    write_byte_tokenizer(tmp_path, chat_template=QWEN3_TEMPLATE)   # the same through the checkpoint's tokenizer
    tokenizer = load_checkpoint_tokenizer(tmp_path, instead="-")
    assert tokenizer.decode(tokenizer.apply_chat_template(messages, tools=TOOLS)) == RENDERED
    no_tools = tokenizer.decode(tokenizer.apply_chat_template(messages[:1]))
    assert no_tools == "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode_special(list(b"<x>")) == "<x>"


# ---- end to end, over a scripted manager ------------------------------------------------------------------------

@dataclass
class Output:
    generated_tokens: list[int]
    offset: int = 0
    finished: bool = False
    finish_reason: str | None = None
    status: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(name="DECODING"))
    logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    cached_tokens: int = 0
    time_to_first_token: float | None = None
    inter_token_latencies: list = field(default_factory=list)
    error: str | None = None
    routing: object = None   # GenerationOutput.routing: set only for requests with return_routing

    def is_finished(self) -> bool:
        return self.finished


class ScriptedManager:
    """What `build_app` uses of a `ContinuousBatchingManager`; each request generates `reply`'s bytes (the byte
    tokenizer's ids), one output per token, and its prompt is kept in `prompts`."""

    def __init__(self, model_type: str = "qwen3_moe"):
        self.reply, self.prompts, self.error, self.running = "", [], None, False
        config = SimpleNamespace(vocab_size=256, model_type=model_type)
        self.engine = SimpleNamespace(model=SimpleNamespace(config=config), config=SimpleNamespace(max_model_len=4096))

    def start(self):
        self.running = True
        return self

    def stop(self, block=True, timeout=None, *, drain=False):
        self.running = False

    def begin_drain(self, timeout):
        pass

    def is_running(self):
        return self.running

    def is_draining(self):
        return False

    def cancel_request(self, request_id):
        pass

    def add_request(self, prompt, *, handler, **settings):
        self.prompts.append(list(prompt))
        tokens = list(self.reply.encode())

        def run():
            for i, token in enumerate(tokens):
                handler(Output([token], offset=i))
            handler(Output(tokens, finished=True, finish_reason="stop", status=SimpleNamespace(name="FINISHED")))

        threading.Thread(target=run, daemon=True).start()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from .live import serving

    directory = tmp_path_factory.mktemp("tools")
    write_byte_tokenizer(directory, chat_template=QWEN3_TEMPLATE)
    tokenizer = load_checkpoint_tokenizer(directory, instead="-")
    manager = ScriptedManager()
    with serving(None, manager, tokenizer) as served:   # the parser: qwen3_moe's default, hermes
        served.scripted = manager
        yield served


def test_a_tool_call_round_trip_plain_and_streamed(scripted):
    scripted.scripted.reply = "Let me check.\n" + HERMES_CALL
    request = dict(model="tiny-moe", messages=CONVERSATION[:1], tools=TOOLS)
    response = scripted.client.chat.completions.create(**request)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The client sends the call back with the tool's answer: the next prompt renders both as Qwen3's template does.
    follow_up = [CONVERSATION[0], choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    scripted.scripted.reply = "It is sunny."
    answer = scripted.client.chat.completions.create(model="tiny-moe", messages=follow_up, tools=TOOLS)
    assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("It is sunny.", "stop")
    assert answer.choices[0].message.tool_calls is None
    assert scripted.tokenizer.decode(scripted.scripted.prompts[-1]) == RENDERED.replace(
        "<|im_start|>assistant\n<tool_call>", "<|im_start|>assistant\nLet me check.\n\n<tool_call>")
    # Streamed: the text before the call as it comes, then the call in one delta, then finish_reason tool_calls.
    scripted.scripted.reply = "Let me check.\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo")
    chunks = list(scripted.client.chat.completions.create(**request, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert "".join(delta.content or "" for delta in deltas) == "Let me check.\n\n"
    calls = [entry for delta in deltas for entry in delta.tool_calls or []]
    assert [(entry.index, entry.function.name, json.loads(entry.function.arguments)) for entry in calls] == [
        (0, "get_weather", {"city": "Paris"}), (1, "get_weather", {"city": "Oslo"})]
    assert all(entry.id.startswith("call_") and entry.type == "function" for entry in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_leaves_the_text_and_required_is_parsed(scripted):
    scripted.scripted.reply = HERMES_CALL
    response = scripted.client.chat.completions.create(model="tiny-moe", messages=CONVERSATION[:1], tools=TOOLS,
                                                       tool_choice="none")
    assert (response.choices[0].message.content, response.choices[0].finish_reason) == (HERMES_CALL, "stop")
    assert "<tools>" in scripted.tokenizer.decode(scripted.scripted.prompts[-1])   # the tools are in the prompt
    scripted.scripted.reply = "Hi."
    plain = scripted.client.chat.completions.create(model="tiny-moe", messages=CONVERSATION[:1])
    assert plain.choices[0].message.content == "Hi."
    assert "<tools>" not in scripted.tokenizer.decode(scripted.scripted.prompts[-1])
    import openai

    scripted.scripted.reply = HERMES_CALL
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = scripted.client.chat.completions.create(model="tiny-moe", messages=CONVERSATION[:1], tools=TOOLS,
                                                         tool_choice=choice)   # the grammar: test_structured_output
        assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError, match="names the function 'nowhere', which is not among the tools"):
        scripted.client.chat.completions.create(model="tiny-moe", messages=CONVERSATION[:1], tools=TOOLS,
                                                tool_choice={"type": "function", "function": {"name": "nowhere"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        scripted.client.chat.completions.create(model="tiny-moe", messages=CONVERSATION[:1], tool_choice="auto")


def test_without_a_parser_auto_is_refused_and_none_is_served(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import asyncio

    from moe_jax.serving import build_app

    write_byte_tokenizer(tmp_path, chat_template=QWEN3_TEMPLATE)
    tokenizer = load_checkpoint_tokenizer(tmp_path, instead="-")
    app = build_app(ScriptedManager(model_type="mixtral"), tokenizer, model_name="m", max_model_len=512)

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json={"messages": CONVERSATION[:1], "tools": TOOLS})

    response = asyncio.run(ask())
    assert response.status_code == 400 and "--tool-call-parser" in response.json()["error"]["message"]


def test_special_token_markers_are_read_from_the_text_with_special_tokens():
    """DeepSeek-V3's markers are special tokens, which the shown text skips: its calls are parsed from the text
    decoded with them, and its other special tokens stay out of the content."""
    pytest.importorskip("fastapi")
    from moe_jax.serving.choices import Generation, chat_body

    special = ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
    tokenizer = SimpleNamespace(decode=lambda ids: "Sure.function get_weather", decode_special=lambda ids: special)
    server = SimpleNamespace(tokenizer=tokenizer, model_name="m")
    output = Output([1, 2, 3], finished=True, finish_reason="stop")
    for tools, expected in ((tool_call_parser("deepseek_v3"), "Sure."), (None, "Sure.function get_weather")):
        body = chat_body(server, [Generation(server, "chatcmpl-1", [0], [], False)], [output], top=None,
                         tools=tools)
        (choice,) = body["choices"]
        assert choice["message"]["content"] == expected
        if tools is not None:
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}
