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
tokens equal `generate`'s for its prompt alone. With prefix caching (on by default) a request's first pages may be
another request's: the full pages of the longest prompt prefix already computed, which it does not prefill again.

Multi-process jobs: every process runs every program. Either every process drives the same scheduler with the
same requests (`generate_batch`: the scheduling is deterministic and every process reads the same new ids), or
process 0 leads (`lead()`, the server: requests arrive there) and sends each step's inputs to the others, which
run `follow()` until process 0 calls `release_followers()`.

The engine is three parts with small interfaces: `Scheduler` (scheduler.py: slots, pages, admission, chunked
prefill, stop conditions; host only, runs a step through one callable), `StepPrograms` (step_programs.py: the
pools and the compiled programs) and `lead_follow` (the multi-process protocol); the step's input layout is
step_inputs.py's and the request types are requests.py's.
"""

from __future__ import annotations

from collections.abc import Callable

from . import lead_follow
from .grammar import Grammars
from .requests import (
    ContinuousBatchingConfig,
    GenerationOutput,
    Request,
    RequestSettings,
    RequestStatus,
    StepEvent,
)
from .scheduler import Scheduler
from .step_programs import StepPrograms

__all__ = ["ContinuousBatchingConfig", "GenerationOutput", "Request", "RequestSettings", "RequestStatus",
           "ServingEngine", "StepEvent"]


class ServingEngine(Scheduler):
    """The continuous-batching loop's state and steps (no threads: `ContinuousBatchingManager` runs it): the
    scheduler, running each step on the model's compiled programs."""

    def __init__(self, model, config: ContinuousBatchingConfig | None = None, *, params=None,
                 decode: Callable[[list[int]], str] | None = None):
        config = config or ContinuousBatchingConfig()
        if config.speculative == "mtp" and not getattr(model, "mtp_layers", 0):
            raise ValueError("speculative='mtp' drafts with the checkpoint's multi-token-prediction layers, which this "
                             f"{type(model).__name__} does not hold (DeepSeek-V3's model.layers.{{num_hidden_layers}}.*"
                             "); use speculative='ngram' (prompt lookup), or load a checkpoint that has them.")
        super().__init__(config, groups=model.data_parallel_size, vocab_size=model.config.vocab_size,
                         max_positions=getattr(model.config, "max_position_embeddings", None),
                         run=self._run_program, decode=decode, namespace=_cache_namespace(model))
        self.model, self.grammars = model, None   # grammars: `enable_grammars`
        self.programs = StepPrograms(model, model.params if params is None else params, config, groups=self.groups,
                                     pages_per_group=self.book.pages_per_group)

    @property
    def params(self):
        """The parameters the programs run (`update_parameters` replaces them)."""
        return self.programs.params

    def update_parameters(self, params=None, *, adapter=None) -> None:
        """New weights for the next step, e.g. a train state's `params` (or a LoRA `adapter`'s arrays alone): the
        same names and shapes as the current ones, floating arrays cast to their dtypes (fp32 masters) and placed
        in their shardings on the devices, whatever the trainer's layout, so no program recompiles. ValueError
        naming the first array that does not fit. Requests running keep their keys and values so far; the prefix
        cache's pages are not reused by later requests (`PrefixCache.new_weights`)."""
        self.use_weights(self.programs.placed_weights(params, adapter))

    def use_weights(self, weights: tuple) -> None:
        """Run the next steps on `weights`, (params, adapter) placed by `StepPrograms.placed_weights`."""
        before = self.programs.weights
        self.programs.weights = weights
        if weights[0] is not before[0] or weights[1] is not before[1]:
            self.prefix_cache.new_weights()

    def enable_grammars(self, tokenizer_json: str, eos_token_ids=None) -> None:
        """Serve requests with a `grammar` (structured output): `tokenizer_json` is the checkpoint's tokenizer.json
        text (llguidance's view of the vocabulary); eos_token_ids: the EOS ids the grammar ends with (default: the
        model's generation config's)."""
        if eos_token_ids is None:
            eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.grammars = Grammars(tokenizer_json, self.vocab_size, eos_token_ids)

    def check(self, request: Request) -> None:
        """`Scheduler.check`, and a request's grammar compiled (its matcher kept on the request)."""
        super().check(request)
        if request.settings.grammar is not None and request.grammar is None:
            if self.grammars is None:
                raise ValueError("structured output needs the checkpoint's tokenizer: the engine's enable_grammars "
                                 "was not called (moe-jax serve calls it when the checkpoint has a tokenizer.json).")
            request.grammar = self.grammars.matcher(request.settings.grammar, request.settings.stop_ids())
        if request.settings.return_routing and (not self.model.sparse_layers() or self.model.layout.pp_size > 1):
            raise ValueError("return_routing=True records the experts of each sparse (MoE) layer: this model has no "
                             "sparse layers, or runs pipeline stages (pp_size > 1), whose layers' routing stays in "
                             "their stage; serve it without pp to record routing.")

    def _run_program(self, name: str, inputs) -> object:
        result = self.programs.run(name, inputs)
        self.step_drafts = self.programs.drafts
        return result

    # ---- the device programs --------------------------------------------------------------------------
    def page_width(self, tokens: int) -> int:
        return self.programs.page_width(tokens)

    @property
    def page_widths(self) -> list[int]:
        return self.programs.page_widths

    @property
    def compilations(self) -> int:
        return self.programs.compilations

    def program_shapes(self) -> list[tuple[str, int, int]]:
        """(name, rows, tokens) of every program a step can run: prefill or mixed, and decode (and, with
        speculative decoding, verify) at each of `decode_row_counts` (each compiled at every page width)."""
        config = self.config
        shapes = ([("mixed", self.groups * rows + config.max_slots, config.prefill_chunk)
                   for rows in self.mixed_prompt_rows] if config.mixed_steps else
                  [("prefill", self.groups * config.prefill_rows, config.prefill_chunk)])
        verify = ([("verify", self.groups * rows, 1 + config.num_speculative_tokens) for rows in self.decode_row_counts]
                  if config.speculative else [])
        return shapes + [("decode", self.groups * rows, 1) for rows in self.decode_row_counts] + verify

    def programs_to_compile(self) -> list[tuple[str, int, int, int]]:
        """(name, rows, tokens, page width) of every program `compile_all` compiles, in its order."""
        return [(name, rows, tokens, width) for name, rows, tokens in self.program_shapes()
                for width in self.page_widths]

    def compile_all(self, progress: Callable[[int, int], None] | None = None, *, routing: bool = False) -> int:
        """Compile every program a step can run (prefill or mixed, and decode at each of `decode_row_counts`, at
        each page width; `programs_to_compile`) now, so no request waits for a compilation; `progress(done,
        total)` after each. routing: their routing variants too (a server whose requests record routing).
        Returns how many were compiled."""
        work = [(*program, variant) for program in self.programs_to_compile()
                for variant in ((False, True) if routing else (False,))]
        for done, (name, rows, tokens, width, variant) in enumerate(work, 1):
            self.programs.compile(name, rows, tokens, width, variant)
            if progress is not None:
                progress(done, len(work))
        return len(work)

    @property
    def compiled_shapes(self) -> list[tuple[str, tuple[int, int], int]]:
        """The programs compiled so far: (name, [rows, tokens], page-table width); at most (the mixed programs'
        `mixed_prompt_rows` choices, or one prefill program, + the decode programs' `decode_row_counts`) x
        `page_widths`."""
        return self.programs.compiled_shapes

    # ---- several processes -------------------------------------------------------------------------------
    @property
    def leading(self) -> bool:
        return self.programs.leading

    def lead(self) -> None:
        """On process 0 of a multi-process job whose requests arrive only here (the server): send every step's
        inputs to the other processes, which run `follow()`."""
        self.programs.leading = lead_follow.check_leader()

    def keep_followers_alive(self) -> None:
        """Process 0 of a led job with nothing to run: one empty message, so the followers (waiting in a collective)
        hear from it well within the collectives' timeouts (the manager sends one every `KEEPALIVE_S` idle)."""
        if self.leading:
            lead_follow.send_idle()

    def release_followers(self) -> None:
        """End the other processes' `follow()` (process 0, when it stops serving)."""
        if self.leading:
            lead_follow.send_stop()
            self.programs.leading = False

    def follow(self) -> int:
        """On processes other than 0: run every step process 0 runs, until it releases them. Returns the steps
        run."""
        return lead_follow.follow(self.programs.execute)


def _cache_namespace(model) -> str:
    """What the engine's keys and values depend on besides the tokens: the model and its adapter (the prefix
    cache's root, `kv_cache.root_digest`)."""
    adapter = getattr(model, "adapter_config", None)
    return f"{type(model).__name__}:{getattr(model, 'name_or_path', None)}:{adapter!r}"
