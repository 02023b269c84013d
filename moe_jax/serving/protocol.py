"""The OpenAI request bodies the server reads (pydantic), and OpenAI's error shape.

    CompletionRequest       POST /v1/completions          prompt (text or token ids), max_tokens (default 16)
    ChatCompletionRequest   POST /v1/chat/completions     messages, max_completion_tokens / max_tokens

Sampling as OpenAI: temperature (default 1.0; 0 is greedy), top_p, seed, stop (a string or a list); top_k is
an extension (0: off, as OpenAI has none). One choice per request: n != 1, echo, and a list of several prompts
are refused. Fields OpenAI has and this server does not use (logprobs, presence_penalty, user, ...) are read
and ignored, as unknown fields are.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class InvalidRequest(ValueError):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return error_body(self.message, param=self.param, code=self.code, kind=self.kind)


def error_body(message: str, *, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None   # None: the served model
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)   # extension; 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n is not None and n != 1:
            raise ValueError(f"n={n} is not supported: this server returns one choice per request (n=1).")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not text for text in stops):
            raise ValueError("stop strings must not be empty.")
        return stops or None

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    def sampling(self) -> dict:
        """The manager's sampling keywords: temperature 0 is greedy (OpenAI's semantics, not a division by 0)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        top_k = max(self.top_k or 0, 0)
        if temperature == 0:
            return dict(do_sample=False, temperature=1.0, top_k=0, top_p=1.0)
        return dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo):
        if echo:
            raise ValueError("echo=true is not supported.")
        return echo

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

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
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _text_only(self):
        for message in self.messages:
            message.as_template_input()
        return self

    def new_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) over max_tokens; None: up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(model: type[BaseModel], body: object) -> BaseModel:
    """`body` (parsed JSON) as `model`, or InvalidRequest with the first problem, as OpenAI reports it."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = [str(part) for part in first.get("loc", ())]
        param = where[0] if where else None
        message = first.get("msg", "invalid value")
        message = message.removeprefix("Value error, ")
        raise InvalidRequest(f"{'.'.join(where) or 'body'}: {message}", param=param) from None
