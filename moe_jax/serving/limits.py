"""What one request may hold, checked while its body is parsed, before any costly work.

    limits = RequestLimits.for_context(max_model_len=4096, token_chars=16)    # the longest token: 16 characters
    body = parse_bounded(raw, limits)          # JSON, or InvalidRequest the moment a bound is passed

`json.loads` builds a whole body before anything can look at it (megabytes of `[1,1,1,...]` become millions of
ints, built while the GIL is held), and the size checks that follow it see only the fields they know. Here a body
is parsed value by value, and every value counts, wherever it is (a message's role or name, a tool schema, a field
this server ignores): at most `max_values` values (array items, object members and scalars), at most `max_items`
in one array or object, at most `max_chars` characters in all strings and keys together, at most `max_depth`
levels of nesting, numbers of at most `max_number_chars` characters. Each bound follows from the context: no
request can use more, since a prompt of max_model_len tokens holds at most max_model_len ids, or max_model_len x
the longest token's characters of text. The parse stops at the first value over a bound, so the work and memory a
refused body costs are those of the values before it. `body_bytes` is the largest body such a request can take
in JSON (every character escaped): the guard refuses longer bodies before reading them, and bodies with more than
`max_commas` commas as soon as they have arrived, before reading the rest (megabytes of token ids).

Malformed JSON, NaN / Infinity, lone UTF-16 surrogates and text that is not UTF-8 are 400s, as `protocol.parse_json`
has them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from json.decoder import scanstring

from .protocol import InvalidRequest

# A text prompt may have at most max_model_len x the longest token's characters x this many characters (slack for
# normalizers that fold several characters into one) before it is refused without tokenizing.
PROMPT_CHARS_SLACK = 2
# Characters per token assumed when the tokenizer cannot tell its longest token.
FALLBACK_TOKEN_CHARS = 64
# Characters of strings a request may hold besides its prompt: stop strings (16 x 256), roles, names, the model's
# name, tool schemas the server reads and ignores.
EXTRA_CHARS = 1 << 16
# Values besides the prompt's (fields, stop strings, logit_bias entries...), and values per prompt token (a chat
# message is an object, its role and its content; every message adds at least one token to the prompt).
EXTRA_VALUES = 4096
VALUES_PER_TOKEN = 8
# Bytes of JSON one character can take: a character outside the BMP written as two \\uXXXX escapes.
JSON_BYTES_PER_CHAR = 12
# Characters of an echoed name (a model id, a Host header) kept in an error message.
SHOWN_CHARS = 64

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"(-?(?:0|[1-9][0-9]*))(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONSTANTS = {"true": True, "false": False, "null": None}


@dataclass(frozen=True)
class RequestLimits:
    """The bounds `parse_bounded` holds a body to (see the module's docstring)."""

    max_values: int = 1 << 20
    max_items: int = 1 << 18
    max_chars: int = 8 << 20
    max_depth: int = 64
    max_number_chars: int = 64
    prompt_chars: int = 4 << 20   # the longest text prompt (or chat messages' text) tokenized

    @classmethod
    def for_context(cls, max_model_len: int, token_chars: int | None, *,
                    prompt_chars: int | None = None) -> RequestLimits:
        """The bounds for a server whose context is `max_model_len` tokens of at most `token_chars` characters
        (None: unknown, FALLBACK_TOKEN_CHARS); prompt_chars: the longest text prompt it tokenizes (default
        max_model_len x token_chars x PROMPT_CHARS_SLACK)."""
        token_chars = token_chars or FALLBACK_TOKEN_CHARS
        prompt_chars = prompt_chars or max_model_len * token_chars * PROMPT_CHARS_SLACK
        return cls(max_values=VALUES_PER_TOKEN * max_model_len + EXTRA_VALUES, max_items=max(max_model_len, 1024),
                   max_chars=prompt_chars + EXTRA_CHARS, prompt_chars=prompt_chars)

    @property
    def max_commas(self) -> int:
        """The most commas a body within these bounds holds: one between two values, or one character of text."""
        return self.max_values + self.max_chars

    @property
    def body_bytes(self) -> int:
        """The largest body a request within these bounds can take: every character escaped, every value a
        number of the longest kind (with its separator and a little whitespace)."""
        return JSON_BYTES_PER_CHAR * self.max_chars + (self.max_number_chars + 4) * self.max_values


def shown(text: str) -> str:
    """`text` as an error message may echo it: at most SHOWN_CHARS characters, then "..."."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def parse_bounded(raw: bytes, limits: RequestLimits) -> object:
    """The body as JSON, or InvalidRequest: 400 when it is not valid JSON, 400 `context_length_exceeded` when it
    holds more than `limits` allow (said which bound, without reading further)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequest(f"the request body is not UTF-8: {error}") from None
    parser = _Parser(text, limits)
    value, end = parser.value(_WHITESPACE.match(text, 0).end(), 0)
    end = _WHITESPACE.match(text, end).end()
    if end != len(text):
        parser.malformed("extra data", end)
    return value


class _Parser:
    def __init__(self, text: str, limits: RequestLimits):
        self.text, self.limits = text, limits
        self.values = self.chars = 0

    def malformed(self, what: str, at: int):
        raise InvalidRequest(f"the request body is not valid JSON: {what} at character {at}.")

    def over(self, what: str):
        raise InvalidRequest(f"the request body holds {what}: more than a request to this server can use (its "
                             "context bounds the prompt's tokens and characters).", code="context_length_exceeded")

    def count(self) -> None:
        self.values += 1
        if self.values > self.limits.max_values:
            self.over(f"more than {self.limits.max_values} values")

    def string(self, start: int) -> tuple[str, int]:
        """The string whose opening quote is at `start`, counted."""
        try:
            value, end = scanstring(self.text, start + 1, True)
        except ValueError as error:   # unterminated, a control character, a bad escape
            self.malformed(getattr(error, "msg", "a bad string").lower(), start)
        self.chars += len(value)
        if self.chars > self.limits.max_chars:
            self.over(f"more than {self.limits.max_chars} characters of text")
        if _SURROGATE.search(value):
            raise InvalidRequest("the request body holds text with a lone UTF-16 surrogate (e.g. \\ud800 unpaired): "
                                 "text must be valid Unicode.")
        return value, end

    def value(self, at: int, depth: int) -> tuple[object, int]:
        """The value starting at `at` (no whitespace before it) and where it ends."""
        self.count()
        text = self.text
        char = text[at:at + 1]
        if char == '"':
            return self.string(at)
        if char in ("{", "["):
            if depth >= self.limits.max_depth:
                raise InvalidRequest(f"the request body nests too deeply (more than {self.limits.max_depth} levels).")
            return (self.object if char == "{" else self.array)(at + 1, depth + 1)
        number = _NUMBER.match(text, at)
        if number is not None:
            end = number.end()
            if end - at > self.limits.max_number_chars:
                self.malformed(f"a number of {end - at} characters (at most {self.limits.max_number_chars})", at)
            integer, fraction, exponent = number.groups()
            return (float(text[at:end]) if fraction or exponent else int(integer)), end
        for word, constant in _CONSTANTS.items():
            if text.startswith(word, at):
                return constant, at + len(word)
        self.malformed("expecting a value", at)

    def array(self, at: int, depth: int) -> tuple[list, int]:
        items, text = [], self.text
        at = _WHITESPACE.match(text, at).end()
        if text[at:at + 1] == "]":
            return items, at + 1
        while True:
            if len(items) >= self.limits.max_items:
                self.over(f"an array of more than {self.limits.max_items} items")
            item, at = self.value(at, depth)
            items.append(item)
            at = _WHITESPACE.match(text, at).end()
            char = text[at:at + 1]
            if char == "]":
                return items, at + 1
            if char != ",":
                self.malformed("expecting ',' or ']'", at)
            at = _WHITESPACE.match(text, at + 1).end()

    def object(self, at: int, depth: int) -> tuple[dict, int]:
        members, text = {}, self.text
        at = _WHITESPACE.match(text, at).end()
        if text[at:at + 1] == "}":
            return members, at + 1
        while True:
            if len(members) >= self.limits.max_items:
                self.over(f"an object of more than {self.limits.max_items} members")
            if text[at:at + 1] != '"':
                self.malformed("expecting a property name in double quotes", at)
            key, at = self.string(at)
            at = _WHITESPACE.match(text, at).end()
            if text[at:at + 1] != ":":
                self.malformed("expecting ':'", at)
            members[key], at = self.value(_WHITESPACE.match(text, at + 1).end(), depth)
            at = _WHITESPACE.match(text, at).end()
            char = text[at:at + 1]
            if char == "}":
                return members, at + 1
            if char != ",":
                self.malformed("expecting ',' or '}'", at)
            at = _WHITESPACE.match(text, at + 1).end()
