"""`build_app`: the OpenAI-compatible HTTP API (FastAPI) over a `ContinuousBatchingManager`.

    POST /v1/completions         prompt (text or token ids) -> text; streamed as server-sent events with stream
    POST /v1/chat/completions    messages through the checkpoint's chat template -> the assistant's message
    GET  /v1/models              the one served model
    GET  /health                 200 {"status": "ok"} while the engine's thread runs (503 after it failed, and
                                 while draining)
    GET  /metrics                Prometheus text: slots, pages, requests, tokens/s, latency summaries

Each HTTP request is one manager request (its id is the response's id). The engine's thread hands outputs to
the request's asyncio queue through `loop.call_soon_threadsafe`; a streaming request gets one output per token
and sends the new text of each (`TextStream`: whole-sequence decoding, incomplete characters and possible
stop-string starts held back), a plain request waits for the finished output. A client that goes away
(closes a stream, or drops a plain request's connection) has its request cancelled, so its slot and pages
serve the next one. Client errors are OpenAI's error object with 400 (bad JSON, bad parameters, a prompt the
context cannot hold) or 404 (an unknown model), never a 500.

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
from contextlib import asynccontextmanager
from dataclasses import replace

from ..inference.manager import QueueFull
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
from .text import TextStream, cut_at_stop

# Seconds the lifespan's shutdown waits for the manager to finish the requests it holds.
DRAIN_TIMEOUT_S = 30.0
FINISH_REASONS = {"stop": "stop", "length": "length"}
# Threads that parse requests, tokenize prompts and render chat templates (off the event loop).
TEXT_WORKERS = 4
# Retry-After of a 429: seconds a client should wait before asking again.
RETRY_AFTER_S = 1
# The failures the engine reports for a request, as HTTP statuses.
FAILURE_STATUS = {"queue_timeout": 503, "shutdown": 503, "error": 500, "engine_error": 500}
logger = logging.getLogger("moe_jax.serving")


def _finish_reason(output) -> str:
    return FINISH_REASONS.get(output.finish_reason, "stop")


def _sse(payload) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


class _Generation:
    """One HTTP request's manager request: its id, its queue of outputs, and how it ends."""

    def __init__(self, server: "_Server", request_id: str, prompt: list[int], stops: list[str], streaming: bool):
        self.server, self.request_id, self.prompt, self.stops = server, request_id, prompt, stops
        self.streaming = streaming
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.tokens: list[int] = []   # the generated tokens so far (incremental outputs put together)

    def close(self) -> None:
        """Cancel the manager's request unless it finished (idempotent): the client is gone."""
        if not self.finished:
            self.finished = True
            self.server.manager.cancel_request(self.request_id)

    async def next_output(self):
        """The latest output once something new arrived: every output waiting in the queue is taken (a reader
        that fell behind catches up in one go), their tokens added to `tokens`."""
        latest = None
        while latest is None or (not latest.is_finished() and not self.queue.empty()):
            output = await self.queue.get()
            if output.is_finished():
                self.finished = True
                self.tokens = list(output.generated_tokens)
                return output
            end = output.offset + len(output.generated_tokens)
            if end > len(self.tokens):
                self.tokens[output.offset:] = output.generated_tokens
                latest = output
        return latest

    async def finished_output(self, http_request):
        """The finished output; the request is cancelled if the client disconnects first."""
        gone = asyncio.ensure_future(_disconnected(http_request))
        getter = None
        try:
            while True:
                getter = asyncio.ensure_future(self.next_output())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    return None
                output = getter.result()
                if output.is_finished():
                    return output
        finally:
            for task in (gone, getter):
                if task is not None and not task.done():
                    task.cancel()
            self.close()


async def _disconnected(http_request) -> None:
    """Returns when the client has disconnected (the body is read: the next ASGI message is the disconnect)."""
    while True:
        message = await http_request.receive()
        if message.get("type") == "http.disconnect":
            return


class _Server:
    def __init__(self, manager, tokenizer, model_name: str, max_model_len: int, max_prompt_chars: int | None = None):
        self.manager, self.tokenizer = manager, tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.vocab_size = manager.engine.model.config.vocab_size
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
        if body.model is not None and body.model != self.model_name:
            raise InvalidRequest(f"The model `{shown(body.model)}` does not exist: this server serves "
                                 f"`{self.model_name}`.", param="model", code="model_not_found", status=404)

    def check_sampling(self, body: SamplingFields) -> None:
        """What the protocol cannot check alone: top_k within the vocabulary."""
        if body.top_k is not None and body.top_k > self.vocab_size:
            raise InvalidRequest(f"top_k={body.top_k} is larger than the vocabulary ({self.vocab_size} tokens); use "
                                 "0 or -1 for no top-k filter.", param="top_k")

    def check_prompt_chars(self, chars: int, what: str) -> None:
        """Refuse text that could not fit the context whatever its tokens, before tokenizing it."""
        if chars > self.max_prompt_chars:
            raise InvalidRequest(f"the {what} has {chars} characters: more than this model's context of "
                                 f"{self.max_model_len} tokens can hold (at most {self.max_prompt_chars} characters).",
                                 param=what, code="context_length_exceeded")

    def submit(self, prefix: str, prompt: list[int], max_tokens: int | None, body: SamplingFields,
               *, what: str) -> _Generation:
        """Queue the request in the manager and route its outputs to a new `_Generation`'s queue."""
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest(f"This model's maximum context length is {self.max_model_len} tokens; the "
                                 f"{what} has {len(prompt)}, which leaves no room for a new token.",
                                 param=what, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt)
        streaming = bool(body.stream)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        generation = _Generation(self, request_id, prompt, body.stop_strings(), streaming)
        seed = body.seed if body.seed is not None else secrets.randbits(32)
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
                                     **body.sampling())
        except ValueError as error:
            raise InvalidRequest(str(error), param=what if "prompt" in str(error) else None) from None
        except QueueFull as error:
            raise InvalidRequest(str(error), status=429, code="queue_full", kind="server_error",
                                 headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RuntimeError:   # stopping, or stopped after an engine error
            raise InvalidRequest("the server is shutting down or restarting and takes no new requests; retry.",
                                 status=503, kind="server_error") from None
        return generation

    # ---- responses ------------------------------------------------------------------------------------
    def usage(self, generation: _Generation, output) -> dict:
        prompt, completion = len(generation.prompt), len(output.generated_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def text(self, generation: _Generation, output) -> str:
        return cut_at_stop(self.tokenizer.decode(list(output.generated_tokens)), generation.stops)

    @staticmethod
    def failure(output):
        """A FAILED output as the error the client gets (an engine failure's details stay in the log)."""
        if output.status.name != "FAILED":
            return None
        reason = output.finish_reason or "engine_error"
        status = FAILURE_STATUS.get(reason, 500)
        if reason == "engine_error":
            return InvalidRequest("the engine failed while running this request; the server is restarting.",
                                  status=500, kind="server_error", code="engine_error")
        return InvalidRequest(f"the request failed: {output.error}" if reason == "error" else output.error,
                              status=status, kind="server_error" if status >= 500 else "invalid_request_error",
                              code=reason)

    async def stream(self, generation: _Generation, *, chat: bool, include_usage: bool):
        """The server-sent events of a streaming request, ending with `data: [DONE]`."""
        created, request_id = int(time.time()), generation.request_id
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            return {"id": request_id, "object": kind, "created": created, "model": self.model_name,
                    "choices": [choice]}

        text = TextStream(self.tokenizer.decode, generation.stops)
        try:
            if chat:
                yield _sse(chunk(None, role=True))
            while True:
                output = await generation.next_output()
                if (failure := self.failure(output)) is not None:
                    yield _sse(failure.body())
                    break
                delta = text.update(generation.tokens, output.is_finished())   # a few tokens decoded: inline
                if delta:
                    yield _sse(chunk(delta))
                if output.is_finished():
                    yield _sse(chunk(None, _finish_reason(output)))
                    if include_usage:
                        yield _sse({"id": request_id, "object": kind, "created": created, "model": self.model_name,
                                    "choices": [], "usage": self.usage(generation, output)})
                    break
            yield _sse("[DONE]")
        finally:
            generation.close()

    def completion_body(self, generation: _Generation, output) -> dict:
        return {"id": generation.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "text": self.text(generation, output), "logprobs": None,
                             "finish_reason": _finish_reason(output)}],
                "usage": self.usage(generation, output)}

    def chat_body(self, generation: _Generation, output) -> dict:
        message = {"role": "assistant", "content": self.text(generation, output)}
        return {"id": generation.request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": _finish_reason(output)}],
                "usage": self.usage(generation, output)}

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
        self.check_sampling(body)
        return body, self.chat_prompt(body)

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
        messages = [message.as_template_input() for message in body.messages]
        self.check_prompt_chars(sum(len(text) for message in messages for text in message.values()), "messages")
        try:
            return list(apply(messages))
        except Exception as error:  # noqa: BLE001 - the template's own checks (roles, order) reject the messages
            raise InvalidRequest(f"the chat template cannot render these messages: {error}",
                                 param="messages") from None


def build_app(manager, tokenizer, *, model_name: str, max_model_len: int, drain_timeout: float = DRAIN_TIMEOUT_S,
              guard: GuardSettings | None = None, max_prompt_chars: int | None = None):
    """The FastAPI app serving `manager` (started at the app's startup if it is not running; stopped at its
    shutdown, after finishing the requests it holds, up to `drain_timeout` seconds). tokenizer: a
    `CheckpointTokenizer` (decode; encode for text prompts; apply_chat_template for chat). guard: the access
    rules (`GuardSettings`: API key, origins, hosts, body size, at most what `limits` allow; default: none but
    those);
    max_prompt_chars: the longest text prompt tokenized (default: max_model_len x the longest token x 2)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.exceptions import HTTPException
    except ImportError as error:
        raise ImportError(f'the server needs fastapi and uvicorn: pip install "moe_jax[serve]" ({error})') from None

    server = _Server(manager, tokenizer, model_name, max_model_len, max_prompt_chars)

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

        def __init__(self, content, generation: _Generation):
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.generation = generation

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.generation.close()

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
        generation = server.submit("cmpl", prompt, body.max_tokens, body, what="prompt")
        if body.stream:
            return CancellingStream(server.stream(generation, chat=False, include_usage=body.include_usage()),
                                    generation)
        output = await generation.finished_output(request)
        if output is None:   # the client is gone: nobody reads a response
            return PlainTextResponse("", status_code=499)
        if (failure := server.failure(output)) is not None:
            return error_response(failure)
        return JSONResponse(server.completion_body(generation, output))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, prompt = await server.off_loop(server.chat_input, await request.body())
        generation = server.submit("chatcmpl", prompt, body.new_tokens(), body, what="messages")
        if body.stream:
            return CancellingStream(server.stream(generation, chat=True, include_usage=body.include_usage()),
                                    generation)
        output = await generation.finished_output(request)
        if output is None:
            return PlainTextResponse("", status_code=499)
        if (failure := server.failure(output)) is not None:
            return error_response(failure)
        return JSONResponse(server.chat_body(generation, output))

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "moe_jax",
                "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_name:
            raise InvalidRequest(f"The model `{shown(name)}` does not exist: this server serves `{model_name}`.",
                                 param="model", code="model_not_found", status=404)
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
