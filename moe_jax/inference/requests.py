"""What continuous batching is asked and answers: a request, its settings and status, its output so far, one
step's event for it, and the engine's configuration: host data, no device arrays."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from .detokenize import IncrementalDecoder
from .sampling import Sampling
from .speculative import check_speculative

# Per-request bounds of the controls that travel in every step's rows (fixed-size columns: one compiled program
# serves every request): logit_bias entries (OpenAI's bound), top log probabilities (OpenAI's bound), and the ids
# min_tokens holds back (eos_token_id and stop_token_ids together).
MAX_LOGIT_BIAS = 300
MAX_TOP_LOGPROBS = 20
MAX_MIN_TOKENS_STOP_IDS = 32


def routing_dtype(num_experts: int) -> np.dtype:
    """The dtype of recorded routing (expert ids, -1 where none): int16 where the ids fit, else int32."""
    return np.dtype(np.int16 if num_experts <= np.iinfo(np.int16).max else np.int32)


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
    `fold_in(key(seed), index)`, so a request's draws do not depend on what else is batched).

    The logits controls run on the device, each row by its own request's values, in vLLM's order: min_tokens and
    logit_bias, then the penalties (repetition, frequency, presence), then temperature, top-k, top-p and the draw
    (or the argmax). logprobs: report each generated token's log probability, and top_logprobs (<=
    `MAX_TOP_LOGPROBS`) of the likeliest tokens, under the model's raw distribution (log_softmax of its logits
    before any control: vLLM's default `logprobs_mode="raw_logprobs"`); logit_bias: (token id, bias) pairs
    (a dict is taken too) added to the logits, at most `MAX_LOGIT_BIAS`; presence_penalty / frequency_penalty:
    OpenAI's, subtracted per token id generated so far (presence once, frequency per occurrence); repetition_penalty:
    Transformers' / vLLM's, dividing positive logits and multiplying negative ones of every id in the prompt or
    generated so far (1.0: off); min_tokens: eos_token_id and stop_token_ids are masked, and no stop condition but
    the length ends the request, until it has that many tokens; stop_token_ids: more ids that end it (as EOS);
    grammar: structured output, an llguidance grammar's serialized text (`grammar.json_schema_grammar`,
    `regex_grammar`, `json_object_grammar`): each token is one the grammar allows, and the request ends ("stop")
    where the grammar is complete (the engine needs `enable_grammars`); adapter: the index of its LoRA adapter
    where the model holds several (`load_adapters`); return_routing: record each sparse layer's expert ids for
    every token the model reads (`GenerationOutput.routing`; its prompt is then prefilled whole, never from the
    prefix cache)."""

    max_new_tokens: int = 20
    eos_token_id: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    grammar: str | None = None
    adapter: int = 0   # its adapter in the model's adapter set (`model.adapter_names`, from 1; 0: the base)
    return_routing: bool = False

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1.")
        Sampling(self.do_sample, self.temperature, self.top_k, self.top_p)   # its checks and error texts
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs={self.logprobs!r} must be a bool.")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={self.top_logprobs!r} must be an int in [0, {MAX_TOP_LOGPROBS}].")
        if not isinstance(self.return_routing, bool):
            raise ValueError(f"return_routing={self.return_routing!r} must be a bool.")
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True.")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple((token, value) for token, value in bias)
        except (TypeError, ValueError):
            raise ValueError("logit_bias must be a dict or (token id, bias) pairs.") from None
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(bias)} entries: at most {MAX_LOGIT_BIAS} are allowed.")
        for token, value in bias:
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias: token id {token!r} must be an int >= 0.")
            if not _is_number(value) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias: the bias {value!r} of token {token} must be a number in [-100, 100].")
        object.__setattr__(self, "logit_bias", bias)
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a number in [-2, 2] (0: off).")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be a number in (0, 100] "
                             "(1.0: off).")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an int in [0, max_new_tokens="
                             f"{self.max_new_tokens}].")
        stop_ids = tuple(self.stop_token_ids)
        if any(not _is_int(token) or token < 0 for token in stop_ids):
            raise ValueError(f"stop_token_ids={list(stop_ids)!r} must be ints >= 0.")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if self.min_tokens and len(set(self.eos_token_id) | set(stop_ids)) > MAX_MIN_TOKENS_STOP_IDS:
            raise ValueError(f"min_tokens holds back eos_token_id and stop_token_ids: at most "
                             f"{MAX_MIN_TOKENS_STOP_IDS} ids together.")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("grammar must be a grammar's text (`grammar.json_schema_grammar`, ...) or None.")

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (the step keeps this request's token counts)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def controls_logits(self, generated: int) -> bool:
        """Whether the step changes this request's logits (a bias, a penalty, min_tokens holding its stop ids back
        after `generated` tokens, a grammar) or reads them (log probabilities): its rows are not verified
        speculatively."""
        return bool(self.logit_bias or self.penalized or self.logprobs or generated < self.min_tokens
                    or self.grammar is not None)

    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end the request: eos_token_id, then the stop_token_ids not among them."""
        return self.eos_token_id + tuple(token for token in self.stop_token_ids if token not in self.eos_token_id)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and (
        bool(np.isfinite(value)))


@dataclass
class GenerationOutput:
    """A request's result so far, as Transformers' `GenerationOutput`: prompt_ids, generated_tokens, status, error,
    created_time, lifespan (started, finished) and one timestamp per token (perf_counter seconds).
    finish_reason: "stop" (EOS or a stop string), "length" (max_new_tokens or the context), "cancelled" or None;
    a FAILED output's is "error" (its own inputs failed: `error` says why), "engine_error" (a step's program
    failed and the engine stopped), "queue_timeout" (it waited
    longer than the manager's queue timeout) or "shutdown" (the manager stopped before it finished).
    offset: the index of `generated_tokens[0]` among the request's tokens (an incremental output carries only
    the tokens new since the previous one; 0 otherwise). cached_tokens: the prompt's tokens whose keys and values
    came from the prefix cache (not computed for it). logprobs: with the request's `logprobs`, each generated
    token's log probability; top_logprobs: with its `top_logprobs`, each token's likeliest [(token id, log
    probability)], most likely first (both under the model's raw distribution, `RequestSettings`). routing: with
    the request's `return_routing`, once it has finished, the expert ids [L, len(prompt_ids) +
    len(generated_tokens), K] each of the model's L sparse layers ran for each token read as input (int16 where
    the ids fit): what `model.apply(..., routing=)` replays on prompt_ids + generated_tokens (a trainer's inputs
    are every token but the last, so the last row, a token the model never read, is -1; so are the rows of
    tokens the request did not get to read)."""

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1, -1)
    timestamps: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    offset: int = 0
    cached_tokens: int = 0
    routing: np.ndarray | None = None

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
    """A request as the engine tracks it (`output` is what callers see). cache_salt: requests share cached prefix
    pages only with requests of the same salt (None: with every request of the engine), as vLLM's."""

    request_id: str
    prompt_ids: list[int]
    settings: RequestSettings = field(default_factory=RequestSettings)
    output: GenerationOutput = None
    cache_salt: str | None = None
    # The engine's bookkeeping.
    slot: int | None = None
    group: int | None = None
    pages: list[int] = field(default_factory=list)
    prefilled: int = 0
    text: IncrementalDecoder | None = None   # its tokens' text so far, when it has stop strings
    page_digests: list[bytes] = field(default_factory=list)   # its full pages' prefix digests, as far as known
    registered: int = 0                      # its first pages whose keys and values are stored and registered
    drafts: list[int] = field(default_factory=list)   # speculative="mtp": its next tokens as last drafted
    counted: bool = False   # its slot's token counts were reset by a row of its (penalties)
    grammar: object = None  # its settings' grammar: a `grammar.GrammarMatcher`, its next token's mask
    routing: list[np.ndarray] = field(default_factory=list)   # return_routing: each step's [tokens, L, K], in order

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
    sixteenths, ... down to 1 (16 slots: 16, 4 and 1 rows). The largest is always max_slots / groups;
    rebalance_every: with redundant expert slots (`num_redundant_experts`), re-place the experts after every that
    many engine steps from the real tokens each expert served in them (`placement_search.searched_placement`;
    None: never);
    prefix_caching: a request reuses the stored keys and values of every full page of its longest prefix that an
    earlier request computed (`kv_cache.page_book`), and prefills only the rest (None, the default: on wherever a
    prompt can fill a page, `page_size <= max_model_len - 2`; True: on, and a page size no prompt can fill is
    refused; False: off);
    speculative: None, or "ngram" (prompt lookup: drafts copied from the request's own context after the latest
    earlier occurrence of its last `ngram_max` .. `ngram_min` tokens) or "mtp" (the checkpoint's multi-token-
    prediction layers draft): a decode step scores up to `num_speculative_tokens` drafts per request at once
    (`speculative`); greedy tokens are plain decoding's, sampled ones keep its distribution."""

    max_slots: int = 8
    page_size: int = 16
    max_model_len: int = 512
    num_pages: int | None = None
    prefill_chunk: int = 128
    prefill_rows: int = 1
    mixed_steps: bool = True
    decode_rows: tuple[int, ...] | None = None
    rebalance_every: int | None = None
    prefix_caching: bool | None = None
    speculative: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self):
        check_speculative(self.speculative, self.num_speculative_tokens, self.ngram_min, self.ngram_max)
        if self.speculative == "mtp" and self.mixed_steps:
            raise ValueError("speculative='mtp' runs the MTP layer in every step's program: use mixed_steps=False "
                             "(moe-jax serve --no-mixed-steps), a prefill program then a decode program.")

    def decode_row_counts(self, groups: int) -> list[int]:
        """The decode programs' rows per data-parallel group, ascending: `decode_rows` (checked) or max_slots /
        groups / 4**i down to 1, and max_slots / groups itself in either case."""
        per_group = self.max_slots // groups
        if self.decode_rows is None:
            counts, rows = {per_group}, per_group
            while rows > 1:
                rows = max(rows // 4, 1)
                counts.add(rows)
            return sorted(counts)
        bad = [rows for rows in self.decode_rows if not isinstance(rows, int) or not 1 <= rows <= per_group]
        if bad:
            raise ValueError(f"decode_rows={tuple(self.decode_rows)}: each must be an int in [1, {per_group}] "
                             f"(max_slots per data-parallel group); {bad} is not. E.g. decode_rows=({per_group},) for "
                             "one decode program.")
        return sorted(set(self.decode_rows) | {per_group})

    @property
    def caches_prefixes(self) -> bool:
        """Whether prefix caching is on (`prefix_caching`, None resolved)."""
        if self.prefix_caching is None:
            return self.page_size <= self.max_model_len - 2
        return self.prefix_caching

    @property
    def pages_per_slot(self) -> int:
        """The pages one slot's page table holds: max_model_len tokens, the last page part-filled."""
        return -(-self.max_model_len // self.page_size)


@dataclass
class StepEvent:
    """What one request got from one engine step: its new tokens, whether it finished, and how many tokens it had
    then (a request can get two events in one step: its prompt's last chunk, then a decode)."""

    request: Request
    new_tokens: list[int]
    finished: bool
    generated: int = 0
