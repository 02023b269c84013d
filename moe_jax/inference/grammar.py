"""Structured output: a request's grammar (a JSON schema, any JSON object, a regular expression) as a token
mask per step, from llguidance (`pip install "moe_jax[serve]"`, or `pip install llguidance`).

    grammar = json_schema_grammar({"type": "object", ...})      # or regex_grammar("[a-z]+"), json_object_grammar()
    RequestSettings(grammar=grammar)                            # the grammar's serialized text: hashable
    engine.enable_grammars(tokenizer_json)                      # the checkpoint's tokenizer.json, once

The engine keeps one `GrammarMatcher` per request (on its `Request`): `allowed` is the bitmask of the tokens the
grammar allows next (int32 [ceil(V / 32)], bit v % 32 of word v // 32: token v; V the model's vocabulary, whose
ids beyond the tokenizer's are never allowed), which the scheduler writes into the request's rows and the step
applies on the device (a disallowed token's logit is -inf). After each token the host advances the matcher and
computes the next mask at once, while the step's outputs are handed over and before the next step is built
(on the engine's thread: no pool). The request ends ("stop") when its grammar is complete and
nothing may follow. The tokenizer's EOS ids are allowed only where they end the request anyway (its
eos_token_id / stop_token_ids): a checkpoint without an EOS token ends where the grammar does.
"""

from __future__ import annotations

import json

import numpy as np


# Compiled grammars kept for reuse (the oldest dropped first).
TEMPLATES = 64


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - fill_next_token_bitmask
    except ImportError:
        raise ValueError('structured output (response_format, guided_regex, guided_json) needs llguidance: '
                         'pip install "moe_jax[serve]" (or pip install llguidance).') from None
    return llguidance


def json_schema_grammar(schema: dict | str) -> str:
    """A JSON schema's grammar (compact JSON: no whitespace between tokens). Raises ValueError for a schema
    llguidance refuses."""
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                         defaults={"whitespace_flexible": False})
    except (TypeError, ValueError) as error:
        raise ValueError(f"the JSON schema is not valid: {error}") from None
    return checked(grammar)


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    """The text matching a regular expression (vLLM's guided_regex)."""
    return checked(_llguidance().LLMatcher.grammar_from_regex(pattern))


def tool_call_grammar(functions: list[dict], prefix: str, suffix: str, arguments_key: str = "arguments") -> str:
    """A call of one of `functions` (OpenAI's function objects: name, parameters) written as `prefix`, the JSON
    object {"name": ..., arguments_key: ...} (the arguments by the function's parameters schema; compact JSON),
    `suffix`: tool_choice "required" or a named function, in a JSON tool-call syntax (Hermes:
    "<tool_call>\\n", "\\n</tool_call>"; Llama 4's JSON: "", "", "parameters")."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
              "properties": {"name": {"const": function["name"]},
                             arguments_key: function.get("parameters") or {"type": "object"}}}
             for function in functions]
    schema = {"x-guidance": {"whitespace_flexible": False}, "anyOf": calls}
    lark = f"start: {json.dumps(prefix)} call {json.dumps(suffix)}\ncall: %json {json.dumps(schema)}"
    try:
        return checked(_llguidance().LLMatcher.grammar_from_lark(lark))
    except (TypeError, ValueError) as error:
        raise ValueError(f"the tools' parameters are not a valid JSON schema: {error}") from None


def named_call_grammar(functions: list[dict], before: str, between: str, after: str) -> str:
    """A call of one of `functions` written as `before`, the function's name, `between`, its arguments as compact
    JSON by its parameters schema, `after`: tool_choice "required" or a named function in a syntax whose name
    stands outside the arguments' JSON. before / between / after are Lark fragments: quoted text and special tokens
    by their text (DeepSeek-V3's `<｜tool▁sep｜>`, gpt-oss's `<|call|>`), which must be the tokenizer's."""
    rules = []
    for index, function in enumerate(functions):
        schema = {"x-guidance": {"whitespace_flexible": False}, **(function.get("parameters") or {"type": "object"})}
        rules += [f"call_{index}: {before} {json.dumps(function['name'])} {between} arguments_{index} {after}",
                  f"arguments_{index}: %json {json.dumps(schema)}"]
    lark = "start: " + " | ".join(f"call_{index}" for index in range(len(functions))) + "\n" + "\n".join(rules)
    try:
        return checked(_llguidance().LLMatcher.grammar_from_lark(lark))
    except (TypeError, ValueError) as error:
        raise ValueError(f"the tools' parameters are not a valid JSON schema: {error}") from None


def checked(grammar: str) -> str:
    """`grammar` if llguidance accepts it, else ValueError with its message."""
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"the grammar is not valid: {error}")
    return grammar


def mask_words(vocab_size: int) -> int:
    """The int32 words of a bitmask over `vocab_size` tokens."""
    return -(-vocab_size // 32)


class Grammars:
    """A checkpoint's tokenizer for llguidance (from its tokenizer.json text) and the model's vocabulary size."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids=()):
        llg = _llguidance()
        eos = [int(token) for token in eos_token_ids if token is not None]
        self.tokenizer = llg.LLTokenizer(tokenizer_json, eos_token=eos or None)
        self.vocab_size, self.words = vocab_size, mask_words(vocab_size)
        self._llg_words = mask_words(self.tokenizer.vocab_size)
        # Tokens the model may emit at all: the tokenizer's ids within the model's vocabulary (padding ids: never).
        self.limit = min(self.tokenizer.vocab_size, vocab_size)
        self._templates: dict[str, object] = {}   # grammar text -> a compiled matcher at its start

    def matcher(self, grammar: str, stop_ids=()) -> GrammarMatcher:
        """A matcher at the start of `grammar` (ValueError if llguidance refuses it); stop_ids: the ids that end
        the request (the only EOS ids it may emit)."""
        template = self._templates.get(grammar)
        if template is None:   # compiled once per grammar (n choices, repeated schemas), then copied
            template = _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(f"the grammar is not valid: {template.get_error()}")
            if len(self._templates) >= TEMPLATES:
                self._templates.pop(next(iter(self._templates)), None)
            self._templates[grammar] = template
        return GrammarMatcher(self, template.deep_copy(), stop_ids)


class GrammarMatcher:
    """One request's place in its grammar and the bitmask of its next token (`allowed`)."""

    def __init__(self, grammars: Grammars, matcher, stop_ids):
        self.grammars, self.matcher = grammars, matcher
        self.blocked = [token for token in grammars.tokenizer.eos_tokens if token not in set(stop_ids)]
        self.allowed = np.zeros(grammars.words, np.int32)
        self._scratch = np.zeros((1, grammars._llg_words), np.int32)
        if not self._fill():
            raise ValueError("the grammar allows no token at its start.")

    def advance(self, token: int) -> bool:
        """Consume the request's new token -> whether the grammar is done (complete with nothing allowed after,
        or broken); if not, `allowed` is the next token's mask."""
        if not self.matcher.consume_token(int(token)) or self.matcher.is_stopped():
            return True
        return not self._fill()   # nothing allowed but an EOS the request may not emit: done

    def _fill(self) -> bool:
        """`allowed` <- the next token's mask -> whether it allows any token."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._scratch)
        words = min(self.grammars.words, self._scratch.shape[1])
        self.allowed[:] = 0
        self.allowed[:words] = self._scratch[0, :words]
        bits = self.allowed.view(np.uint32)
        limit = self.grammars.limit
        if limit % 32:   # ids past the tokenizer's (or the model's) vocabulary: never
            bits[limit // 32] &= np.uint32((1 << (limit % 32)) - 1)
        bits[-(-limit // 32):] = 0
        for token in self.blocked:
            if token < self.grammars.vocab_size:
                bits[token // 32] &= ~np.uint32(1 << (token % 32))
        return bool(bits.any())
