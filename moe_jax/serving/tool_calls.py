"""Tool calls in generated text: each model family's syntax parsed into OpenAI's `tool_calls`.

    parser = tool_call_parser("hermes")             # or default_parser(model_type): None where none is known
    parsed = parser.parse(text)                     # Parsed(content="text outside the calls", calls=[ToolCall])
    stream = ToolCallStream(parser)                 # streaming: text deltas in, (content delta, new calls) out
    content, calls = stream.feed(delta, finished)

The parsers (`PARSERS`, by `--tool-call-parser` name, as vLLM's):

    hermes            Qwen3, Qwen2-MoE, OLMoE: <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    deepseek_v3       DeepSeek-V3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
                      <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    harmony           gpt-oss: <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}
                      <|call|>; the content is the final channel's text (and commentary without a recipient)
    llama4_pythonic   Llama 4: the whole output a Python list of calls, [f(a=1), g(b="x")]
    llama4_json       Llama 4: the whole output {"name": "f", "parameters": {...}}, several separated by ";"

A call whose arguments are not valid JSON (or not a Python literal) is not a call: its text stays in the content.
Arguments come back as JSON text (OpenAI's `function.arguments`), whatever their syntax in the output.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

# The chat template's `model_type` -> the parser of its family's syntax (the checkpoint's own chat template's).
DEFAULT_PARSERS = {"qwen3_moe": "hermes", "qwen2_moe": "hermes", "olmoe": "hermes", "deepseek_v3": "deepseek_v3",
                   "gpt_oss": "harmony", "llama4": "llama4_json", "llama4_text": "llama4_json"}
PARSERS: dict[str, type[ToolCallParser]] = {}


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """A generated text split: `content` (the text outside the calls) and the calls in order."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


def register(cls):
    PARSERS[cls.name] = cls
    return cls


def tool_call_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(sorted(PARSERS))}).")
    return PARSERS[name]()


def default_parser(model_type: str | None) -> str | None:
    """The parser name for a checkpoint's model_type, or None where its syntax is not known."""
    return DEFAULT_PARSERS.get(model_type or "")


class ToolCallParser:
    """starts: the markers that may begin the calls (streaming holds the text back from one on); anchored: they
    begin the calls only at the start of the output; ends: a marker that ends one call (streaming sends the
    calls complete up to the last one; none: at the end); special_tokens: the markers are special tokens, so
    the text is decoded with them, and `clean` takes the other special tokens out of the content (streaming holds
    back a tail from an unclosed `special_open` on, which may begin one)."""

    name: ClassVar[str]
    starts: ClassVar[tuple[str, ...]]
    ends: ClassVar[tuple[str, ...]] = ()
    anchored: ClassVar[bool] = False
    special_tokens: ClassVar[bool] = False
    special_open: ClassVar[str | None] = None
    special_close: ClassVar[str] = ""

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def clean(self, content: str) -> str:
        return content

    def forcing_grammar(self, functions: list[dict]) -> str | None:
        """The grammar that makes the model call one of `functions` in this syntax (tool_choice "required" or a
        named function), or None where the syntax has none yet."""
        return None


def _arguments(value) -> str | None:
    """JSON text of a call's arguments (an object, or JSON text of one); None when they are not."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _json_call(text: str, keys=("arguments", "parameters")) -> ToolCall | None:
    """{"name": ..., "arguments": {...}} (or "parameters") as a call; None when it is not one."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    given = next((value[key] for key in keys if key in value), {})
    arguments = _arguments(given)
    return None if arguments is None else ToolCall(value["name"], arguments)


def _split(text: str, pattern: re.Pattern, call) -> tuple[list[str], list[ToolCall]]:
    """The text outside `pattern`'s matches that `call(match)` reads as calls (a match it refuses stays
    text), and those calls."""
    pieces, calls, last = [], [], 0
    for match in pattern.finditer(text):
        found = call(match)
        if found is None:
            continue
        pieces.append(text[last:match.start()])
        calls.append(found)
        last = match.end()
    pieces.append(text[last:])
    return pieces, calls


@register
class HermesParser(ToolCallParser):
    name = "hermes"
    starts = ("<tool_call>",)
    ends = ("</tool_call>",)
    # A call closed by its end marker, or the last one left open at the end of the output.
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.S)

    def parse(self, text: str) -> Parsed:
        pieces, calls = _split(text, self.CALL, lambda m: _json_call(
            (m.group(1) if m.group(1) is not None else m.group(2)).strip()))
        return Parsed("".join(pieces), calls)

    def forcing_grammar(self, functions: list[dict]) -> str:
        from ..inference.grammar import tool_call_grammar

        return tool_call_grammar(functions, "<tool_call>\n", "\n</tool_call>")


@register
class DeepSeekV3Parser(ToolCallParser):
    name = "deepseek_v3"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    starts = (BEGIN,)
    ends = ("<｜tool▁call▁end｜>",)
    special_tokens = True
    special_open, special_close = "<｜", "｜>"
    CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<arguments>.*?)\n```"
                      r"<｜tool▁call▁end｜>", re.S)
    # Special tokens other than the calls' (the end of the sentence, ...): not content.
    SPECIAL = re.compile(r"<｜[^｜<>]{1,64}｜>")

    def parse(self, text: str) -> Parsed:
        begin = text.find(self.BEGIN)
        if begin < 0:
            return Parsed(self.SPECIAL.sub("", text))

        def call(match):
            arguments = _arguments(match["arguments"])
            name = match["name"].strip()
            return ToolCall(name, arguments) if arguments is not None and name else None

        pieces, calls = _split(text[begin:], self.CALL, call)
        if not calls:
            return Parsed(self.SPECIAL.sub("", text))
        rest = "".join(pieces).replace(self.BEGIN, "", 1).replace(self.END, "", 1)
        return Parsed(self.SPECIAL.sub("", text[:begin] + rest), calls)

    def clean(self, content: str) -> str:
        return self.SPECIAL.sub("", content)

    def forcing_grammar(self, functions: list[dict]) -> str:
        from ..inference.grammar import named_call_grammar

        return named_call_grammar(functions, f'{self.BEGIN}<｜tool▁call▁begin｜> "function" <｜tool▁sep｜>',
                                  '"\\n```json\\n"', f'"\\n```" <｜tool▁call▁end｜>{self.END}')


@register
class HarmonyParser(ToolCallParser):
    """gpt-oss's messages: `<|channel|>C[ to=R][ <|constrain|>json]<|message|>BODY` ended by <|end|>, <|call|>
    or <|return|>, each after the first opened by `<|start|>assistant` (a recipient may also follow the role)."""

    name = "harmony"
    starts = ("<|channel|>", "<|start|>", "<|message|>")
    ends = ("<|call|>",)
    special_tokens = True
    BODY_END = re.compile(r"<\|(?:end|call|return)\|>")
    CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
    RECIPIENT = re.compile(r"\bto=([^\s<]+)")

    def parse(self, text: str) -> Parsed:
        if "<|message|>" not in text:
            return Parsed(text)
        content, calls = [], []
        for segment in text.split("<|start|>"):
            header, marker, body = segment.partition("<|message|>")
            if not marker:
                continue
            end = self.BODY_END.search(body)
            body = body[:end.start()] if end else body
            channel = self.CHANNEL.search(header)
            recipient = self.RECIPIENT.search(header)
            if recipient and recipient[1].startswith("functions."):
                arguments = _arguments(body.strip())
                if arguments is not None:
                    calls.append(ToolCall(recipient[1].removeprefix("functions."), arguments))
                    continue
            if recipient is None and (channel is None or channel[1] in ("final", "commentary")):
                content.append(body)
        return Parsed("".join(content), calls)

    def forcing_grammar(self, functions: list[dict]) -> str:
        """The call as the commentary channel's message to functions.NAME (the generation prompt opened the
        assistant's message: `<|start|>assistant`)."""
        from ..inference.grammar import named_call_grammar

        return named_call_grammar(functions, '<|channel|> "commentary to=functions."',
                                  '" " <|constrain|> "json" <|message|>', "<|call|>")


@register
class Llama4PythonicParser(ToolCallParser):
    """The whole output (inside <|python_start|> ... <|python_end|> if the tokenizer kept them) a Python list of
    calls with keyword arguments whose values are literals."""

    name = "llama4_pythonic"
    starts = ("[", "<|python_start|>")
    anchored = True

    def parse(self, text: str) -> Parsed:
        code = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not (code.startswith("[") and code.endswith("]")):
            return Parsed(text)
        try:
            tree = ast.parse(code, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return Parsed(text)
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return Parsed(text)
                arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
                if None in arguments:   # **kwargs
                    return Parsed(text)
                calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return Parsed(text)
        return Parsed("", calls)


@register
class Llama4JsonParser(ToolCallParser):
    """The whole output (after <|python_tag|> if kept) JSON calls {"name", "parameters"} separated by ";"."""

    name = "llama4_json"
    starts = ("{", "<|python_tag|>")
    anchored = True

    def parse(self, text: str) -> Parsed:
        rest = text.strip().removeprefix("<|python_tag|>").strip()
        if not rest.startswith("{"):
            return Parsed(text)
        decoder, calls = json.JSONDecoder(), []
        while rest:
            try:
                value, end = decoder.raw_decode(rest)
            except (ValueError, RecursionError):
                return Parsed(text)
            call = _json_call(json.dumps(value), keys=("parameters", "arguments"))
            if call is None:
                return Parsed(text)
            calls.append(call)
            rest = rest[end:].strip()
            if rest.startswith(";"):
                rest = rest[1:].strip()
            elif rest:
                return Parsed(text)
        return Parsed("", calls)

    def forcing_grammar(self, functions: list[dict]) -> str:
        from ..inference.grammar import tool_call_grammar

        return tool_call_grammar(functions, "", "", arguments_key="parameters")


class ToolCallStream:
    """One streamed choice's text through a parser: `feed(delta, finished)` -> (the content to send now, the calls
    completed since the last feed). Text before a possible start marker streams as it comes; from a start marker
    on the text is held, each call sent once its end marker has arrived, and what is outside the calls sent at
    the end. The content and calls sent add up to `parser.parse` of the whole text."""

    def __init__(self, parser: ToolCallParser):
        self.parser, self.text = parser, ""
        self.sent = 0          # characters of the text sent as content
        self.start = None      # where the held calls begin
        self.plain = False     # anchored parser, output not beginning with a marker: all content
        self.emitted = 0       # calls sent

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        self.text += delta
        content = ""
        if self.start is None:
            start, hold = self._start()
            if start is None:
                end = len(self.text) if finished else len(self.text) - hold
                opener = self.parser.special_open
                if opener and not finished and (cut := self.text.rfind(opener, self.sent, end)) >= 0 and \
                        self.parser.special_close not in self.text[cut + len(opener):]:
                    end = cut   # maybe a special token's beginning
                content, self.sent = self.parser.clean(self.text[self.sent:end]), end
                return content, []
            self.start = start
            content, self.sent = self.parser.clean(self.text[self.sent:start]), start
        section = self.text[self.start:]
        if finished:
            parsed = self.parser.parse(section)
            content += parsed.content
            calls = parsed.calls[self.emitted:]
        else:
            cut = max((section.rfind(end) + len(end) for end in self.parser.ends if end in section), default=0)
            calls = self.parser.parse(section[:cut]).calls[self.emitted:] if cut else []
        self.emitted += len(calls)
        return content, calls

    def _start(self) -> tuple[int | None, int]:
        """(Where the calls begin, or None; characters at the end to hold back: they may begin a marker.)"""
        text, starts = self.text, self.parser.starts
        if self.parser.anchored:
            if self.plain:
                return None, 0
            body = len(text) - len(text.lstrip())
            if any(text.startswith(start, body) for start in starts):
                return body, 0
            if any(start.startswith(text[body:]) for start in starts):   # maybe a marker, maybe not yet
                return None, len(text) - self.sent
            self.plain = True
            return None, 0
        found = [index for index in (text.find(start, self.sent) for start in starts) if index >= 0]
        if found:
            return min(found), 0
        hold = 0
        for start in starts:
            for size in range(min(len(start) - 1, len(text) - self.sent), hold, -1):
                if text.endswith(start[:size]):
                    hold = size
                    break
        return None, hold


def tool_call_entries(calls: list[ToolCall], ids: list[str], first: int = 0, *, streamed: bool = False) -> list[dict]:
    """OpenAI's `tool_calls` entries ({"id", "type": "function", "function": {"name", "arguments"}}; streamed:
    with their "index" in the choice's calls, counting from `first`)."""
    entries = []
    for n, (call, call_id) in enumerate(zip(calls, ids)):
        entry = {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        entries.append({"index": first + n, **entry} if streamed else entry)
    return entries
