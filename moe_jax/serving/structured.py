"""Structured output's request fields (both endpoints): OpenAI's response_format and vLLM's guided_regex /
guided_json, checked and turned into the engine's grammar (`inference.grammar`, llguidance).

    response_format {"type": "text"}                                   no constraint (the default)
    response_format {"type": "json_object"}                            any JSON object
    response_format {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}
    guided_json {...} (a JSON schema), guided_regex "..."              vLLM's extensions

At most one of them per request. An unknown type, a json_schema without a schema, a schema or a regular expression
llguidance refuses, and llguidance missing are 400s. Outputs are compact JSON (no whitespace between tokens);
a choice that reaches max_tokens before its grammar is complete is cut (finish_reason "length").
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(BaseModel):
    """response_format, guided_json, guided_regex; `grammar()`: the engine's grammar text, or None."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    _grammar: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _compiled(self):
        from .protocol import InvalidRequest

        kind = self.response_format.type if self.response_format is not None else "text"
        if kind not in RESPONSE_FORMATS:
            raise InvalidRequest(f"response_format type {kind!r} is not supported: use one of "
                                 f"{', '.join(RESPONSE_FORMATS)}.", param="response_format")
        asked = [name for name, on in (("response_format", kind != "text"), ("guided_json", self.guided_json
                 is not None), ("guided_regex", self.guided_regex is not None)) if on]
        if len(asked) > 1:
            raise InvalidRequest(f"{' and '.join(asked)}: at most one structured-output constraint per request.",
                                 param=asked[1])
        if not asked:
            return self
        from ..inference import grammar

        param = asked[0]
        try:
            if param == "guided_regex":
                self._grammar = grammar.regex_grammar(self.guided_regex)
            elif param == "guided_json":
                self._grammar = grammar.json_schema_grammar(self.guided_json)
            elif kind == "json_object":
                self._grammar = grammar.json_object_grammar()
            else:
                schema = self.response_format.json_schema
                if schema is None or schema.schema_ is None:
                    raise ValueError('response_format type "json_schema" needs json_schema: {"name": ..., '
                                     '"schema": {...}}.')
                self._grammar = grammar.json_schema_grammar(schema.schema_)
        except ValueError as error:
            raise InvalidRequest(f"{param}: {error}", param=param) from None
        return self

    def grammar(self) -> str | None:
        return self._grammar
