"""Continuous batching: requests join and leave a running batch between steps, keys and values in pages.

    engine = ServingEngine(model, ContinuousBatchingConfig(max_slots=8, page_size=16, max_model_len=512))
    engine.add(Request("a", prompt_ids, RequestSettings(max_new_tokens=32)))
    while engine.has_work():
        for event in engine.step():          # what each request produced in this step
            ...

A fixed number of slots (rows of the decode program) hold the running requests; a request takes a free slot and
the pages its prompt and `max_new_tokens` need when both are free (first come, first served), so a running
request never waits for memory. Each engine step runs one program:

    mixed    while a prompt waits to be prefilled: `prefill_rows` rows of `prefill_chunk` prompt tokens per
             data-parallel group (the waiting prompts' next tokens, a prompt taking as many rows as it fills) and
             one token for every decoding slot, as one batch of flat tokens
             [G * (prefill_rows * prefill_chunk) + max_slots, 1]: the projections and experts read their weights
             once for both, and attention runs per kind of sequence (`kv_cache.SegmentedPagedKV`)
    decode   [rows, 1]: one token for every decoding slot, packed into the fewest rows of `decode_rows` that
             hold them (per data-parallel group; idle rows store nothing): a step with few requests left does not
             pay for every slot's row (the long tail of a batch of long and short outputs)

(`mixed_steps=False` runs a separate prefill program [G * prefill_rows, prefill_chunk] before the decode one
instead; a mixed step whose pieces fill fewer rows runs the mixed program of the fewest rows that hold them,
`mixed_prompt_rows`: powers of two up to `prefill_rows`), each compiled for a few page-table widths (powers of two
up to max_model_len / page_size pages, `page_widths`):
a step reads only the pages its longest row needs, so short requests do not pay for the longest context. New
prompts are prefilled in chunks between decode steps, and nothing recompiles as requests come and go.
Both programs sample each row by its own request's settings (`sampling.next_tokens_per_row`, seeded per request)
and return only the new ids [rows]: what the host reads each step. Experts run at the largest dispatch capacity,
which never drops a pair, so no step climbs a capacity ladder or reads dispatch statistics.

A slot's sequence starts at cache index 0 and positions equal indices (no left padding), so a request's greedy
tokens equal `generate`'s for its prompt alone.

Multi-process jobs: every process runs every program. Either every process drives the same scheduler with the
same requests (`generate_batch`: the scheduling is deterministic and every process reads the same new ids), or
process 0 leads (`lead()`, the server: requests arrive there) and sends each step's inputs to the others, which
run `follow()` until process 0 calls `release_followers()`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import broadcast_one_to_all
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.host_arrays import host_to_global
from ..distributed.mesh import spec_entry
from ..kv_cache import PageBook, PagedKVCache, init_page_pools
from .detokenize import IncrementalDecoder
from .sampling import Sampling, next_tokens_per_row

# What process 0 sends first for each step of a led multi-process job: which program, then its inputs' shape.
PROGRAM_CODES = {"prefill": 0, "decode": 1, "mixed": 2}
STOP_CODE = -1
IDLE_CODE = -2   # nothing to run: keeps the followers' collective from timing out while the server waits


class RequestStatus(IntEnum):
    """Transformers' request lifecycle (`transformers.generation.continuous_batching.RequestStatus`)."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4


@dataclass(frozen=True)
class RequestSettings:
    """One request's generation settings. eos_token_id: ids that end it (kept in its tokens, as Transformers);
    stop: strings that end it (needs the engine's `decode`); seed: its sampling stream (tokens are drawn by
    `fold_in(key(seed), index)`, so a request's draws do not depend on what else is batched)."""

    max_new_tokens: int = 20
    eos_token_id: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1.")
        Sampling(self.do_sample, self.temperature, self.top_k, self.top_p)   # its checks and error texts


@dataclass
class GenerationOutput:
    """A request's result so far, as Transformers' `GenerationOutput`: prompt_ids, generated_tokens, status, error,
    created_time, lifespan (started, finished) and one timestamp per token (perf_counter seconds).
    finish_reason: "stop" (EOS or a stop string), "length" (max_new_tokens or the context), "cancelled" or None;
    a FAILED output's is "error" (its own inputs failed: `error` says why), "engine_error" (a step's program
    failed and the engine stopped), "queue_timeout" (it waited
    longer than the manager's queue timeout) or "shutdown" (the manager stopped before it finished).
    offset: the index of `generated_tokens[0]` among the request's tokens (an incremental output carries only
    the tokens new since the previous one; 0 otherwise)."""

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1, -1)
    timestamps: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    offset: int = 0

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    @property
    def time_to_first_token(self) -> float | None:
        return self.timestamps[0] - self.created_time if self.timestamps else None

    @property
    def inter_token_latencies(self) -> list[float]:
        return list(np.diff(self.timestamps)) if len(self.timestamps) > 1 else []


@dataclass
class Request:
    """A request as the engine tracks it (`output` is what callers see)."""

    request_id: str
    prompt_ids: list[int]
    settings: RequestSettings = field(default_factory=RequestSettings)
    output: GenerationOutput = None
    # The engine's bookkeeping.
    slot: int | None = None
    group: int | None = None
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0
    text: IncrementalDecoder | None = None   # its tokens' text so far, when it has stop strings

    def __post_init__(self):
        if self.output is None:
            self.output = GenerationOutput(self.request_id, list(self.prompt_ids))


@dataclass(frozen=True)
class ContinuousBatchingConfig:
    """max_slots: requests decoded together (the decode program's rows; a multiple of the data-parallel size);
    page_size: tokens per page; max_model_len: the longest prompt + generation a slot holds; num_pages: pages in
    all pools together (default: every slot at max_model_len, so only slots limit admission); prefill_chunk:
    prompt tokens per row of a prefill step; prefill_rows: rows of a prefill step per data-parallel group (a
    prompt takes as many as its remaining tokens fill, the next prompt the rows after it: many short rows waste
    less on a prompt's last piece);
    mixed_steps: a step that prefills also decodes, in one program (the weights read once), rather than running a
    prefill program and then a decode program;
    decode_rows: the rows per data-parallel group a decode program may have (a step runs the fewest that hold its
    decoding requests; every one is compiled at each page width); None: max_slots / groups and its quarters,
    sixteenths, ... down to 1 (16 slots: 16, 4 and 1 rows). The largest is always max_slots / groups."""

    max_slots: int = 8
    page_size: int = 16
    max_model_len: int = 512
    num_pages: int | None = None
    prefill_chunk: int = 128
    prefill_rows: int = 1
    mixed_steps: bool = True
    decode_rows: tuple[int, ...] | None = None


@dataclass
class StepEvent:
    """What one request got from one engine step: its new tokens, whether it finished, and how many tokens it had
    then (a request can get two events in one step: its prompt's last chunk, then a decode)."""

    request: Request
    new_tokens: list[int]
    finished: bool
    generated: int = 0


class ServingEngine:
    """The continuous-batching loop's state and steps (no threads: `ContinuousBatchingManager` runs it)."""

    def __init__(self, model, config: ContinuousBatchingConfig | None = None, *, params=None,
                 decode: Callable[[list[int]], str] | None = None):
        self.model = model
        self.params = model.params if params is None else params
        self.config = config = config or ContinuousBatchingConfig()
        self.decode_text = decode
        groups = model.data_parallel_size
        if config.max_slots < 1 or config.max_slots % groups:
            raise ValueError(f"max_slots={config.max_slots} must be a positive multiple of the layout's "
                             f"{groups} data-parallel groups (each group decodes its own slots).")
        limit = getattr(model.config, "max_position_embeddings", None)
        if config.max_model_len < 2 or (limit is not None and config.max_model_len > limit):
            raise ValueError(f"max_model_len={config.max_model_len} must be in [2, {limit}] (the model's "
                             "max_position_embeddings).")
        if config.prefill_chunk < 1 or config.prefill_rows < 1:
            raise ValueError(f"prefill_chunk={config.prefill_chunk} and prefill_rows={config.prefill_rows} must "
                             "be >= 1.")
        self.groups = groups
        self.decode_row_counts = _decode_row_counts(config.decode_rows, config.max_slots // groups)
        self.pages_per_slot = -(-config.max_model_len // config.page_size)
        total = config.num_pages or config.max_slots * self.pages_per_slot
        if total % groups or total // groups < self.pages_per_slot:
            raise ValueError(f"num_pages={total} must be a multiple of the {groups} data-parallel groups and give "
                             f"each group at least {self.pages_per_slot} pages (one slot at max_model_len="
                             f"{config.max_model_len} with page_size={config.page_size}).")
        self.book = PageBook(groups, total // groups, config.page_size)
        self.keys, self.values = init_page_pools(model, pages_per_group=total // groups,
                                                 page_size=config.page_size)
        self.slots: list[Request | None] = [None] * config.max_slots
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._programs: dict[tuple, Callable] = {}
        self.compilations = 0
        self.steps = {"prefill": 0, "decode": 0, "mixed": 0}
        self.generated_tokens = 0
        self._failed: list[StepEvent] = []   # requests whose own inputs failed while a step was built
        mesh, axes = model.mesh, model.layout.batch_axes
        self._rows = NamedSharding(mesh, P(spec_entry(axes)))
        self._rows_2d = NamedSharding(mesh, P(spec_entry(axes), None))
        self._replicated = NamedSharding(mesh, P())
        self.leading = False   # process 0 sends each step's inputs to the others (`lead`)

    # ---- requests --------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; errors (a prompt the context cannot hold, a duplicate id) raise here."""
        self.check(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check(self, request: Request) -> None:
        """The errors `add` raises, without queueing (safe from another thread)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use.")
        if request.settings.stop and self.decode_text is None:
            raise ValueError("stop strings need a tokenizer: build the engine with decode=tokenizer.decode.")
        self.check_prompt(request.prompt_ids)
        try:   # the settings must fit the step's input arrays (int32 top_k, uint32 seed bits, float32)
            self._sampling_inputs(self._host_inputs(1, 1), 0, request)
        except (OverflowError, ValueError, TypeError) as error:
            raise ValueError(f"request {request.request_id!r}: its sampling settings do not fit the step's inputs "
                             f"({error}).") from None

    def check_prompt(self, prompt: list[int]) -> None:
        """A prompt this engine can serve: not empty, ids in the vocabulary, room for one new token."""
        if not prompt:
            raise ValueError("the prompt is empty: a request needs at least one token.")
        limit = self.config.max_model_len
        if len(prompt) >= limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this server's context (max_model_len) is {limit}, "
                             "which must leave room for at least one new token.")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(prompt)}..{max(prompt)}.")

    def cancel(self, request_id: str) -> Request | None:
        """Stop a request now (pending or running): its slot and pages are free for the next step."""
        request = self.requests.get(request_id)
        if request is None or request.output.is_finished():
            return None
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, "cancelled")
        return request

    def has_work(self) -> bool:
        return bool(self.waiting) or any(slot is not None for slot in self.slots)

    @property
    def slots_in_use(self) -> int:
        return sum(slot is not None for slot in self.slots)

    # ---- one step ----------------------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Admit what fits, run one prefill chunk (if any prompt waits for one) and one decode step (if any
        request decodes) -> what each request got. With `mixed_steps` both are one program. A request whose own
        inputs cannot be written into the step's arrays ends FAILED (an event with no tokens) and the step runs
        without it; an error of the program itself raises (every request in it is lost with the pools)."""
        self._admit()
        events = []
        prefilling = [r for r in self.slots if r is not None and r.output.status == RequestStatus.PREFILLING]
        if prefilling and self.config.mixed_steps:
            decoding = [r for r in self.slots if r is not None and r.output.status == RequestStatus.DECODING]
            events = self._mixed(prefilling, decoding)
            return self._take_failed() + events
        if prefilling:
            events += self._prefill(prefilling)
        # A prompt that just finished prefilling decodes its second token in the same step.
        decoding = [r for r in self.slots if r is not None and r.output.status == RequestStatus.DECODING]
        if decoding:
            events += self._decode(decoding)
        return self._take_failed() + events

    def _take_failed(self) -> list[StepEvent]:
        failed, self._failed = self._failed, []
        return failed

    def fail(self, request: Request, message: str, reason: str = "error") -> None:
        """End `request` with status FAILED (`reason` as its finish_reason, `message` as its error); its slot
        and pages are freed."""
        self._finish(request, reason, status=RequestStatus.FAILED)
        request.output.error = message
        if request in self.waiting:
            self.waiting.remove(request)

    def _write_row(self, inputs: dict, row: int, request: Request, write: Callable[[], None]) -> bool:
        """Run `write` (which fills `row` of `inputs` for `request`); if it raises, the row is left idle and the
        request alone fails. -> whether it was written."""
        if request.output.status == RequestStatus.FAILED:
            return False
        try:
            write()
            return True
        except Exception as error:  # noqa: BLE001 - one request's inputs must not end the others
            self._blank_row(inputs, row)
            self.fail(request, f"its inputs could not be prepared for the step: {error}")
            self._failed.append(StepEvent(request, [], True, len(request.output.generated_tokens)))
            return False

    def _admit(self) -> None:
        per_group = self.config.max_slots // self.groups
        while self.waiting:
            request = self.waiting[0]
            tokens = min(len(request.prompt_ids) + request.settings.max_new_tokens, self.config.max_model_len)
            free = [(self.book.free_pages(g), g) for g in range(self.groups)
                    if any(self.slots[s] is None for s in range(g * per_group, (g + 1) * per_group))]
            placed = False
            for _, group in sorted(free, reverse=True):
                pages = self.book.allocate(group, tokens)
                if pages is None:
                    continue
                slot = next(s for s in range(group * per_group, (group + 1) * per_group) if self.slots[s] is None)
                request.slot, request.group, request.pages = slot, group, pages
                self.slots[slot] = request
                request.output.status = RequestStatus.PREFILLING
                request.output.lifespan = (time.perf_counter(), -1)
                self.waiting.popleft()
                placed = True
                break
            if not placed:
                return

    def _page_row(self, request: Request) -> np.ndarray:
        row = np.zeros(self.pages_per_slot, np.int32)
        row[:len(request.pages)] = request.pages
        return row

    def _prefill_pieces(self, prefilling: list[Request]) -> list[list[tuple[Request, int, int]]]:
        """Per data-parallel group, this step's prompt pieces (request, first token, tokens), one per prefill row:
        the prompts' next tokens oldest slot first, each prompt taking as many rows of `prefill_chunk` tokens as
        its remaining tokens fill, so a prompt's short last piece leaves the next rows to the next prompt."""
        pieces: list[list[tuple[Request, int, int]]] = [[] for _ in range(self.groups)]
        chunk, rows = self.config.prefill_chunk, self.config.prefill_rows
        for request in prefilling:
            group = pieces[request.group]
            for start in range(request.prefilled, len(request.prompt_ids), chunk):
                if len(group) == rows:
                    break
                group.append((request, start, min(chunk, len(request.prompt_ids) - start)))
        return pieces

    def _place_prefill(self, inputs: dict, pieces: list[list[tuple[Request, int, int]]], stride: int
                       ) -> list[tuple[int, Request, int]]:
        """Put this step's prompt pieces (`_prefill_pieces`) in the rows of `inputs` (group g's first row:
        g * stride) -> (row, request, tokens) of each, in prompt order."""
        placed = []
        for group, group_pieces in enumerate(pieces):
            for i, (request, start, count) in enumerate(group_pieces):
                row = group * stride + i
                if self._write_row(inputs, row, request,
                                   partial(self._prefill_row, inputs, row, request, start, count)):
                    placed.append((row, request, count))
        # A prompt whose later piece failed leaves its earlier rows idle too (it is gone).
        for row, request, _ in placed:
            if request.output.status == RequestStatus.FAILED:
                self._blank_row(inputs, row)
        return [entry for entry in placed if entry[1].output.status != RequestStatus.FAILED]

    def _blank_row(self, inputs: dict, row: int) -> None:
        blank = self._host_inputs(1, inputs["ids"].shape[1])
        for name, values in inputs.items():
            values[row] = blank[name][0]

    def _prefill(self, prefilling: list[Request]) -> list[StepEvent]:
        rows_per_group = self.config.prefill_rows
        inputs = self._host_inputs(self.groups * rows_per_group, self.config.prefill_chunk)
        placed = self._place_prefill(inputs, self._prefill_pieces(prefilling), rows_per_group)
        if not placed:
            return []
        tokens = self._run("prefill", inputs)
        self.steps["prefill"] += 1
        return self._prefilled(placed, tokens)

    def _decode(self, decoding: list[Request]) -> list[StepEvent]:
        """One token for each decoding request, each group's requests packed into its first rows of the smallest
        decode program that holds them (`decode_row_counts`)."""
        by_group: list[list[Request]] = [[] for _ in range(self.groups)]
        for request in sorted(decoding, key=lambda r: r.slot):
            by_group[request.group].append(request)
        per_group = next(rows for rows in self.decode_row_counts if rows >= max(map(len, by_group)))
        inputs = self._host_inputs(self.groups * per_group, 1)
        rows = {}
        for group, requests in enumerate(by_group):
            for i, request in enumerate(requests):
                rows[request.request_id] = group * per_group + i
                self._write_row(inputs, rows[request.request_id], request,
                                partial(self._decode_row, inputs, rows[request.request_id], request))
        decoding = [request for request in decoding if request.output.status != RequestStatus.FAILED]
        if not decoding:
            return []
        tokens = self._run("decode", inputs)
        self.steps["decode"] += 1
        return [self._emit(request, int(tokens[rows[request.request_id]])) for request in decoding]

    def _mixed(self, prefilling: list[Request], decoding: list[Request]) -> list[StepEvent]:
        """One program for prompt pieces and a decode step: per group, prompt rows of `prefill_chunk` tokens (the
        fewest of `mixed_prompt_rows` that hold this step's pieces), then the group's slots (one token each) ->
        what each request got (prompts that finished prefilling: their first token; decoding requests: their
        next)."""
        pieces = self._prefill_pieces(prefilling)
        needed = max(len(group) for group in pieces)
        prompt_rows = next(rows for rows in self.mixed_prompt_rows if rows >= needed)
        stride = prompt_rows + self.config.max_slots // self.groups
        inputs = self._host_inputs(self.groups * stride, self.config.prefill_chunk)
        placed = self._place_prefill(inputs, pieces, stride)
        decode_rows = {request.request_id: self._mixed_decode_row(request.slot, prompt_rows) for request in decoding}
        for request in decoding:
            self._write_row(inputs, decode_rows[request.request_id], request,
                            partial(self._decode_row, inputs, decode_rows[request.request_id], request))
        decoding = [request for request in decoding if request.output.status != RequestStatus.FAILED]
        if not placed and not decoding:
            return []
        tokens = self._run("mixed", inputs)
        self.steps["mixed"] += 1
        events = self._prefilled(placed, tokens)
        return events + [self._emit(request, int(tokens[decode_rows[request.request_id]])) for request in decoding]

    @property
    def mixed_prompt_rows(self) -> list[int]:
        """The prompt rows per group a mixed program may have: powers of two below `prefill_rows`, and it (a step
        whose pieces fill few rows runs a smaller program, not `prefill_rows` rows of padding)."""
        rows = self.config.prefill_rows
        return sorted({1 << i for i in range(rows.bit_length()) if 1 << i < rows} | {rows})

    def _mixed_decode_row(self, slot: int, prompt_rows: int) -> int:
        """The row of slot `slot` in a mixed step's inputs (each group's prompt rows come before its slots)."""
        per_group = self.config.max_slots // self.groups
        group, within = divmod(slot, per_group)
        return group * (prompt_rows + per_group) + prompt_rows + within

    def _prefill_row(self, inputs: dict, row: int, request: Request, start: int, count: int) -> None:
        """Put `request`'s prompt tokens [start, start + count) in row `row`. Rows of one prompt in one step see
        each other's tokens: every token is stored before any row attends."""
        inputs["ids"][row, :count] = request.prompt_ids[start:start + count]
        inputs["mask"][row, :count] = 1
        inputs["page_table"][row] = self._page_row(request)
        inputs["lengths"][row] = start
        self._sampling_inputs(inputs, row, request)

    def _decode_row(self, inputs: dict, row: int, request: Request) -> None:
        """Put `request`'s last token in row `row`, to store it and sample the next."""
        inputs["ids"][row, 0] = request.output.generated_tokens[-1]
        inputs["mask"][row, 0] = 1
        inputs["page_table"][row] = self._page_row(request)
        inputs["lengths"][row] = len(request.prompt_ids) + len(request.output.generated_tokens) - 1
        self._sampling_inputs(inputs, row, request)

    def _prefilled(self, placed: list[tuple[int, Request, int]], tokens: np.ndarray) -> list[StepEvent]:
        """Advance each prefilled prompt by its pieces; one that is whole now decodes and gets its first token
        (sampled at its last piece's row)."""
        events = []
        for row, request, count in placed:
            request.prefilled += count
            if request.prefilled == len(request.prompt_ids):
                request.output.status = RequestStatus.DECODING
                events.append(self._emit(request, int(tokens[row])))
        return events

    def _host_inputs(self, rows: int, length: int) -> dict[str, np.ndarray]:
        return dict(ids=np.zeros((rows, length), np.int32), mask=np.zeros((rows, length), np.int32),
                    page_table=np.zeros((rows, self.pages_per_slot), np.int32), lengths=np.zeros(rows, np.int32),
                    do_sample=np.zeros(rows, bool), temperature=np.ones(rows, np.float32),
                    top_k=np.zeros(rows, np.int32), top_p=np.ones(rows, np.float32),
                    seeds=np.zeros(rows, np.uint32), counters=np.zeros(rows, np.int32))

    @staticmethod
    def _sampling_inputs(inputs: dict, row: int, request: Request) -> None:
        s = request.settings
        inputs["do_sample"][row] = s.do_sample
        inputs["temperature"][row] = s.temperature
        inputs["top_k"][row] = s.top_k or 0
        inputs["top_p"][row] = s.top_p
        inputs["seeds"][row] = s.seed % (1 << 32)
        inputs["counters"][row] = len(request.output.generated_tokens)

    def _emit(self, request: Request, token: int) -> StepEvent:
        output = request.output
        output.generated_tokens.append(token)
        output.timestamps.append(time.perf_counter())
        self.generated_tokens += 1
        s = request.settings
        reason = None
        if token in s.eos_token_id:
            reason = "stop"
        elif s.stop and self.decode_text is not None and self._hit_stop_string(request):
            reason = "stop"
        elif len(output.generated_tokens) >= s.max_new_tokens:
            reason = "length"
        elif len(request.prompt_ids) + len(output.generated_tokens) >= self.config.max_model_len:
            reason = "length"
        if reason is not None:
            self._finish(request, reason)
        return StepEvent(request, [token], reason is not None, len(output.generated_tokens))

    def _hit_stop_string(self, request: Request) -> bool:
        """Whether the text of the new token ends a stop string: a few tokens decoded and the text's tail
        scanned, whatever the output's length (this runs on the engine's thread, for every token)."""
        if request.text is None:
            request.text = IncrementalDecoder(self.decode_text)
        before = len(request.text.text)
        request.text.extend(request.output.generated_tokens)
        longest = max(map(len, request.settings.stop))
        tail = request.text.text[max(before - longest + 1, 0):]
        return any(stop in tail for stop in request.settings.stop)

    def _finish(self, request: Request, reason: str, status: RequestStatus = RequestStatus.FINISHED) -> None:
        output = request.output
        output.status = status
        output.finish_reason = reason
        output.lifespan = (output.lifespan[0], time.perf_counter())
        self.requests.pop(request.request_id, None)   # ids need only be unique among live requests
        if request.slot is not None:
            self.slots[request.slot] = None
            self.book.release(request.group, request.pages)
            request.slot, request.pages = None, []

    # ---- the device programs --------------------------------------------------------------------------
    def page_width(self, tokens: int) -> int:
        """The page-table width a step whose rows hold at most `tokens` tokens runs with: the pages they need,
        rounded up to a power of two (at most `pages_per_slot`), so attention reads what the longest row needs
        and a few widths cover every step."""
        needed = -(-tokens // self.config.page_size)
        return min(1 << max(needed - 1, 0).bit_length(), self.pages_per_slot)

    @property
    def page_widths(self) -> list[int]:
        """Every width `page_width` can give: the compiled programs are (prefill, decode) x these."""
        return sorted({self.page_width(tokens) for tokens in range(1, self.pages_per_slot * self.config.page_size
                                                                   + 1, self.config.page_size)})

    def compile_all(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Compile every program a step can run (prefill or mixed, and decode at each of `decode_row_counts`, at
        each page width) now, so no request waits for a compilation; `progress(done, total)` after each. Returns
        how many were compiled."""
        config = self.config
        shapes = ([("mixed", self.groups * rows + config.max_slots, config.prefill_chunk)
                   for rows in self.mixed_prompt_rows] if config.mixed_steps else
                  [("prefill", self.groups * config.prefill_rows, config.prefill_chunk)])
        shapes += [("decode", self.groups * rows, 1) for rows in self.decode_row_counts]
        work = [(name, rows, length, width) for name, rows, length in shapes for width in self.page_widths]
        for done, (name, rows, length, width) in enumerate(work, 1):
            self._program(name, self._placed(self._host_inputs(rows, length), width), length)
            if progress is not None:
                progress(done, len(work))
        return len(work)

    @staticmethod
    def _packed(inputs: dict[str, np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
        """The host inputs as two arrays (one transfer each, not ten): ints [rows, 2S + W + 5] (ids, mask, page
        table cut to `width`, lengths, do_sample, top_k, seed bits, counter) and floats [rows, 2] (temperature,
        top_p)."""
        ints = np.concatenate([inputs["ids"], inputs["mask"], inputs["page_table"][:, :width],
                               np.stack([inputs["lengths"], inputs["do_sample"].astype(np.int32), inputs["top_k"],
                                         inputs["seeds"].view(np.int32), inputs["counters"]], axis=1)], axis=1)
        floats = np.stack([inputs["temperature"], inputs["top_p"]], axis=1).astype(np.float32)
        return ints.astype(np.int32), floats

    def _placed(self, inputs: dict[str, np.ndarray], width: int) -> tuple[jax.Array, jax.Array]:
        ints, floats = self._packed(inputs, width)
        return host_to_global(ints, self._rows_2d), host_to_global(floats, self._rows_2d)

    def _program(self, name: str, placed: tuple[jax.Array, jax.Array], length: int) -> Callable:
        width = placed[0].shape[1] - 2 * length - 5
        key = (name, (placed[0].shape[0], length), width)
        program = self._programs.get(key)
        if program is None:
            prompt_rows = (placed[0].shape[0] - self.config.max_slots) // self.groups if name == "mixed" else None
            program = jax.jit(partial(self._step_math, length=length, prompt_rows=prompt_rows),
                              donate_argnums=(1, 2)).lower(
                self.params, self.keys, self.values, *placed).compile()
            self._programs[key] = program
            self.compilations += 1
        return program

    def _run(self, name: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Pack the host inputs, run the program (compiled on first use), keep the pools, read the new ids."""
        width = self.page_width(int((inputs["lengths"] + inputs["mask"].sum(axis=1)).max()))
        ints, floats = self._packed(inputs, width)
        length = inputs["ids"].shape[1]
        if self.leading:
            broadcast_one_to_all(np.asarray([PROGRAM_CODES[name], *ints.shape, length], np.int32))
            broadcast_one_to_all((ints, floats))
        return self._execute(name, ints, floats, length)

    def _execute(self, name: str, ints: np.ndarray, floats: np.ndarray, length: int) -> np.ndarray:
        placed = (host_to_global(ints, self._rows_2d), host_to_global(floats, self._rows_2d))
        program = self._program(name, placed, length)
        tokens, self.keys, self.values = program(self.params, self.keys, self.values, *placed)
        return np.asarray(jax.device_get(tokens))   # replicated: every process reads the same ids

    # ---- several processes -------------------------------------------------------------------------------
    def lead(self) -> None:
        """On process 0 of a multi-process job whose requests arrive only here (the server): send every step's
        inputs to the other processes, which run `follow()`."""
        if jax.process_count() > 1 and jax.process_index() != 0:
            raise RuntimeError("only process 0 leads; the other processes call follow().")
        self.leading = jax.process_count() > 1

    def keep_followers_alive(self) -> None:
        """Process 0 of a led job with nothing to run: one empty message, so the followers (waiting in a collective)
        hear from it well within the collectives' timeouts (the manager sends one every `KEEPALIVE_S` idle)."""
        if self.leading:
            broadcast_one_to_all(np.asarray([IDLE_CODE, 0, 0, 0], np.int32))

    def release_followers(self) -> None:
        """End the other processes' `follow()` (process 0, when it stops serving)."""
        if self.leading:
            broadcast_one_to_all(np.asarray([STOP_CODE, 0, 0, 0], np.int32))
            self.leading = False

    def follow(self) -> int:
        """On processes other than 0: run every step process 0 runs, until it releases them. Returns the steps
        run."""
        steps = 0
        names = {code: name for name, code in PROGRAM_CODES.items()}
        while True:
            code, rows, columns, length = (int(v) for v in broadcast_one_to_all(np.zeros(4, np.int32)))
            if code == STOP_CODE:
                return steps
            if code == IDLE_CODE:
                continue
            ints, floats = broadcast_one_to_all((np.zeros((rows, columns), np.int32),
                                                 np.zeros((rows, 2), np.float32)))
            self._execute(names[code], np.asarray(ints), np.asarray(floats), length)
            steps += 1

    def _step_math(self, params, keys, values, ints, floats, *, length: int, prompt_rows: int | None = None):
        """The pools and one step's rows (`_placed`'s two arrays) -> (new ids [rows], the pools with the new
        tokens stored). prompt_rows (a mixed step): each group's rows are that many prompt rows then its slots'
        one token each (`_mixed`), run as flat tokens."""
        width = ints.shape[1] - 2 * length - 5
        columns = [length, length, width, 1, 1, 1, 1, 1]
        ids, mask, page_table, lengths, do_sample, top_k, seeds, counters = jnp.split(
            ints, np.cumsum(columns)[:-1], axis=1)
        inputs = dict(ids=ids, mask=mask, page_table=page_table, lengths=lengths[:, 0], do_sample=do_sample[:, 0] > 0,
                      top_k=top_k[:, 0], seeds=jax.lax.bitcast_convert_type(seeds[:, 0], jnp.uint32),
                      counters=counters[:, 0], temperature=floats[:, 0], top_p=floats[:, 1])
        mask = inputs["mask"]
        last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)                    # each row's last real token
        if prompt_rows is not None:
            segments = self._segments(length, prompt_rows)
            cache = PagedKVCache(keys=keys, values=values, page_table=inputs["page_table"],
                                 lengths=inputs["lengths"], segments=segments)
            out = self.model.step_math(params, self._flat_tokens(inputs["ids"], length, prompt_rows),
                                       attention_mask=self._flat_tokens(mask, length, prompt_rows), cache=cache,
                                       capacity=None, inference=True, return_hidden=True)
            hidden = self._sampled_tokens(out.hidden_states, last, segments)
        else:
            cache = PagedKVCache(keys=keys, values=values, page_table=inputs["page_table"],
                                 lengths=inputs["lengths"])
            out = self.model.step_math(params, inputs["ids"], attention_mask=mask, cache=cache, capacity=None,
                                       inference=True, return_hidden=True)
            hidden = jnp.take_along_axis(out.hidden_states, last[:, None, None], axis=1)
        logits = self.model.head_logits(self.model.layer_stack.nest(params), hidden)[:, 0]
        logits = jax.lax.with_sharding_constraint(logits, self._rows_2d)   # whole rows: sampling sorts them
        keys_per_row = jax.vmap(lambda seed, count: jax.random.fold_in(jax.random.key(seed), count))(
            inputs["seeds"], inputs["counters"])
        # The warpers sort every row's logits: only when some row samples (a greedy batch skips them).
        tokens = jax.lax.cond(
            jnp.any(inputs["do_sample"]),
            lambda: next_tokens_per_row(logits, keys_per_row, inputs["do_sample"], inputs["temperature"],
                                        inputs["top_k"], inputs["top_p"]),
            lambda: jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32))
        tokens = jax.lax.with_sharding_constraint(tokens, self._replicated)
        return tokens, out.cache.keys, out.cache.values

    def _segments(self, length: int, prompt_rows: int) -> tuple[tuple[int, int], ...]:
        """A mixed step's sequences per group: (prompt rows, chunk tokens), (slots, 1)."""
        return (prompt_rows, length), (self.config.max_slots // self.groups, 1)

    def _flat_tokens(self, rows: jax.Array, length: int, prompt_rows: int) -> jax.Array:
        """rows: [G * Q, C] a mixed step's rows -> [G * Ng, 1] its tokens: each group's prompt rows whole, then
        its slots' first column."""
        grouped = rows.reshape(self.groups, -1, length)
        prompts = grouped[:, :prompt_rows].reshape(self.groups, -1)
        return jnp.concatenate([prompts, grouped[:, prompt_rows:, 0]], axis=1).reshape(-1, 1)

    def _sampled_tokens(self, hidden: jax.Array, last: jax.Array, segments) -> jax.Array:
        """hidden: [G * Ng, 1, H] a mixed step's flat tokens; last: [G * Q] each row's last real token in its row
        -> [G * Q, 1, H] the hidden state each row samples from."""
        (prompts, chunk), (slots, _) = segments
        last = last.reshape(self.groups, -1)
        where = jnp.concatenate([jnp.arange(prompts) * chunk + last[:, :prompts],
                                 jnp.broadcast_to(prompts * chunk + jnp.arange(slots), (self.groups, slots))], axis=1)
        grouped = hidden.reshape(self.groups, -1, hidden.shape[-1])
        return jnp.take_along_axis(grouped, where[..., None], axis=1).reshape(-1, 1, hidden.shape[-1])

    @property
    def compiled_shapes(self) -> list[tuple[str, tuple[int, int], int]]:
        """The programs compiled so far: (name, [rows, tokens], page-table width); at most (the mixed programs'
        `mixed_prompt_rows` choices, or one prefill program, + the decode programs' `decode_row_counts`) x
        `page_widths`."""
        return sorted(self._programs)


def _decode_row_counts(choice: tuple[int, ...] | None, per_group: int) -> list[int]:
    """The decode programs' rows per group, ascending: `choice` (checked) or per_group / 4**i down to 1, and
    per_group itself in either case."""
    if choice is None:
        counts, rows = {per_group}, per_group
        while rows > 1:
            rows = max(rows // 4, 1)
            counts.add(rows)
        return sorted(counts)
    bad = [rows for rows in choice if not isinstance(rows, int) or not 1 <= rows <= per_group]
    if bad:
        raise ValueError(f"decode_rows={tuple(choice)}: each must be an int in [1, {per_group}] (max_slots per "
                         f"data-parallel group); {bad} is not. E.g. decode_rows=({per_group},) for one decode program.")
    return sorted(set(choice) | {per_group})
