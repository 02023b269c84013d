"""The server's responses: one HTTP request's choices (each one manager request, `Generation`), waited for or
streamed, shaped as OpenAI's bodies and server-sent events, with their log probabilities.

    generations = [Generation(server, request_id, prompt, stops, streaming, index=i) for i in range(n)]
    outputs = await finished_outputs(generations, http_request)        # None: the client went away
    completion_body(server, generations, outputs, top=..., echo=...)   # or chat_body; or:
    stream(server, generations, chat=..., include_usage=..., top=..., echo=...)   # the events, `data: [DONE]` last

Log probabilities (the engine's: the model's raw distribution, `RequestSettings`), in OpenAI's shapes:
completions `{"tokens", "token_logprobs", "top_logprobs": [{token text: logprob}], "text_offset"}`, chat
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`; a token's text
is the tokenizer's decoding of it alone, its bytes that text's UTF-8. A streamed chunk carries the log
probabilities of the tokens that arrived since the previous chunk (its text may be held back for later ones).

Tool calls (chat, with a `tool_calls.ToolCallParser`): the text is parsed into the message's `content` (the text
outside the calls, null when only calls) and `tool_calls` ([{"id": "call_...", "type": "function", "function":
{"name", "arguments": JSON text}}]), finish_reason "tool_calls"; streamed, each call is one delta
{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]} once the call is complete.

Routing (the `return_routing` extension): a finished choice's `"routing": {"shape": [L, N, K], "dtype": "int16",
"data": base64 of the little-endian array}` (`routing_entry`), the expert ids each of the model's L sparse layers
ran for each of the choice's N tokens (prompt, then generated; `GenerationOutput.routing`); streamed, in the
choice's last chunk (the one with its finish_reason).
"""

# No `from __future__ import annotations`, as app.py.
import asyncio
import base64
import json
import secrets
import time

from .protocol import InvalidRequest
from .text import TextStream, cut_at_stop
from .tool_calls import ToolCallStream, tool_call_entries

FINISH_REASONS = {"stop": "stop", "length": "length"}
# The failures the engine reports for a request, as HTTP statuses.
FAILURE_STATUS = {"queue_timeout": 503, "shutdown": 503, "error": 500, "engine_error": 500}


def finish_reason(output, called: bool = False) -> str:
    """OpenAI's finish_reason; `called`: the choice made tool calls ("tool_calls" where it stopped by itself)."""
    reason = FINISH_REASONS.get(output.finish_reason, "stop")
    return "tool_calls" if called and reason == "stop" else reason


def routing_entry(routing) -> dict:
    """routing: a numpy int array -> {"shape", "dtype", "data": base64 of its little-endian bytes, row-major}."""
    little = routing.astype(routing.dtype.newbyteorder("<"), copy=False)
    return {"shape": list(routing.shape), "dtype": routing.dtype.name,
            "data": base64.b64encode(little.tobytes(order="C")).decode("ascii")}


def _with_routing(choice: dict, generation) -> dict:
    """`choice` with its routing, when its request recorded it."""
    if generation.routing is not None:
        choice["routing"] = routing_entry(generation.routing)
    return choice


def call_ids(count: int) -> list[str]:
    return [f"call_{secrets.token_hex(12)}" for _ in range(count)]


def _decode(server, tools):
    """The decoding the text is shown with: with the special tokens where the tool-call markers are some."""
    special = getattr(server.tokenizer, "decode_special", None)
    return special if tools is not None and tools.special_tokens and special is not None else server.tokenizer.decode


def sse(payload) -> str:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


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


class Generation:
    """One choice's manager request: its id, its queue of outputs, and how it ends."""

    def __init__(self, server, request_id: str, prompt: list[int], stops: list[str], streaming: bool, index: int = 0):
        self.server, self.request_id, self.prompt, self.stops = server, request_id, prompt, stops
        self.streaming, self.index = streaming, index
        self.model = server.model_name   # the model the request named (a LoRA adapter's name, or the base's)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.tokens: list[int] = []   # the generated tokens so far (incremental outputs put together)
        self.logprobs: list[float] = []   # theirs, when asked for
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.routing = None   # the finished output's, with return_routing

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
                self.logprobs, self.top_logprobs = list(output.logprobs), list(output.top_logprobs)
                self.routing = output.routing
                return output
            end = output.offset + len(output.generated_tokens)
            if end > len(self.tokens):
                self.tokens[output.offset:] = output.generated_tokens
                self.logprobs[output.offset:] = output.logprobs
                self.top_logprobs[output.offset:] = output.top_logprobs
                latest = output
        return latest

    async def finished_output(self):
        while not (output := await self.next_output()).is_finished():
            pass
        return output


async def finished_outputs(generations: list[Generation], http_request):
    """Every choice's finished output; None if the client disconnects first (every choice is cancelled)."""
    gone = asyncio.ensure_future(_disconnected(http_request))
    waiting = asyncio.ensure_future(asyncio.gather(*(generation.finished_output() for generation in generations)))
    try:
        done, _ = await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        return waiting.result() if waiting in done else None
    finally:
        for task in (gone, waiting):
            if not task.done():
                task.cancel()
        for generation in generations:
            generation.close()


async def _disconnected(http_request) -> None:
    """Returns when the client has disconnected (the body is read: the next ASGI message is the disconnect)."""
    while True:
        message = await http_request.receive()
        if message.get("type") == "http.disconnect":
            return


def usage(generations: list[Generation], outputs) -> dict:
    """The prompt's tokens once (and of them, those the first choice read from the prefix cache), the choices'
    generated tokens together."""
    prompt, completion = len(generations[0].prompt), sum(len(output.generated_tokens) for output in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": outputs[0].cached_tokens}}


def _text(server, generation: Generation, output, decode=None) -> str:
    return cut_at_stop((decode or server.tokenizer.decode)(list(output.generated_tokens)), generation.stops)


def completion_logprobs(decode, tokens: list[int], logprobs: list[float], top: list, offset: int = 0) -> dict:
    """Completions' logprobs object of `tokens`; text_offset counts from `offset` characters."""
    texts = [decode([token]) for token in tokens]
    offsets = [offset + sum(map(len, texts[:i])) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": list(logprobs),
            "top_logprobs": [{decode([i]): value for i, value in entry} for entry in top] if top else None,
            "text_offset": offsets}


def chat_logprobs(decode, tokens: list[int], logprobs: list[float], top: list) -> dict:
    """Chat's logprobs object of `tokens`."""
    def entry(token: int, logprob: float) -> dict:
        text = decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(entry(token, logprob), top_logprobs=[entry(i, value) for i, value in
                                                                  (top[n] if top else [])])
                        for n, (token, logprob) in enumerate(zip(tokens, logprobs))]}


def _logprobs(server, generation: Generation, start: int, end: int, *, chat: bool, offset: int = 0) -> dict:
    tokens, logprobs = generation.tokens[start:end], generation.logprobs[start:end]
    top = generation.top_logprobs[start:end]
    if chat:
        return chat_logprobs(server.tokenizer.decode, tokens, logprobs, top)
    return completion_logprobs(server.tokenizer.decode, tokens, logprobs, top, offset)


def completion_body(server, generations: list[Generation], outputs, *, top: int | None, echo: str = "") -> dict:
    choices = []
    for generation, output in zip(generations, outputs):
        logprobs = None if top is None else _logprobs(server, generation, 0, len(generation.tokens), chat=False)
        choices.append(_with_routing({"index": generation.index, "text": echo + _text(server, generation, output),
                                      "logprobs": logprobs, "finish_reason": finish_reason(output)}, generation))
    return {"id": generations[0].request_id, "object": "text_completion", "created": int(time.time()),
            "model": generations[0].model, "choices": choices, "usage": usage(generations, outputs)}


def chat_body(server, generations: list[Generation], outputs, *, top: int | None, tools=None) -> dict:
    """tools: the `ToolCallParser` whose calls become `tool_calls` (None: the text is the content)."""
    choices = []
    for generation, output in zip(generations, outputs):
        logprobs = None if top is None else _logprobs(server, generation, 0, len(generation.tokens), chat=True)
        message = {"role": "assistant", "content": _text(server, generation, output, _decode(server, tools))}
        if tools is not None:   # the content: the text outside the calls (as streamed)
            parsed = tools.parse(message["content"])
            message["content"] = parsed.content if parsed.content.strip() or not parsed.calls else None
            if parsed.calls:
                message["tool_calls"] = tool_call_entries(parsed.calls, call_ids(len(parsed.calls)))
        choices.append(_with_routing({"index": generation.index, "message": message, "logprobs": logprobs,
                                      "finish_reason": finish_reason(output, "tool_calls" in message)}, generation))
    return {"id": generations[0].request_id, "object": "chat.completion", "created": int(time.time()),
            "model": generations[0].model, "choices": choices, "usage": usage(generations, outputs)}


async def stream(server, generations: list[Generation], *, chat: bool, include_usage: bool, top: int | None = None,
                 echo: str = "", tools=None):
    """The server-sent events of a streaming request (its choices' chunks as they come), ending with
    `data: [DONE]`; tools: chat's `ToolCallParser` (None: no tool calls parsed)."""
    created, request_id = int(time.time()), generations[0].request_id
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, text: str | None, finish: str | None = None, *, role: bool = False,
              logprobs: dict | None = None, calls: list | None = None) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return {"id": request_id, "object": kind, "created": created, "model": generations[0].model,
                "choices": [choice]}

    texts = [TextStream(_decode(server, tools), generation.stops) for generation in generations]
    parsers = [ToolCallStream(tools) if tools is not None else None for _ in generations]
    called = [0] * len(generations)    # tool calls sent, per choice
    sent = [0] * len(generations)      # tokens whose log probabilities were sent, per choice
    offsets = [len(echo)] * len(generations)   # completions' text_offset of the next token, per choice
    pending: dict = {}
    try:
        for generation in generations:
            if chat:
                yield sse(chunk(generation.index, None, role=True))
            elif echo:
                yield sse(chunk(generation.index, echo))
        pending = {asyncio.ensure_future(generation.next_output()): generation for generation in generations}
        finished = []
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                generation = pending.pop(future)
                output, i = future.result(), generation.index
                if (failed := failure(output)) is not None:
                    yield sse(failed.body())
                    include_usage = False
                    break
                delta = texts[i].update(generation.tokens, output.is_finished())   # a few tokens decoded: inline
                calls = None
                if parsers[i] is not None:
                    delta, new_calls = parsers[i].feed(delta, output.is_finished())
                    calls = tool_call_entries(new_calls, call_ids(len(new_calls)), called[i], streamed=True)
                    called[i] += len(new_calls)
                logprobs = None
                if top is not None and len(generation.tokens) > sent[i]:
                    logprobs = _logprobs(server, generation, sent[i], len(generation.tokens), chat=chat,
                                         offset=offsets[i])
                    if not chat:
                        offsets[i] += sum(map(len, logprobs["tokens"]))
                    sent[i] = len(generation.tokens)
                if delta or logprobs is not None or calls:
                    yield sse(chunk(i, delta or (None if calls else delta), logprobs=logprobs, calls=calls))
                if output.is_finished():
                    last = chunk(i, None, finish_reason(output, called[i] > 0))
                    _with_routing(last["choices"][0], generation)
                    yield sse(last)
                    finished.append(output)
                else:
                    pending[asyncio.ensure_future(generation.next_output())] = generation
            if failed is not None:
                break
        if include_usage:
            yield sse({"id": request_id, "object": kind, "created": created, "model": generations[0].model,
                       "choices": [], "usage": usage(generations, finished)})
        yield sse("[DONE]")
    finally:
        for future in pending:
            future.cancel()
        for generation in generations:
            generation.close()
