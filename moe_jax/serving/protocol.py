"""The OpenAI request bodies the server reads (pydantic), and OpenAI's error shape.

    CompletionRequest       POST /v1/completions          prompt (text or token ids), max_tokens (default 16)
    ChatCompletionRequest   POST /v1/chat/completions     messages, max_completion_tokens / max_tokens

Sampling as OpenAI: temperature (default 1.0; 0, or below 1e-5 as vLLM, is greedy), top_p in (0, 1], seed (a
64-bit integer), stop (a string or a list: at most 16 strings of at most 256 characters), presence_penalty and
frequency_penalty in [-2, 2], logit_bias ({"token id": bias in [-100, 100]}, at most 300 entries), n choices (at
most 16; each samples with seed + its index), log probabilities (completions: logprobs = how many top tokens, at
most 20; chat: logprobs true and top_logprobs at most 20), echo (completions; not with logprobs: the prompt's
log probabilities are not computed), best_of (completions: only equal to n; choosing the best of more is not
supported). Tools (chat): `tools` (OpenAI's function tools, at most 128) reach the chat template; with tool_choice
"auto" (the default with tools) the server parses the model's calls into `tool_calls`, with "none" it does not;
"required" and a named function force a call through a grammar of the parser's syntax (the app builds it; every
parser but llama4_pythonic has one). Messages may hold an assistant's `tool_calls` and "tool" messages (`tool_call_id`). vLLM's extensions: top_k
(0 or -1: off; at most the vocabulary, which the server checks), repetition_penalty in (0, 100] (1: off),
min_tokens, stop_token_ids (at most 16). moe_jax's extension: return_routing (a boolean; each choice then carries
the expert ids its tokens ran, `choices.routing_entry`). Structured output (response_format, guided_json, guided_regex):
`structured`. Every bound is checked here, so nothing out of range reaches the engine; a boolean where a number is
due is refused. A list of several prompts is refused with a 400 that says so. Fields this server does not use and
that change nothing in the output (user, ...) are read and ignored, as unknown fields are.

`parse_json` turns a body into JSON for these models (`limits.parse_bounded`, which bounds what it may hold):
malformed JSON, NaN / Infinity, numbers of more than 64 characters, nesting deeper than 64 levels and text with lone
UTF-16 surrogates are all 400s, and so is `true` or `false` where a number is due (pydantic would take true for 1).
"""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from ..inference.manager import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from ..inference.sampling import MIN_TEMPERATURE
from .structured import StructuredFields

# Stop strings per request and characters per stop string (the engine scans every new token's text for them).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1
INT32_MAX = (1 << 31) - 1
# completions' max_tokens when absent or null (OpenAI's default).
DEFAULT_COMPLETION_TOKENS = 16
# Choices per request (n; each is one engine request) and stop_token_ids per request.
MAX_CHOICES = 16
MAX_STOP_TOKEN_IDS = 16
# Tools per chat request, and characters of a tool's name.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 256
# The numeric fields a JSON boolean must not stand for (pydantic would read true as 1).
NUMBERS = ("temperature", "top_p", "top_k", "seed", "n", "best_of", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "min_tokens", "top_logprobs", "max_tokens", "max_completion_tokens")


class InvalidRequest(ValueError):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, param=self.param, code=self.code, kind=self.kind)


def error_body(message: str, *, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingFields(StructuredFields):
    """What both endpoints share (structured output's fields: `structured`)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None   # None: the served model
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)   # extension; 0 or -1: off
    seed: int | None = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = Field(default=None, gt=0, le=100)   # extensions (vLLM's)
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    return_routing: StrictBool | None = False   # extension (routing replay)

    @field_validator(*NUMBERS, mode="before", check_fields=False)
    @classmethod
    def _not_a_boolean(cls, value, info):
        if isinstance(value, bool):
            raise ValueError(f"{info.field_name} must be a number, not a boolean.")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, bias):
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError('logit_bias must be an object {"token id": bias}.')
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"{len(bias)} entries: at most {MAX_LOGIT_BIAS} are allowed.")
        for token, value in bias.items():
            if not token.isascii() or not token.isdigit() or len(token) > 10:
                raise ValueError(f"the key {token[:20]!r} is not a token id (a non-negative integer).")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ValueError(f"the bias of token {token} must be a number in [-100, 100].")
        return bias

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, ids):
        if any(token < 0 or token > INT32_MAX for token in ids or ()):
            raise ValueError("token ids must be non-negative integers.")
        return ids

    @model_validator(mode="after")
    def _min_tokens_fit(self):
        limit = getattr(self, "max_tokens", None)
        limit = getattr(self, "max_completion_tokens", None) or limit
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            raise InvalidRequest(f"min_tokens={self.min_tokens} is more than the {limit} tokens asked for.",
                                 param="min_tokens")
        return self

    def logprob_count(self) -> int | None:
        """None: no log probabilities; k: each token's and the k likeliest tokens'."""
        raise NotImplementedError

    def controls(self) -> dict:
        """The manager's logits-control keywords (`RequestSettings`) this request sets."""
        top = self.logprob_count()
        controls = dict(logprobs=top is not None, top_logprobs=top or 0,
                        logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
                        presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                        repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                        min_tokens=self.min_tokens or 0, stop_token_ids=tuple(self.stop_token_ids or ()))
        if self.return_routing:
            controls["return_routing"] = True
        if self.grammar() is not None:   # structured output
            controls["grammar"] = self.grammar()
        return controls

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not text for text in stops):
            raise ValueError("stop strings must not be empty.")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stops)} stop strings: at most {MAX_STOP_STRINGS} are allowed.")
        if any(len(text) > MAX_STOP_CHARS for text in stops):
            raise ValueError(f"a stop string of {max(map(len, stops))} characters: at most {MAX_STOP_CHARS} are "
                             "allowed.")
        return stops or None

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    def sampling(self) -> dict:
        """The manager's sampling keywords: temperature 0 is greedy (OpenAI's semantics, not a division by 0), and
        so is one below 1e-5 (vLLM's rule: dividing by it overflows, and the draw is the argmax anyway)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        top_k = max(self.top_k or 0, 0)
        if temperature < MIN_TEMPERATURE:
            return dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0)
        return dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_TOKENS, ge=1)
    echo: bool | None = False
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_is_a_count(cls, value):
        if isinstance(value, bool):
            raise ValueError(f"logprobs is a count of top tokens in [0, {MAX_TOP_LOGPROBS}] here (completions), "
                             "not a boolean.")
        return value

    @model_validator(mode="after")
    def _choices(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise InvalidRequest(f"best_of={self.best_of} with n={self.n or 1}: best_of other than n is not "
                                 "supported (every choice generated is returned).", param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("echo with logprobs is not supported: this server does not compute the prompt's "
                                 "log probabilities.", param="echo")
        return self

    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("max_tokens")
    @classmethod
    def _default_tokens(cls, max_tokens):
        """null is the default (OpenAI's 16), not "up to the context"."""
        return DEFAULT_COMPLETION_TOKENS if max_tokens is None else max_tokens

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_type(cls, prompt):
        if isinstance(prompt, str) or (isinstance(prompt, list) and all(
                isinstance(item, (int, str)) or (isinstance(item, list) and all(isinstance(i, int) for i in item))
                for item in prompt) and not any(isinstance(item, bool) for item in prompt)):
            return prompt
        raise ValueError("the prompt must be a string or a list of token ids.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError(f"{len(prompt)} prompts in one request: this server takes one prompt per "
                                 "request (a string or a list of token ids).")
            return prompt[0]
        return prompt


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    description: str | None = None
    parameters: dict[str, typing.Any] | None = None   # a JSON schema
    strict: bool | None = None


class ToolSpec(BaseModel):
    """{"type": "function", "function": {"name", "description", "parameters"}}."""

    model_config = ConfigDict(extra="ignore")

    type: typing.Literal["function"]
    function: FunctionSpec


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, typing.Any] = "{}"   # OpenAI's: JSON text


class ToolCallEntry(BaseModel):
    """An assistant message's call: {"id", "type": "function", "function": {"name", "arguments"}}."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: str = "function"
    function: FunctionCall

    def as_template_input(self) -> dict:
        """As Transformers' templates read a call: the arguments an object where they are JSON text of one (as
        vLLM passes them; a template may write `arguments | tojson`), else the text as given."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        entry = {"type": self.type, "function": {"name": self.function.name, "arguments": arguments}}
        return entry if self.id is None else {"id": self.id, **entry}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallEntry] | None = None   # an assistant's calls
    tool_call_id: str | None = None                 # a "tool" message: the call it answers

    def as_template_input(self) -> dict:
        """{"role", "content"} as chat templates read it (text parts joined; only text is supported)."""
        content = self.content
        if isinstance(content, list):
            others = sorted({part.type for part in content if part.type != "text"})
            if others:
                raise ValueError(f"content parts of type {', '.join(others)} are not supported (text only).")
            content = "".join(part.text or "" for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_input() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, typing.Any] | None = None

    @model_validator(mode="after")
    def _tool_choice(self):
        choice = self.tool_choice
        if choice is None or choice == "none":
            return self
        if not self.tools:
            raise InvalidRequest("tool_choice needs tools.", param="tool_choice")
        if choice in ("auto", "required"):
            return self
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if choice.get("type") == "function" and isinstance(name, str) if isinstance(choice, dict) else False:
            if name not in {tool.function.name for tool in self.tools}:
                raise InvalidRequest(f"tool_choice names the function {name[:64]!r}, which is not among the tools.",
                                     param="tool_choice")
            return self
        raise InvalidRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                             '{"name": ...}}.', param="tool_choice")

    def forced_functions(self) -> list[dict] | None:
        """The functions one of which the output must call (tool_choice "required": every tool's; a named
        function: its), None where no call is forced."""
        choice = self.tool_choice
        if not self.tools or choice in (None, "none", "auto"):
            return None
        functions = [tool.model_dump(exclude_none=True)["function"] for tool in self.tools]
        return functions if choice == "required" else [f for f in functions if f["name"] == choice["function"]["name"]]

    def force_grammar(self, grammar: str) -> None:
        """Generate under `grammar` (a forced tool call's; refused beside another structured-output constraint)."""
        if self.grammar() is not None:
            raise InvalidRequest("a forced tool call (tool_choice) and response_format / guided_json / guided_regex: "
                                 "at most one constraint per request.", param="tool_choice")
        self._grammar = grammar

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template reads them (`tools`); None without any."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def parses_tool_calls(self) -> bool:
        """Whether the output's tool calls become `tool_calls` (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @model_validator(mode="after")
    def _text_only(self):
        for message in self.messages:
            message.as_template_input()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true.", param="top_logprobs")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def new_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) over max_tokens; None: up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_json(raw: bytes, limits=None) -> object:
    """The request body as JSON, or InvalidRequest (400) saying what is wrong with it; parsed within `limits`
    (`limits.RequestLimits`; default: its generous defaults, which bound nesting to 64 levels)."""
    from .limits import RequestLimits, parse_bounded

    return parse_bounded(raw, limits or RequestLimits())


def parse_request(model: type[BaseModel], body: object) -> BaseModel:
    """`body` (parsed JSON) as `model`, or InvalidRequest with the first problem, as OpenAI reports it."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object.")
    for name, field in model.model_fields.items():   # pydantic takes true for 1 where a number is due
        if isinstance(body.get(name), bool) and _numeric(field.annotation):
            raise InvalidRequest(f"{name}: a number is due, not {str(body[name]).lower()}.", param=name)
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidRequest):   # a check across fields, naming the field it refuses
            raise InvalidRequest(f"{cause.param}: {cause.message}", param=cause.param) from None
        where = [str(part) for part in first.get("loc", ())]
        param = where[0] if where else None
        message = first.get("msg", "invalid value")
        message = message.removeprefix("Value error, ")
        raise InvalidRequest(f"{'.'.join(where) or 'body'}: {message}", param=param) from None


def _numeric(annotation) -> bool:
    """Whether a field of this type takes a number and not a boolean (e.g. `int | None`, not `bool | int`)."""
    kinds = {typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind
             for kind in typing.get_args(annotation) or (annotation,)}
    return bool(kinds & {int, float}) and bool not in kinds
