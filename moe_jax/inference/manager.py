"""`ContinuousBatchingManager`: a `ServingEngine` on a background thread, with Transformers' verbs.

    manager = model.init_continuous_batching(max_slots=8, max_model_len=512)
    manager.start()
    request_id = manager.add_request(prompt_ids, max_new_tokens=32, streaming=True)
    for output in manager.request_id_iter(request_id):      # one output per new token, the last one finished
        print(output.generated_tokens)
    manager.cancel_request(other_id)                         # frees its slot and pages at the next step
    manager.stop()

Requests are checked when added (a bad one raises in the caller's thread, nothing is queued); the engine's
thread admits them, steps, and delivers outputs: to the request's own queue (`get_result(request_id)`,
`request_id_iter`), or to a handler (`register_result_handler`, the server's path). Streaming requests get an
output per token (with `incremental`, only its new tokens: a slow reader's backlog stays linear in the output),
others one when they finish.

Under load: `max_queued` bounds the requests waiting for a slot (`add_request` raises `QueueFull` beyond it),
`queue_timeout` ends a request that waited longer (FAILED, finish_reason "queue_timeout"), and `begin_drain`
refuses new requests, ends the waiting ones (finish_reason "shutdown") and gives the running ones until a deadline.
A request whose own inputs break a step fails alone (FAILED, finish_reason "error"); a step whose program fails
ends every request with status FAILED and its error, and stops the thread (`error` keeps it).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator

from .continuous import (
    ContinuousBatchingConfig,
    GenerationOutput,
    Request,
    RequestSettings,
    RequestStatus,
    ServingEngine,
)
from .generation_config import GenerationConfig, eos_tuple
from .requests import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS  # noqa: F401 - the request bounds the server checks, here

# Seconds of history behind the tokens/s figure of `metrics()`.
RATE_WINDOW_S = 10.0
# Seconds between the idle messages a leading engine sends its followers (`ServingEngine.keep_followers_alive`).
KEEPALIVE_S = 2.0


class QueueFull(RuntimeError):
    """`add_request` with `max_queued` requests already waiting for a slot."""


def request_settings(generation_config: GenerationConfig, max_new_tokens: int | None = None, eos_token_id=None, *,
                     do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                     top_p: float | None = None, seed: int = 0, stop=None, prompt_length: int = 0,
                     **controls) -> RequestSettings:
    """A request's settings: the call's values over `generation_config` (Transformers' -1 EOS means none).
    controls: `RequestSettings`' logits controls (logprobs, top_logprobs, logit_bias, presence_penalty,
    frequency_penalty, repetition_penalty, min_tokens, stop_token_ids)."""
    config = generation_config.updated(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                       top_k=top_k, top_p=top_p)
    eos = config.eos_token_id if eos_token_id is None else eos_tuple(eos_token_id)
    eos = tuple(token for token in eos if token >= 0)
    stops = () if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop))
    return RequestSettings(max_new_tokens=config.new_tokens(prompt_length), eos_token_id=eos,
                           do_sample=config.do_sample, temperature=config.temperature, top_k=config.top_k,
                           top_p=config.top_p, seed=seed, stop=stops, **controls)


class ContinuousBatchingManager:
    def __init__(self, model, generation_config: GenerationConfig | None = None,
                 config: ContinuousBatchingConfig | None = None, *, params=None,
                 decode: Callable[[list[int]], str] | None = None, max_queued: int | None = None,
                 queue_timeout: float | None = None):
        """max_queued: requests that may wait for a slot at once (None: unbounded); queue_timeout: seconds a
        request may wait for a slot before it fails (None: forever)."""
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"max_queued={max_queued} must be >= 0 (None: unbounded).")
        if queue_timeout is not None and not queue_timeout > 0:
            raise ValueError(f"queue_timeout={queue_timeout} must be > 0 seconds (None: no timeout).")
        self.max_queued, self.queue_timeout = max_queued, queue_timeout
        self.generation_config = generation_config or model.generation_config
        self.engine = ServingEngine(model, config, params=params, decode=decode)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._incoming: deque[Request] = deque()
        self._cancels: deque[str] = deque()
        self._new_weights: deque[tuple] = deque()   # `update_parameters`' placed weights, for the engine's thread
        self._queues: dict[str, queue.Queue] = {}
        self._handlers: dict[str, Callable[[GenerationOutput], None]] = {}
        self._streaming: set[str] = set()
        self._incremental: set[str] = set()
        self._delivered: dict[str, int] = {}   # incremental requests: tokens handed over so far
        self._drain_deadline: float | None = None   # monotonic; set by begin_drain
        self._ready: queue.Queue[str] = queue.Queue()
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._accepting = True
        self._recent: deque[tuple[float, int]] = deque()
        self.finished_requests = 0
        self.error: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> ContinuousBatchingManager:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="moe-jax-continuous-batching", daemon=True)
            self._thread.start()
        return self

    def stop(self, block: bool = True, timeout: float | None = None, *, drain: bool = False) -> None:
        """Stop the thread; with `drain`, first stop accepting requests and finish the ones already added."""
        self._accepting = False
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.is_running() and (self._incoming or self.engine.has_work()):
                if deadline is not None and time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if block and self._thread is not None:
            self._thread.join(timeout)

    def begin_drain(self, timeout: float) -> None:
        """Start a shutdown without blocking: no new requests; the waiting ones end now (FAILED, finish_reason
        "shutdown"); the running ones have `timeout` seconds to finish, then end the same way. A drain under way
        keeps the earlier deadline: the server's second signal ends the running requests at once, and its shutdown
        hook, which can run after that signal, must not give them their time back."""
        self._accepting = False
        deadline = time.monotonic() + max(timeout, 0.0)
        if self._drain_deadline is None or deadline < self._drain_deadline:
            self._drain_deadline = deadline
        self._wake.set()

    def is_draining(self) -> bool:
        return self._drain_deadline is not None

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> ContinuousBatchingManager:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests ------------------------------------------------------------------------------------
    def settings(self, max_new_tokens: int | None = None, eos_token_id=None, **sampling) -> RequestSettings:
        """A request's settings: the call's values over the manager's generation config (`request_settings`)."""
        return request_settings(self.generation_config, max_new_tokens, eos_token_id, **sampling)

    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = True, eos_token_id=None,
                    handler: Callable[[GenerationOutput], None] | None = None, incremental: bool = False,
                    adapter: str | None = None, **sampling) -> str:
        """Queue a prompt (token ids) -> its request id. sampling: do_sample, temperature, top_k, top_p, seed,
        stop (strings; the manager needs `decode`) and the logits controls of `RequestSettings` (logprobs,
        top_logprobs, logit_bias, presence_penalty, frequency_penalty, repetition_penalty, min_tokens,
        stop_token_ids). handler: receives this request's outputs (on the engine's
        thread, in order) instead of its queue, from the first one. incremental: a streaming request's unfinished
        outputs carry only their new tokens (`GenerationOutput.offset` says where they start); the finished one
        carries all. adapter: the name of its LoRA adapter where the model holds several (`model.adapter_names`;
        None: the base); its cached prefix pages are shared only with the same adapter's requests. Raises ValueError
        for a request the engine cannot serve, `QueueFull` when `max_queued`
        requests wait already, RuntimeError while stopping."""
        if not self._accepting:
            raise RuntimeError("the manager is stopping and accepts no new requests.")
        if self.error is not None:
            raise RuntimeError(f"the manager stopped after an error: {self.error}")
        prompt = [int(token) for token in input_ids]
        self.engine.check_prompt(prompt)
        settings = self.settings(max_new_tokens, eos_token_id, prompt_length=len(prompt), **sampling)
        if adapter is not None:
            settings = dataclasses.replace(settings, adapter=self._adapter_index(adapter))
        with self._lock:
            request_id = request_id if request_id is not None else f"req_{next(self._counter)}"
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already in use.")
            request = Request(request_id, prompt, settings)
            self.engine.check(request)
            if self.max_queued is not None and self.waiting_requests() >= self.max_queued:
                raise QueueFull(f"{self.waiting_requests()} requests are waiting for a slot already (the queue "
                                f"holds {self.max_queued}); retry later.")
            self._queues[request_id] = queue.Queue()
            if handler is not None:
                self._handlers[request_id] = handler
            if streaming:
                self._streaming.add(request_id)
                if incremental:
                    self._incremental.add(request_id)
            self._incoming.append(request)
        self._wake.set()
        return request_id

    def update_parameters(self, params=None, *, adapter=None) -> None:
        """New weights from the engine's next step on (`ServingEngine.update_parameters`), from any thread: they
        are checked and placed on the devices here, and the engine's thread swaps them in between two steps (the
        step in flight keeps the weights it started with)."""
        weights = self.engine.programs.placed_weights(params, adapter)
        if not self.is_running():
            self.engine.use_weights(weights)
            return
        self._new_weights.append(weights)
        self._wake.set()

    def _adapter_index(self, name: str) -> int:
        names = tuple(getattr(self.engine.model, "adapter_names", ()))
        if name not in names:
            raise ValueError(f"adapter {name!r} is not loaded: the model holds "
                             f"{', '.join(map(repr, names)) or 'no adapter set (load_adapters)'}.")
        return names.index(name) + 1

    def waiting_requests(self) -> int:
        """Requests added and not yet in a slot."""
        return len(self._incoming) + len(self.engine.waiting)

    def add_requests(self, inputs, max_new_tokens: int | None = None, streaming: bool = False,
                     **kwargs) -> list[str]:
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming, **kwargs)
                for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """End a request at the next step (status FINISHED, finish_reason "cancelled"); its slot and pages
        are freed. Unknown or finished ids are ignored."""
        self._cancels.append(request_id)
        self._wake.set()

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Deliver this request's outputs to `callback` (called on the engine's thread) instead of its queue;
        outputs already queued are handed over first."""
        with self._lock:
            pending = self._queues.get(request_id)
            self._handlers[request_id] = callback
        while pending is not None and not pending.empty():
            callback(pending.get_nowait())

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output of `request_id` (or of any request), waiting up to `timeout` seconds; None if none."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                if request_id is not None:
                    owner = self._queues.get(request_id)
                    if owner is None:
                        return None
                    output = owner.get(timeout=remaining if remaining is not None else 3600)
                    if output.is_finished():
                        self._queues.pop(request_id, None)
                    return output
                ready = self._ready.get(timeout=remaining if remaining is not None else 3600)
            except queue.Empty:
                return None
            owner = self._queues.get(ready)
            if owner is not None and not owner.empty():
                output = owner.get_nowait()
                if output.is_finished():
                    self._queues.pop(ready, None)
                return output

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Every output of `request_id` as it comes, until the finished one (blocking)."""
        while True:
            output = self.get_result(request_id, timeout=0.1)
            if output is None:
                if not self.is_running() and self.error is not None:
                    return
                continue
            yield output
            if output.is_finished():
                return

    # ---- metrics -------------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Slots in use, pages free and cached, requests waiting / running / finished, prompt tokens (and those
        served from the prefix cache, and their ratio), tokens/s over the last seconds and,
        where experts are dispatched over ep, the pairs each ep rank computed per sparse layer (`sparse_layers`):
        ep_rank_load_total since the start, ep_rank_load_placed since the last expert re-placement."""
        engine, now = self.engine, time.perf_counter()
        rank_load = engine.programs.rank_load()
        ranks = {} if rank_load is None else dict(ep_rank_load_total=rank_load[0], ep_rank_load_placed=rank_load[1],
                                                  sparse_layers=engine.model.sparse_layers())
        recent = [(t, n) for t, n in list(self._recent) if now - t <= RATE_WINDOW_S]
        span = now - recent[0][0] if recent else 0.0
        return dict(slots_total=engine.config.max_slots, slots_in_use=engine.slots_in_use,
                    pages_total=engine.book.total_pages, pages_free=engine.book.free_pages(),
                    page_size=engine.config.page_size, requests_waiting=self.waiting_requests(),
                    requests_running=engine.slots_in_use, requests_finished=self.finished_requests,
                    generated_tokens=engine.generated_tokens, prefill_steps=engine.steps["prefill"],
                    decode_steps=engine.steps["decode"], mixed_steps=engine.steps["mixed"],
                    verify_steps=engine.steps["verify"], compiled_programs=len(engine.compiled_shapes),
                    prompt_tokens=engine.prefix_cache.prompt_tokens,
                    cached_prompt_tokens=engine.prefix_cache.cached_prompt_tokens,
                    prefix_cache_hit_rate=engine.prefix_cache.hit_rate, pages_cached=engine.book.cached_pages(),
                    draft_tokens=engine.draft_tokens, accepted_draft_tokens=engine.accepted_draft_tokens,
                    acceptance_rate=engine.acceptance_rate,
                    tokens_per_s=sum(n for _, n in recent) / span if span > 0 else 0.0, **ranks)

    # ---- the engine's thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        last_heard = time.monotonic()
        try:
            while not self._stop.is_set():
                while self._incoming:
                    request = self._incoming.popleft()
                    try:
                        engine.add(request)
                    except ValueError as error:   # checked when added; a late conflict fails this one only
                        request.output.status, request.output.finish_reason = RequestStatus.FAILED, "error"
                        request.output.error = str(error)
                        self._deliver(request.output, finished=True)
                while self._new_weights:
                    engine.use_weights(self._new_weights.popleft())
                while self._cancels:
                    cancelled = engine.cancel(self._cancels.popleft())
                    if cancelled is not None:
                        self._deliver(cancelled.output, finished=True)
                self._end_overdue()
                if not engine.has_work():
                    if engine.leading and time.monotonic() - last_heard > KEEPALIVE_S:
                        engine.keep_followers_alive()
                        last_heard = time.monotonic()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                events = engine.step()
                last_heard = time.monotonic()
                self._recent.append((time.perf_counter(), len(events)))
                while self._recent and time.perf_counter() - self._recent[0][0] > RATE_WINDOW_S:
                    self._recent.popleft()
                for event in events:
                    self._deliver(event.request.output, finished=event.finished, generated=event.generated)
        except BaseException as error:  # noqa: BLE001 - every request learns of it, then the thread ends
            self.error = error
            self._fail_all(error)
            return
        # Stopped: no reader waits forever for a request that will not run.
        for request in list(self.engine.requests.values()) + list(self._incoming):
            if not request.output.is_finished():
                self.engine.fail(request, "the server stopped before the request finished.", "shutdown")
                self._deliver(request.output, finished=True)

    def _end_overdue(self) -> None:
        """Fail the requests that waited past `queue_timeout`; while draining, the waiting ones, and at the
        drain's deadline the running ones too."""
        engine, now = self.engine, time.monotonic()
        ended: list[tuple] = []
        if self._drain_deadline is not None:
            ended += [(request, "shutdown", "the server is shutting down and did not start this request; retry.")
                      for request in engine.waiting]
            if now >= self._drain_deadline:
                ended += [(request, "shutdown", "the server is shutting down: the request did not finish in its "
                           "drain time.") for request in engine.slots if request is not None]
        elif self.queue_timeout is not None:
            # perf_counter: the clock of GenerationOutput.created_time.
            oldest_allowed = time.perf_counter() - self.queue_timeout
            ended += [(request, "queue_timeout", f"the request waited more than {self.queue_timeout:g} s for a "
                       "slot; retry later.") for request in engine.waiting
                      if request.output.created_time < oldest_allowed]
        for request, reason, message in ended:
            engine.fail(request, message, reason)
            self._deliver(request.output, finished=True)

    def _deliver(self, output: GenerationOutput, *, finished: bool, generated: int | None = None) -> None:
        """Hand `output` as it was after its first `generated` tokens (all by default) to its reader (an
        incremental request's unfinished outputs: only the tokens of this step)."""
        request_id = output.request_id
        if not finished and request_id not in self._streaming:
            return
        if not finished and request_id in self._incremental:
            end = len(output.generated_tokens) if generated is None else generated
            # The tokens since the previous event: one, or two when a prompt's last chunk and a decode share a step.
            start = self._delivered.get(request_id, 0)
            self._delivered[request_id] = end
            snapshot = dataclasses.replace(output, generated_tokens=output.generated_tokens[start:end],
                                           timestamps=output.timestamps[start:end],
                                           logprobs=output.logprobs[start:end],
                                           top_logprobs=output.top_logprobs[start:end], offset=start,
                                           status=RequestStatus.DECODING, finish_reason=None)
        else:
            # A snapshot: the lists that grow are copied; the prompt is never changed, so it is shared.
            snapshot = dataclasses.replace(output, generated_tokens=list(output.generated_tokens),
                                           timestamps=list(output.timestamps), logprobs=list(output.logprobs),
                                           top_logprobs=list(output.top_logprobs))
            if not finished and generated is not None:   # a later event of the same step already extended it
                snapshot.generated_tokens = snapshot.generated_tokens[:generated]
                snapshot.timestamps = snapshot.timestamps[:generated]
                snapshot.logprobs, snapshot.top_logprobs = snapshot.logprobs[:generated], snapshot.top_logprobs[:generated]
                snapshot.status, snapshot.finish_reason = RequestStatus.DECODING, None
        if finished:
            self.finished_requests += 1
            self._streaming.discard(request_id)
            self._incremental.discard(request_id)
            self._delivered.pop(request_id, None)
        with self._lock:
            handler = self._handlers.get(request_id)
            if finished:
                self._handlers.pop(request_id, None)
        if handler is not None:
            if finished:
                self._queues.pop(request_id, None)
            try:
                handler(snapshot)
            except Exception as error:  # noqa: BLE001 - one reader's bug must not stop every request
                warnings.warn(f"the result handler of request {request_id!r} raised {error!r}; the engine goes on.",
                              RuntimeWarning, stacklevel=1)
            return
        owner = self._queues.get(request_id)
        if owner is not None:
            owner.put(snapshot)
            self._ready.put(request_id)

    def _fail_all(self, error: BaseException) -> None:
        requests = list(self.engine.requests.values()) + list(self._incoming)
        for request in requests:
            if request.output.is_finished():
                continue
            request.output.status, request.output.finish_reason = RequestStatus.FAILED, "engine_error"
            request.output.error = f"{type(error).__name__}: {error}"
            self._deliver(request.output, finished=True)
