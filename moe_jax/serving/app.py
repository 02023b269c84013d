"""`build_app`: the OpenAI-compatible HTTP API (FastAPI) over a `ContinuousBatchingManager`.

    POST /v1/completions         prompt (text or token ids) -> text; streamed as server-sent events with stream
    POST /v1/chat/completions    messages (and tools) through the checkpoint's chat template -> the assistant's
                                 message; its tool calls parsed into `tool_calls` (`tool_calls.py`)
    GET  /v1/models              the served model, and each LoRA adapter of the model's set (`parent`: the model)
    GET  /health                 200 {"status": "ok"} while the engine's thread runs (503 after it failed, and
                                 while draining)
    GET  /metrics                Prometheus text: slots, pages, requests, tokens/s, latency summaries

Each choice of an HTTP request (`n`) is one manager request (the first's id is the response's id; the
responses and events are `choices.py`'s). The engine's thread hands outputs to
the request's asyncio queue through `loop.call_soon_threadsafe`; a streaming request gets one output per token
and sends the new text of each (`TextStream`: whole-sequence decoding, incomplete characters and possible
stop-string starts held back), a plain request waits for the finished output. A client that goes away
(closes a stream, or drops a plain request's connection) has its request cancelled, so its slot and pages
serve the next one. Client errors are OpenAI's error object with 400 (bad JSON, bad parameters, a prompt the
context cannot hold) or 404 (an unknown model), never a 500. Where the model holds several LoRA adapters
(`model.load_adapters`), a request's `model` names one of them (or the base): requests of different adapters share
the engine's steps, and the responses name the model asked for.

Under hostile or heavy traffic (docs/inference.md, "Running it in production"): `AccessGuard` checks the headers,
Host, Origin, API key, content type and body size before a handler runs; a body is parsed within bounds the context
sets (`limits`), every bound checked before the engine; parsing, tokenizing and chat templates run on a small
thread pool and streams detokenize a few tokens at a time, so a large request does not stall other streams; text
longer than the context could hold is refused before it is tokenized; beyond the manager's queue bound a request
gets 429 with Retry-After, past its queue timeout 503; only an engine failure (logged, not in responses) fails all.

OpenAI's semantics where they differ from `generate`'s defaults: temperature 1.0 unless given (0: greedy),
no top-k (the `top_k` extension sets one), max_tokens 16 for completions and up to the context for chat, a
random seed unless given, and stop strings cut from the text. A request asking for more tokens than the
context has room for stops at the context with finish_reason "length".
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (`Request`, imported inside
# build_app to keep FastAPI optional) at runtime.
import asyncio
import json
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import replace

from ..inference.manager import QueueFull
from .choices import Generation, chat_body, completion_body, failure, finished_outputs, stream
from .guard import DEFAULT_MAX_REQUEST_BYTES, AccessGuard, GuardSettings
from .limits import RequestLimits, shown
from .metrics import LatencyStats, prometheus_text
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    SamplingFields,
    error_body,
    parse_json,
    parse_request,
)
from .tool_calls import default_parser, tool_call_parser

# Seconds the lifespan's shutdown waits for the manager to finish the requests it holds.
DRAIN_TIMEOUT_S = 30.0
# Threads that parse requests, tokenize prompts and render chat templates (off the event loop).
TEXT_WORKERS = 4
# Retry-After of a 429: seconds a client should wait before asking again.
RETRY_AFTER_S = 1
logger = logging.getLogger("moe_jax.serving")


class _Server:
    def __init__(self, manager, tokenizer, model_name: str, max_model_len: int, max_prompt_chars: int | None = None,
                 tool_parser: str | None = None):
        self.manager, self.tokenizer = manager, tokenizer
        if tool_parser is None:   # the model's family's syntax, where known
            tool_parser = default_parser(getattr(manager.engine.model.config, "model_type", None))
        self.tool_parser = None if tool_parser in (None, "none") else tool_call_parser(tool_parser)
        self.model_name, self.max_model_len = model_name, max_model_len
        self.vocab_size = manager.engine.model.config.vocab_size
        self.adapters = tuple(getattr(manager.engine.model, "adapter_names", ()))   # served beside the base
        self.limits = RequestLimits.for_context(max_model_len, getattr(tokenizer, "max_token_chars", None),
                                                prompt_chars=max_prompt_chars)
        self.max_prompt_chars = self.limits.prompt_chars
        self.stats = LatencyStats()
        self.created = int(time.time())
        self.text_pool = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="moe-jax-text")

    async def off_loop(self, function, *args):
        """`function(*args)` on the text pool: the event loop keeps serving other streams meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, function, *args)

    # ---- requests -------------------------------------------------------------------------------------
    def check_model(self, body: SamplingFields) -> None:
        if body.model is not None and body.model != self.model_name and body.model not in self.adapters:
            raise InvalidRequest(f"The model `{shown(body.model)}` does not exist: this server serves "
                                 f"`{'`, `'.join((self.model_name, *self.adapters))}`.", param="model",
                                 code="model_not_found", status=404)

    def adapter_of(self, body: SamplingFields) -> str | None:
        """The LoRA adapter the request's `model` names (None: the base)."""
        return body.model if body.model in self.adapters else None

    def check_sampling(self, body: SamplingFields) -> None:
        """What the protocol cannot check alone: top_k and token ids within the vocabulary, a grammar against
        the tokenizer (structured output)."""
        if body.top_k is not None and body.top_k > self.vocab_size:
            raise InvalidRequest(f"top_k={body.top_k} is larger than the vocabulary ({self.vocab_size} tokens); use "
                                 "0 or -1 for no top-k filter.", param="top_k")
        for name, ids in (("logit_bias", map(int, body.logit_bias or {})), ("stop_token_ids", body.stop_token_ids)):
            if (outside := [token for token in ids or () if token >= self.vocab_size]):
                raise InvalidRequest(f"{name}: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size}).",
                                     param=name)
        grammars = getattr(self.manager.engine, "grammars", None)
        if body.grammar() is not None and grammars is not None:   # compiled here, off the event loop, and kept
            try:
                grammars.matcher(body.grammar())
            except ValueError as error:
                raise InvalidRequest(str(error), param=next((name for name in ("guided_regex", "guided_json")
                                                             if getattr(body, name) is not None), "response_format")
                                     ) from None

    def echo_text(self, body: CompletionRequest, prompt: list[int]) -> str:
        """With echo, the prompt's text, which the choices' text begins with ("" without)."""
        return "" if not body.echo else body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(prompt)

    def check_prompt_chars(self, chars: int, what: str) -> None:
        """Refuse text that could not fit the context whatever its tokens, before tokenizing it."""
        if chars > self.max_prompt_chars:
            raise InvalidRequest(f"the {what} has {chars} characters: more than this model's context of "
                                 f"{self.max_model_len} tokens can hold (at most {self.max_prompt_chars} characters).",
                                 param=what, code="context_length_exceeded")

    def submit(self, prefix: str, prompt: list[int], max_tokens: int | None, body: SamplingFields,
               *, what: str) -> list[Generation]:
        """Queue the request's n choices in the manager (choice i: request id `id-i` but the first's `id`, seed +
        i) and route each one's outputs to a new `Generation`'s queue; if one is refused, none runs."""
        seed = body.seed if body.seed is not None else secrets.randbits(32)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        generations = []
        try:
            for i in range(body.n or 1):
                generations.append(self._submit_one(f"{request_id}-{i}" if i else request_id, i, prompt,
                                                    max_tokens, body, seed + i, what=what))
        except InvalidRequest:
            for generation in generations:
                generation.close()
            raise
        return generations

    def _submit_one(self, request_id: str, index: int, prompt: list[int], max_tokens: int | None,
                    body: SamplingFields, seed: int, *, what: str) -> Generation:
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest(f"This model's maximum context length is {self.max_model_len} tokens; the "
                                 f"{what} has {len(prompt)}, which leaves no room for a new token.",
                                 param=what, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)
        streaming = bool(body.stream)
        generation = Generation(self, request_id, prompt, body.stop_strings(), streaming, index)
        adapter = self.adapter_of(body)
        generation.model = adapter or self.model_name
        loop = asyncio.get_running_loop()
        stats = self.stats

        def deliver(output) -> None:   # on the engine's thread, in order, from the request's first output
            try:
                if output.is_finished():
                    stats.record(output)
            except Exception:  # noqa: BLE001 - a statistic is not worth the request
                pass
            try:
                loop.call_soon_threadsafe(generation.queue.put_nowait, output)
            except RuntimeError:   # the event loop has closed
                pass

        try:
            self.manager.add_request(prompt, request_id=request_id, max_new_tokens=max_tokens, streaming=streaming,
                                     stop=generation.stops or None, seed=seed, handler=deliver, incremental=True,
                                     **({} if adapter is None else {"adapter": adapter}), **body.sampling(),
                                     **body.controls())
        except ValueError as error:
            raise InvalidRequest(str(error), param=what if "prompt" in str(error) else None) from None
        except QueueFull as error:
            raise InvalidRequest(str(error), status=429, code="queue_full", kind="server_error",
                                 headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RuntimeError:   # stopping, or stopped after an engine error
            raise InvalidRequest("the server is shutting down or restarting and takes no new requests; retry.",
                                 status=503, kind="server_error") from None
        return generation

    # ---- requests' inputs (on the text pool) -------------------------------------------------------------
    def completion_input(self, raw: bytes) -> tuple[CompletionRequest, list[int]]:
        """A completion request's body -> the request and its prompt's ids, or InvalidRequest."""
        body = parse_request(CompletionRequest, parse_json(raw, self.limits))
        self.check_model(body)
        self.check_sampling(body)
        return body, self.completion_prompt(body)

    def chat_input(self, raw: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        body = parse_request(ChatCompletionRequest, parse_json(raw, self.limits))
        self.check_model(body)
        if body.parses_tool_calls() and self.tool_parser is None:
            raise InvalidRequest(f'tool_choice {json.dumps(body.tool_choice or "auto")[:80]} needs a tool-call parser '
                                 "for this model's output: start the server with --tool-call-parser NAME (or send "
                                 'tool_choice "none").', param="tool_choice")
        forced = body.forced_functions()
        if forced is not None:   # "required" or a named function: a grammar of the parser's syntax forces the call
            grammar = self.tool_parser.forcing_grammar(forced)
            if grammar is None:
                raise InvalidRequest(f"tool_choice {json.dumps(body.tool_choice)[:80]} forces a call through a grammar "
                                     f"of the model's tool-call syntax, which the {self.tool_parser.name} parser does not "
                                     'have yet (hermes, deepseek_v3, harmony and llama4_json do); use "auto".', param="tool_choice")
            body.force_grammar(grammar)
        self.check_sampling(body)
        return body, self.chat_prompt(body)

    def chat_tools(self, body: ChatCompletionRequest):
        """The parser of the output's tool calls, None where they are not parsed."""
        return self.tool_parser if body.parses_tool_calls() else None

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        if isinstance(body.prompt, str):
            self.check_prompt_chars(len(body.prompt), "prompt")
            return list(self.tokenizer.encode(body.prompt))
        return list(body.prompt)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        apply = getattr(self.tokenizer, "apply_chat_template", None)
        if apply is None:
            raise InvalidRequest(f"The model `{self.model_name}` has no chat template (its tokenizer_config.json "
                                 "sets no chat_template, or Transformers, which applies templates, is not "
                                 "installed); use /v1/completions with a prompt instead.", param="messages")
        messages, tools = [message.as_template_input() for message in body.messages], body.tool_dicts()
        self.check_prompt_chars(_characters(messages) + _characters(tools), "messages")
        try:
            return list(apply(messages, tools=tools) if tools else apply(messages))
        except Exception as error:  # noqa: BLE001 - the template's own checks (roles, order) reject the messages
            raise InvalidRequest(f"the chat template cannot render these messages: {error}",
                                 param="messages") from None


def _characters(value) -> int:
    """The characters of the text in `value` (strings in nested lists and dicts, keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_characters(key) + _characters(item) for key, item in value.items())
    if isinstance(value, list):
        return sum(map(_characters, value))
    return 0


def build_app(manager, tokenizer, *, model_name: str, max_model_len: int, drain_timeout: float = DRAIN_TIMEOUT_S,
              guard: GuardSettings | None = None, max_prompt_chars: int | None = None,
              tool_call_parser: str | None = None):
    """The FastAPI app serving `manager` (started at the app's startup if it is not running; stopped at its
    shutdown, after finishing the requests it holds, up to `drain_timeout` seconds). tokenizer: a
    `CheckpointTokenizer` (decode; encode for text prompts; apply_chat_template for chat). guard: the access
    rules (`GuardSettings`: API key, origins, hosts, body size, at most what `limits` allow; default: none but
    those);
    max_prompt_chars: the longest text prompt tokenized (default: max_model_len x the longest token x 2);
    tool_call_parser: the syntax of the model's tool calls (`tool_calls.PARSERS`; default: its model_type's, if
    known; "none": tool calls are not parsed, and tool_choice "auto" is refused)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.exceptions import HTTPException
    except ImportError as error:
        raise ImportError(f'the server needs fastapi and uvicorn: pip install "moe_jax[serve]" ({error})') from None

    server = _Server(manager, tokenizer, model_name, max_model_len, max_prompt_chars, tool_call_parser)
    tokenizer_json = getattr(tokenizer, "tokenizer_json", None)
    if tokenizer_json is not None and getattr(manager.engine, "grammars", True) is None:
        with suppress(ValueError):   # no llguidance: requests with a grammar are refused (400)
            manager.engine.enable_grammars(tokenizer_json)   # structured output (`structured`)

    @asynccontextmanager
    async def lifespan(app):
        manager.start()
        yield
        await asyncio.to_thread(manager.stop, True, drain_timeout, drain=True)
        server.text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="moe_jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    guard = guard or GuardSettings()   # no more than a request within the limits can be: more would be refused
    guard = replace(guard, max_body_commas=server.limits.max_commas, max_request_bytes=min(
        guard.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES, server.limits.body_bytes))
    app.add_middleware(AccessGuard, settings=guard)

    class CancellingStream(StreamingResponse):
        """Cancels the generation however the response ends (the stream task can be cancelled mid-send)."""

        def __init__(self, content, generations: list[Generation]):
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.generations = generations

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                for generation in self.generations:
                    generation.close()

    def error_response(error: InvalidRequest):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers or None)

    @app.exception_handler(InvalidRequest)
    async def _invalid(request, error: InvalidRequest):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, error: RequestValidationError):
        return JSONResponse(error_body(str(error)), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request, error: HTTPException):
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(error.detail), kind=kind), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request, error: Exception):
        # The details go to the log, not to the client.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return JSONResponse(error_body("internal server error", kind="server_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, prompt = await server.off_loop(server.completion_input, await request.body())
        generations = server.submit("cmpl", prompt, body.max_tokens, body, what="prompt")
        echo = server.echo_text(body, prompt)
        if body.stream:
            return CancellingStream(stream(server, generations, chat=False, include_usage=body.include_usage(),
                                           top=body.logprob_count(), echo=echo), generations)
        outputs = await finished_outputs(generations, request)
        if outputs is None:   # the client is gone: nobody reads a response
            return PlainTextResponse("", status_code=499)
        if (failed := next(filter(None, map(failure, outputs)), None)) is not None:
            return error_response(failed)
        return JSONResponse(completion_body(server, generations, outputs, top=body.logprob_count(), echo=echo))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, prompt = await server.off_loop(server.chat_input, await request.body())
        generations = server.submit("chatcmpl", prompt, body.new_tokens(), body, what="messages")
        if body.stream:
            return CancellingStream(stream(server, generations, chat=True, include_usage=body.include_usage(),
                                           top=body.logprob_count(), tools=server.chat_tools(body)), generations)
        outputs = await finished_outputs(generations, request)
        if outputs is None:
            return PlainTextResponse("", status_code=499)
        if (failed := next(filter(None, map(failure, outputs)), None)) is not None:
            return error_response(failed)
        return JSONResponse(chat_body(server, generations, outputs, top=body.logprob_count(),
                                      tools=server.chat_tools(body)))

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "moe_jax",
                "max_model_len": max_model_len}

    def adapter_card(name: str) -> dict:   # vLLM's card of a LoRA adapter
        return {"id": name, "object": "model", "created": server.created, "owned_by": "moe_jax", "root": name,
                "parent": model_name, "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(), *map(adapter_card, server.adapters)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name in server.adapters:
            return adapter_card(name)
        if name != model_name:
            raise InvalidRequest(f"The model `{shown(name)}` does not exist: this server serves "
                                 f"`{'`, `'.join((model_name, *server.adapters))}`.", param="model",
                                 code="model_not_found", status=404)
        return model_card()

    @app.get("/health")
    async def health():
        if manager.error is not None or not manager.is_running():
            reason = "the engine failed" if manager.error is not None else "the engine's thread is not running"
            return JSONResponse({"status": "error", "error": reason}, status_code=503)
        if manager.is_draining():
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(manager.metrics(), server.stats, model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
