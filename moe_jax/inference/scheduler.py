"""The engine's host side: which requests hold which slots and pages, what each step's rows carry, and what the
new ids mean for each request. No device program runs here: a step's filled inputs go to `run(kind, inputs) ->
new ids [rows]` or (new ids, their log probabilities or None) (the engine's `StepPrograms.run`; in tests, a fake
step).

    scheduler = Scheduler(config, groups=G, vocab_size=V, run=run)
    scheduler.add(Request("a", prompt_ids, RequestSettings(max_new_tokens=32)))
    while scheduler.has_work():
        events = scheduler.step()

Admission: first come, first served; a request takes a free slot of the group holding the longest cached prefix of
its prompt (then: with the most free pages) and the pages its prompt and `max_new_tokens` need (up to
max_model_len), or waits, so a running request never waits for memory. Prefix caching (`prefix_caching`, on by
default): the request's first pages are the cached pages of its prompt's longest cached prefix (at least one
prompt token is left to prefill, to sample from), and every page it fills, prompt or generated, is registered
once its keys and values are stored (`kv_cache.page_book`). Chunked prefill: each step takes up to
`prefill_rows` pieces of `prefill_chunk` prompt tokens per group, the earliest admitted prompt first. Decode: each
group's decoding requests packed into the fewest decode rows that hold them. A request ends on an EOS id or one of its stop_token_ids, a stop string (the text's tail, decoded incrementally; none
of these before its min_tokens), `max_new_tokens` or the context; its slot and pages are free for the next step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from functools import partial

import numpy as np

from ..kv_cache import PageBook
from .detokenize import IncrementalDecoder
from .requests import ContinuousBatchingConfig, Request, RequestStatus, StepEvent
from .prefix_cache import PrefixCache
from .mixed_steps import MixedSteps
from .routing_steps import RoutingSteps
from .speculative_steps import SpeculativeSteps
from .step_inputs import (
    PENALTY_DECODE,
    PENALTY_FIRST_PROMPT,
    PENALTY_PROMPT,
    blank_row,
    host_inputs,
    write_penalty_row,
    write_sampling,
)


class Scheduler(MixedSteps, SpeculativeSteps, RoutingSteps):
    """Slots, pages, admission, chunked prefill, decode packing and stop conditions, on the host."""

    def __init__(self, config: ContinuousBatchingConfig, *, groups: int, vocab_size: int,
                 run: Callable[[str, dict[str, np.ndarray]], np.ndarray], max_positions: int | None = None,
                 decode: Callable[[list[int]], str] | None = None, namespace: str | None = None):
        """namespace: names what the keys and values depend on besides the tokens (the model, its adapter):
        part of every cached page's digest."""
        self.config = config
        self.decode_text = decode
        self.vocab_size = vocab_size
        self._run = run
        if config.max_slots < 1 or config.max_slots % groups:
            raise ValueError(f"max_slots={config.max_slots} must be a positive multiple of the layout's "
                             f"{groups} data-parallel groups (each group decodes its own slots).")
        if config.max_model_len < 2 or (max_positions is not None and config.max_model_len > max_positions):
            raise ValueError(f"max_model_len={config.max_model_len} must be in [2, {max_positions}] (the model's "
                             "max_position_embeddings).")
        if config.prefill_chunk < 1 or config.prefill_rows < 1:
            raise ValueError(f"prefill_chunk={config.prefill_chunk} and prefill_rows={config.prefill_rows} must "
                             "be >= 1.")
        self.groups = groups
        self.decode_row_counts = config.decode_row_counts(groups)
        self.pages_per_slot = config.pages_per_slot
        total = config.num_pages or config.max_slots * self.pages_per_slot
        if total % groups or total // groups < self.pages_per_slot:
            raise ValueError(f"num_pages={total} must be a multiple of the {groups} data-parallel groups and give "
                             f"each group at least {self.pages_per_slot} pages (one slot at max_model_len="
                             f"{config.max_model_len} with page_size={config.page_size}).")
        if config.prefix_caching is True and config.page_size > config.max_model_len - 2:
            raise ValueError(f"prefix_caching=True cannot use page_size={config.page_size} with max_model_len="
                             f"{config.max_model_len}: only full pages before a prompt's last token are reused, and "
                             f"no prompt (at most {config.max_model_len - 1} tokens) fills one. Use a page_size of "
                             f"at most {max(config.max_model_len - 2, 1)}, or prefix_caching=False.")
        self.book = PageBook(groups, total // groups, config.page_size, caching=config.caches_prefixes)
        self.prefix_cache = PrefixCache(self.book, page_size=config.page_size, enabled=config.caches_prefixes,
                                        namespace=namespace)
        self.slots: list[Request | None] = [None] * config.max_slots
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.steps = {"prefill": 0, "decode": 0, "mixed": 0, "verify": 0}
        self.generated_tokens = 0
        self.step_drafts = None         # speculative="mtp": the last step's drafts per row (its runner sets them)
        self.draft_tokens = 0           # speculative drafts verified
        self.accepted_draft_tokens = 0  # of those, the drafts accepted
        self._failed: list[StepEvent] = []   # requests whose own inputs failed while a step was built

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
        settings, vocab = request.settings, self.vocab_size
        ids = [token for token, _ in settings.logit_bias] + list(settings.stop_token_ids)
        if ids and max(ids) >= vocab:
            raise ValueError(f"request {request.request_id!r}: token id {max(ids)} (logit_bias / stop_token_ids) "
                             f"is outside the vocabulary [0, {vocab}).")
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
        vocab = self.vocab_size
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
        # Oldest admission first: a prompt in a high slot must not wait while lower slots keep refilling.
        prefilling = sorted((r for r in self.slots if r is not None and r.output.status == RequestStatus.PREFILLING),
                            key=lambda r: r.output.lifespan[0])
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
            blank_row(inputs, row)
            self.fail(request, f"its inputs could not be prepared for the step: {error}")
            self._failed.append(StepEvent(request, [], True, len(request.output.generated_tokens)))
            return False

    def _admit(self) -> None:
        per_group = self.config.max_slots // self.groups
        while self.waiting:
            request = self.waiting[0]
            tokens = min(len(request.prompt_ids) + request.settings.max_new_tokens, self.config.max_model_len)
            reusable = self.prefix_cache.reusable(request)
            open_groups = [g for g in range(self.groups)
                           if any(self.slots[s] is None for s in range(g * per_group, (g + 1) * per_group))]
            matches = {g: self.book.match(g, reusable) for g in open_groups}
            placed = False
            for group in sorted(open_groups, key=lambda g: (len(matches[g]), self.book.free_pages(g), g),
                                reverse=True):
                shared = matches[group]
                pages = self.book.allocate(group, tokens, prefix=shared)
                if pages is None:
                    continue
                slot = next(s for s in range(group * per_group, (group + 1) * per_group) if self.slots[s] is None)
                request.slot, request.group, request.pages = slot, group, pages
                self.prefix_cache.admitted(request, shared)
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
        the prompts' next tokens in the order given (the earliest admitted first), each prompt taking as many rows of `prefill_chunk` tokens as
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
                blank_row(inputs, row)
        return [entry for entry in placed if entry[1].output.status != RequestStatus.FAILED]

    def _prefill(self, prefilling: list[Request]) -> list[StepEvent]:
        rows_per_group = self.config.prefill_rows
        inputs = self._host_inputs(self.groups * rows_per_group, self.config.prefill_chunk)
        placed = self._place_prefill(inputs, self._prefill_pieces(prefilling), rows_per_group)
        if not placed:
            return []
        tokens = self._run_step("prefill", inputs)
        self.steps["prefill"] += 1
        return self._prefilled(placed, tokens)

    def _decode(self, decoding: list[Request]) -> list[StepEvent]:
        """One token for each decoding request (with speculation, when some request has drafts: its accepted
        drafts and one more, `_verify`), each group's requests packed into its first rows of the smallest decode
        program that holds them (`decode_row_counts`)."""
        drafts = self._drafts(decoding)
        if any(drafts.values()):
            return self._verify(decoding, drafts)
        per_group, rows = self._decode_rows(decoding)
        inputs = self._host_inputs(self.groups * per_group, 1)
        for request in decoding:
            self._write_row(inputs, rows[request.request_id], request,
                            partial(self._decode_row, inputs, rows[request.request_id], request))
        decoding = [request for request in decoding if request.output.status != RequestStatus.FAILED]
        if not decoding:
            return []
        tokens = self._run_step("decode", inputs)
        self.steps["decode"] += 1
        events = [self._emit_decoded(request, tokens, rows[request.request_id]) for request in decoding]
        for request in decoding:
            self._keep_drafts(request, rows[request.request_id])
        return events

    def _decode_rows(self, decoding: list[Request]) -> tuple[int, dict[str, int]]:
        """-> (rows per group of the smallest decode program holding every group's decoding requests, each
        request's row: its group's first rows, in slot order)."""
        by_group: list[list[Request]] = [[] for _ in range(self.groups)]
        for request in sorted(decoding, key=lambda r: r.slot):
            by_group[request.group].append(request)
        per_group = next(rows for rows in self.decode_row_counts if rows >= max(map(len, by_group)))
        return per_group, {request.request_id: group * per_group + i for group, requests in enumerate(by_group)
                           for i, request in enumerate(requests)}

    def _prefill_row(self, inputs: dict, row: int, request: Request, start: int, count: int) -> None:
        """Put `request`'s prompt tokens [start, start + count) in row `row`. Rows of one prompt in one step see
        each other's tokens: every token is stored before any row attends."""
        inputs["ids"][row, :count] = request.prompt_ids[start:start + count]
        inputs["mask"][row, :count] = 1
        inputs["page_table"][row] = self._page_row(request)
        inputs["lengths"][row] = start
        inputs["next_id"][row] = request.prompt_ids[start + count] if start + count < len(request.prompt_ids) else -1
        inputs["capacity"][row] = len(request.pages) * self.config.page_size
        self._sampling_inputs(inputs, row, request)
        if request.settings.penalized:
            write_penalty_row(inputs, row, request.slot, PENALTY_PROMPT if request.counted else PENALTY_FIRST_PROMPT)
            request.counted = True

    def _decode_row(self, inputs: dict, row: int, request: Request, drafts: list[int] = ()) -> None:
        """Put `request`'s last token (and its drafts, in a verification step) in row `row`, to store them and
        sample the next."""
        inputs["ids"][row, 0] = request.output.generated_tokens[-1]
        inputs["ids"][row, 1:1 + len(drafts)] = drafts
        inputs["mask"][row, :1 + len(drafts)] = 1
        inputs["page_table"][row] = self._page_row(request)
        inputs["lengths"][row] = len(request.prompt_ids) + len(request.output.generated_tokens) - 1
        inputs["capacity"][row] = len(request.pages) * self.config.page_size
        self._sampling_inputs(inputs, row, request)
        if request.settings.penalized:
            write_penalty_row(inputs, row, request.slot, PENALTY_DECODE)

    def _prefilled(self, placed: list[tuple[int, Request, int]], tokens: tuple) -> list[StepEvent]:
        """Advance each prefilled prompt by its pieces; one that is whole now decodes and gets its first token
        (sampled at its last piece's row)."""
        events = []
        for row, request, count in placed:
            self._keep_routing(request, tokens, row, count)
            request.prefilled += count
            self.prefix_cache.stored(request, request.prefilled)
            if request.prefilled == len(request.prompt_ids):
                request.output.status = RequestStatus.DECODING
                events.append(self._emit(request, tokens, row))
                self._keep_drafts(request, row)
        return events

    def _host_inputs(self, rows: int, length: int) -> dict[str, np.ndarray]:
        return host_inputs(rows, length, self.pages_per_slot, self.vocab_size)

    @staticmethod
    def _sampling_inputs(inputs: dict, row: int, request: Request) -> None:
        write_sampling(inputs, row, request.settings, len(request.output.generated_tokens),
                       None if request.grammar is None else request.grammar.allowed)

    def _run_step(self, kind: str, inputs: dict) -> tuple[np.ndarray, tuple | None, np.ndarray | None]:
        """Run a step -> (new ids [rows], (log probabilities [rows], top ids [rows, K], theirs [rows, K]) or None,
        the rows' tokens' routing [rows, tokens, L, K] or None)."""
        result = self._run(kind, inputs)
        result = result if isinstance(result, tuple) else (result,)
        return result + (None,) * (3 - len(result))

    def _emit(self, request: Request, step: tuple, row: int) -> StepEvent:
        """`request` gets row `row`'s token of the step's (new ids, log probabilities) `step`."""
        output, s = request.output, request.settings
        token = int(step[0][row])
        output.generated_tokens.append(token)
        output.timestamps.append(time.perf_counter())
        if s.logprobs and step[1] is not None:
            logprobs, top_ids, top_logprobs = step[1]
            output.logprobs.append(float(logprobs[row]))
            if s.top_logprobs:
                output.top_logprobs.append([(int(i), float(v)) for i, v in zip(top_ids[row, :s.top_logprobs],
                                                                                top_logprobs[row, :s.top_logprobs])])
        self.generated_tokens += 1
        # Stored now: the prompt and every generated token but the new one (it is stored when it is decoded).
        self.prefix_cache.stored(request, len(request.prompt_ids) + len(output.generated_tokens) - 1)
        reason = None
        held = len(output.generated_tokens) < s.min_tokens   # min_tokens: no stop condition but the length yet
        if not held and (token in s.eos_token_id or token in s.stop_token_ids):
            reason = "stop"
        elif request.grammar is not None and request.grammar.advance(token):   # and its next token's mask
            reason = "stop"
        elif not held and s.stop and self.decode_text is not None and self._hit_stop_string(request):
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
        self._close_routing(request)
        self.requests.pop(request.request_id, None)   # ids need only be unique among live requests
        if request.slot is not None:
            self.slots[request.slot] = None
            self.book.release(request.group, request.pages)
            request.slot, request.pages = None, []

