"""The engine's compiled step programs: the page pools, one jitted step per (kind, shape, page width), compiled on
first use or all at once, and run on a step's host inputs.

    programs = StepPrograms(model, params, config, groups=G, pages_per_group=N)
    tokens, logprobs, routing = programs.run("decode", inputs)   # inputs: `step_inputs.host_inputs`, filled

Kinds: "prefill" [G * prefill_rows, chunk]; "decode" [rows, 1]; "mixed" [G * (prompt rows + slots per group),
chunk], run as flat tokens (each group's prompt rows whole, then its slots' one token each) whose attention runs
per kind of sequence (`kv_cache.SegmentedPagedKV`); "verify" [rows, 1 + num_speculative_tokens] (speculative
decoding: each row's last token and its drafts, scored at every position, `speculative.accepted_tokens`). Every
program samples each row by its own settings and returns the new ids [rows] (verify: [rows, 1 + T], each row's
count of new tokens then the tokens) (replicated: what the host reads) and the pools, donated and updated in
place.

Each row's logits controls (`RequestSettings`: logit_bias and min_tokens' masked ids, a grammar's allowed tokens,
the penalties, log probabilities) run in the same programs, under a `lax.cond` on whether any row of the step uses
them (the bias, the grammar mask and the penalties share one, the log probabilities have theirs), so a step where none does pays for none (as
greedy steps skip the warpers' sorts). The penalties read per-slot token
counts kept on the device between steps (`counts`: generated [slots, V] int32, each id's count among the slot's
generated tokens, and in_prompt [slots, V] bool, its prompt's ids; replicated, donated like the pools): a
penalized request's first prompt row resets its slot's, its prompt rows mark their ids, and each decode row
counts its input id (the token generated before it), before the row's logits are penalized. Log probabilities
are the raw model distribution's (`sampling.token_logprobs`): the chosen id's and the `MAX_TOP_LOGPROBS`
likeliest, read by the host only for a step where some row asked for them. Experts
run at the largest dispatch capacity (`capacity=None`), which never drops a pair, under the model's expert
placement as it is at each step; with `config.rebalance_every` the programs also return the step's `expert_load`,
summed on the devices, and every that many steps the placement is re-balanced from the sum (on every process
alike: each runs the same steps). Where experts are dispatched over ep, the programs also return the step's
`ep_rank_load`, summed on the devices since the start and since the last re-placement (`rank_load`).

Routing (routing replay for RL, `models.routing_replay`): a step where some row's request records its routing
(`RequestSettings.return_routing`, the host input `routing`) runs the kind's routing variant, compiled on first
use: the same program that also returns each row's tokens' expert ids [rows, tokens, L, K] (L sparse layers,
int16 where the expert ids fit), replicated. Every other step runs the plain program, so an engine whose requests
never record compiles and transfers nothing more.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.placement_search import replacement
from ..distributed.host_arrays import host_to_global
from ..distributed.mesh import spec_entry
from ..kv_cache import PagedKVCache, init_page_pools
from ..models.core import final_normed
from ..ops.lora import ADAPTER_INDEX
from . import lead_follow
from .requests import ContinuousBatchingConfig
from .requests import MAX_TOP_LOGPROBS, routing_dtype
from .sampling import add_bias, allowed_only, next_tokens_per_row, penalize, token_logprobs
from .mtp_drafts import mtp_drafts, next_tokens
from .speculative import accepted_tokens
from .weights_update import updated_arrays
from .step_inputs import (
    PENALTY_DECODE,
    PENALTY_FIRST_PROMPT,
    PENALTY_PROMPT,
    host_inputs,
    packed,
    packed_width,
    unpacked,
)


class StepPrograms:
    """The device side of `ServingEngine`: pools, programs, and running them (with followers when leading)."""

    def __init__(self, model, params, config: ContinuousBatchingConfig, *, groups: int, pages_per_group: int):
        self.model, self.config, self.groups = model, config, groups
        # (params, the model's LoRA adapter's arrays or None): arguments of each program, replaced as one.
        self.weights = (params, model.adapter)
        self.many_adapters = bool(getattr(model, "adapter_names", ()))
        if self.many_adapters and config.speculative == "mtp":
            raise ValueError("speculative='mtp' with several adapters: not supported (the MTP layer's step takes "
                             "one adapter); serve them without it.")
        self.pages_per_slot = config.pages_per_slot
        # On abstract target devices (`model.compiles_only`) the pools are shapes: programs lower, none runs.
        self.keys, self.values = init_page_pools(model, pages_per_group=pages_per_group, page_size=config.page_size,
                                                 abstract=getattr(model, "compiles_only", False))
        # speculative="mtp": the MTP layer's own pools (run "mtp"), and each step's drafts for the next.
        self.mtp, self.drafts = config.speculative == "mtp", None
        if self.mtp:
            mtp_keys, mtp_values = init_page_pools(model, pages_per_group=pages_per_group, page_size=config.page_size,
                                                   abstract=getattr(model, "compiles_only", False),
                                                   entries=[("mtp", None, 1)])
            self.keys, self.values = {**self.keys, **mtp_keys}, {**self.values, **mtp_values}
        self._programs: dict[tuple, Callable] = {}
        self.compilations = 0
        mesh, axes = model.mesh, model.layout.batch_axes
        self._rows_2d = NamedSharding(mesh, P(spec_entry(axes), None))
        self._replicated = NamedSharding(mesh, P())
        self.vocab = model.config.vocab_size
        self.counts = self._zero_counts(config.max_slots, self.vocab,
                                        abstract=getattr(model, "compiles_only", False))
        self.leading = False   # process 0 sends each step's inputs to the others (`lead_follow`)
        self.rebalance_every = config.rebalance_every
        if self.rebalance_every is not None and (self.rebalance_every < 1 or not model.num_redundant_experts):
            raise ValueError(f"rebalance_every={self.rebalance_every} re-places experts into redundant expert slots "
                             "every that many steps (>= 1): build the model with num_redundant_experts=R > 0.")
        self._load_window, self._steps = None, 0   # expert_load summed since the last re-placement
        # ep_rank_load [sparse layers, ep] summed on the devices: since the start, and under the current placement.
        self.counts_rank_load = model.core.ep_size > 1
        self._rank_load_total = self._rank_load_placed = None

    def page_width(self, tokens: int) -> int:
        """The page-table width a step whose rows hold at most `tokens` tokens runs with: the pages they need,
        rounded up to a power of two (at most `pages_per_slot`), so attention reads what the longest row needs
        and a few widths cover every step."""
        needed = -(-tokens // self.config.page_size)
        return min(1 << max(needed - 1, 0).bit_length(), self.pages_per_slot)

    @property
    def page_widths(self) -> list[int]:
        """Every width `page_width` can give: each program kind and shape is compiled at these."""
        return sorted({self.page_width(tokens) for tokens in range(1, self.pages_per_slot * self.config.page_size
                                                                   + 1, self.config.page_size)})

    def compile(self, name: str, rows: int, tokens: int, width: int, routing: bool = False) -> None:
        """Compile program `name` (with `routing`: its routing variant) for `rows` rows of `tokens` tokens at page
        width `width` (if not yet)."""
        inputs = host_inputs(rows, tokens, self.pages_per_slot, self.vocab)
        self._program(name, self._placed(*packed(inputs, width)), tokens, routing)

    @property
    def compiled_shapes(self) -> list[tuple[str, tuple[int, int], int]]:
        """The programs compiled so far: (name, [rows, tokens], page-table width); a routing variant's name ends in
        "+routing"."""
        return sorted(self._programs)

    def run(self, name: str, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, tuple | None, np.ndarray | None]:
        """Pack the host inputs, run the program (compiled on first use), keep the pools -> (the new ids [rows];
        when a row asked for them, (the ids' log probabilities [rows], the top ids [rows, K], their log
        probabilities [rows, K]), else None; when a row records its routing, each row's tokens' expert ids
        [rows, tokens, L, K], else None)."""
        width = self.page_width(int((inputs["lengths"] + inputs["mask"].sum(axis=1)).max()))
        ints, floats = packed(inputs, width)
        tokens = inputs["ids"].shape[1]
        routing = bool(inputs["routing"].any())
        if self.leading:
            lead_follow.send_step(name, ints, floats, tokens, routing)
        new_ids, logprobs, expert_ids = self.execute(name, ints, floats, tokens, routing)
        expert_ids = None if expert_ids is None else np.asarray(jax.device_get(expert_ids))
        if not inputs["logprobs"].any():
            return new_ids, None, expert_ids
        return new_ids, tuple(np.asarray(values) for values in jax.device_get(logprobs)), expert_ids

    def execute(self, name: str, ints: np.ndarray, floats: np.ndarray, tokens: int,
                routing: bool = False) -> tuple[np.ndarray, tuple, jax.Array | None]:
        """Run program `name` (with `routing`: its routing variant) on packed inputs (what a follower receives)
        -> the new ids [rows], the log probabilities' device arrays and the routing's device array or None
        (`run`)."""
        placed = self._placed(ints, floats)
        program = self._program(name, placed, tokens, routing)
        new_ids, logprobs, self.keys, self.values, self.counts, *loads = program(
            self._weights(), self.keys, self.values, self.counts, *placed)
        expert_ids = loads.pop(0) if routing else None
        if self.mtp:   # [rows, num_speculative_tokens]: each row's drafts for its next step
            self.drafts = np.asarray(jax.device_get(loads.pop(0)))
        if self.counts_rank_load:
            self._count_rank_load(loads.pop())
        if loads:
            self._rebalance_after(loads[0])
        # Replicated: every process reads the same ids.
        return np.asarray(jax.device_get(new_ids)), logprobs, expert_ids

    def _count_rank_load(self, rank_load: jax.Array) -> None:
        total, placed = self._rank_load_total, self._rank_load_placed
        self._rank_load_total = rank_load if total is None else total + rank_load
        self._rank_load_placed = rank_load if placed is None else placed + rank_load

    def rank_load(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(since the start, since the last re-placement): the real (token, expert) pairs each ep rank computed
        in each sparse layer, int [sparse layers, ep] each; None where experts are not dispatched over ep. Zeros
        before the first step, and since a re-placement until the next step. Read from any thread."""
        if not self.counts_rank_load:
            return None
        total, placed = self._rank_load_total, self._rank_load_placed
        if total is None:
            zeros = np.zeros((len(self.model.sparse_layers()), self.model.core.ep_size), np.int64)
            return zeros, zeros
        total = np.asarray(jax.device_get(total), np.int64)
        return total, (np.zeros_like(total) if placed is None else np.asarray(jax.device_get(placed), np.int64))

    def _rebalance_after(self, load: jax.Array) -> None:
        """Add a step's expert_load to the window; every `rebalance_every` steps, re-place from it."""
        self._load_window = load if self._load_window is None else self._load_window + load
        self._steps += 1
        if self._steps % self.rebalance_every == 0:
            model, window = self.model, np.asarray(jax.device_get(self._load_window))
            current = jax.tree.map(lambda array: np.asarray(jax.device_get(array)), model.expert_placement)
            # Per layer, only where it gives the window's busiest rank less (`placement_search.replacement`).
            model.set_expert_placement(replacement(current, window, num_redundant_experts=model.num_redundant_experts,
                                                   ep_size=model.layout.ep_size))
            self._load_window = self._rank_load_placed = None

    @property
    def params(self):
        return self.weights[0]

    def placed_weights(self, params=None, adapter=None) -> tuple:
        """New (params, adapter) checked, cast and placed like the current ones (`weights_update.updated_arrays`,
        so no program recompiles); None keeps the current one. Nothing changes until `weights` is set to them."""
        current, current_adapter = self.weights
        return (current if params is None else updated_arrays(current, params, "params"),
                current_adapter if adapter is None else updated_arrays(current_adapter, adapter, "adapter"))

    def _weights(self) -> tuple:
        """(params, adapter, expert placement): the model's placement as it is now (`set_expert_placement` between
        steps runs the same programs)."""
        params, adapter = self.weights
        return params, adapter, self.model.expert_placement

    def _zero_counts(self, slots: int, vocab: int, *, abstract: bool) -> tuple:
        """The penalties' per-slot token counts, zeroed: (generated [slots, V] int32, in_prompt [slots, V] bool)."""
        shapes = (((slots, vocab), jnp.int32), ((slots, vocab), jnp.bool_))
        if abstract:
            return tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated) for shape, dtype in shapes)
        return tuple(jnp.zeros(shape, dtype, device=self._replicated) for shape, dtype in shapes)

    def _placed(self, ints: np.ndarray, floats: np.ndarray) -> tuple[jax.Array, jax.Array]:
        return host_to_global(ints, self._rows_2d), host_to_global(floats, self._rows_2d)

    def _program(self, name: str, placed: tuple[jax.Array, jax.Array], tokens: int, routing: bool = False
                 ) -> Callable:
        rows = placed[0].shape[0]
        key = (name + ("+routing" if routing else ""), (rows, tokens),
               packed_width(placed[0].shape[1], tokens, self.vocab))
        program = self._programs.get(key)
        if program is None:
            program = self._lowered(name, placed, tokens, routing).compile()
            self._programs[key] = program
            self.compilations += 1
        return program

    def _lowered(self, name: str, placed: tuple, tokens: int, routing: bool = False):
        rows = placed[0].shape[0]
        prompt_rows = (rows - self.config.max_slots) // self.groups if name == "mixed" else None
        return jax.jit(partial(self._step_math, tokens=tokens, prompt_rows=prompt_rows, verify=name == "verify",
                               routing=routing),
                       donate_argnums=(1, 2, 3)).lower(self._weights(), self.keys, self.values, self.counts, *placed)

    def lower(self, name: str, rows: int, tokens: int, width: int, routing: bool = False):
        """Program `name` (with `routing`: its routing variant) for `rows` rows of `tokens` tokens at page width
        `width`, lowered on abstract inputs (not compiled, not kept): for compiling ahead of time, e.g. for a GPU
        target (`moe_jax.target_compile`)."""
        ints, floats = packed(host_inputs(rows, tokens, self.pages_per_slot, self.vocab), width)
        placed = tuple(jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=self._rows_2d)
                       for array in (ints, floats))
        return self._lowered(name, placed, tokens, routing)

    # ---- the step's math (traced) ----------------------------------------------------------------------------
    def _step_math(self, weights, keys, values, counts, ints, floats, *, tokens: int, prompt_rows: int | None = None,
                   verify: bool = False, routing: bool = False):
        """The pools, the penalties' counts and one step's rows (`step_inputs.packed`'s two arrays) -> (new ids
        [rows], (their log probabilities [rows], top ids [rows, K], theirs [rows, K]), the pools with the new tokens
        stored, the counts). weights: (params, the adapter's arrays or None, the expert placement or None).
        prompt_rows (a mixed step): each group's rows are that many prompt rows then its slots' one token each, run
        as flat tokens. verify: every position is scored and each row's drafts kept or not (new ids: [rows, 1 + S],
        `_verified`; the scheduler verifies only steps whose rows use no logits controls). routing: also return
        each row's tokens' expert ids [rows, tokens, L, K] (`_row_routing`), right after the counts."""
        params, adapter, placement = weights
        inputs = unpacked(ints, floats, tokens, self.vocab)
        mask = inputs["mask"]
        if self.many_adapters:   # each token takes its row's adapter (`moe_jax.lora.AdapterSet`)
            index = jnp.broadcast_to(inputs["adapter"][:, None], inputs["ids"].shape)
            index = index if prompt_rows is None else self._flat_tokens(index, tokens, prompt_rows)   # as the ids
            adapter = {**adapter, ADAPTER_INDEX: index}
        last = jnp.maximum(jnp.sum(mask, axis=1) - 1, 0)                    # each row's last real token
        if prompt_rows is not None:
            segments = self._segments(tokens, prompt_rows)
            cache = PagedKVCache(keys=keys, values=values, page_table=inputs["page_table"],
                                 lengths=inputs["lengths"], segments=segments)
            out = self.model.step_math(params, self._flat_tokens(inputs["ids"], tokens, prompt_rows),
                                       attention_mask=self._flat_tokens(mask, tokens, prompt_rows), cache=cache,
                                       capacity=None, inference=True, return_hidden=True, adapter=adapter,
                                       expert_placement=placement, return_routing=routing)
            hidden = self._sampled_tokens(out.hidden_states, last, segments)
        else:
            keys, values = dict(keys), dict(values)
            mtp_pools = (keys.pop("mtp"), values.pop("mtp")) if self.mtp else None
            cache = PagedKVCache(keys=keys, values=values, page_table=inputs["page_table"],
                                 lengths=inputs["lengths"])
            out = self.model.step_math(params, inputs["ids"], attention_mask=mask, cache=cache, capacity=None,
                                       inference=True, return_hidden=True, adapter=adapter, expert_placement=placement,
                                       final_norm=not self.mtp, return_routing=routing)
            before_norm = out.hidden_states
            hidden = (final_normed(self.model.core, self.model.nested_weights(params, adapter), before_norm)
                      if self.mtp else before_norm)
            hidden = hidden if verify else jnp.take_along_axis(hidden, last[:, None, None], axis=1)
        loads = (() if self.rebalance_every is None else (out.expert_load,)) + (
            (jax.lax.with_sharding_constraint(out.ep_rank_load, self._replicated),) if self.counts_rank_load else ())
        recorded = (self._row_routing(out.routing, tokens, prompt_rows),) if routing else ()
        if self.mtp:
            drafting = partial(self._drafted, params, adapter, before_norm, mtp_pools, inputs)
        logits = self.model.head_logits(self.model.nested_weights(params, adapter), hidden)
        top = min(MAX_TOP_LOGPROBS, logits.shape[-1])
        rows = logits.shape[0]
        no_logprobs = (jnp.zeros(rows), jnp.zeros((rows, top), jnp.int32), jnp.zeros((rows, top)))
        if verify:
            no_logprobs = jax.lax.with_sharding_constraint(no_logprobs, self._replicated)
            verified = self._verified(logits, inputs)
            keys, values = out.cache.keys, out.cache.values
            if self.mtp:   # the kept drafts, then the token drawn after them, follow each position
                mtp_keys, mtp_values, drafts = drafting(jnp.maximum(verified[:, 1:], 0), verified[:, 0] - 1)
                keys, values, loads = {**keys, "mtp": mtp_keys}, {**values, "mtp": mtp_values}, (drafts, *loads)
            return (verified, no_logprobs, keys, values, counts, *recorded, *loads)
        raw = jax.lax.with_sharding_constraint(logits[:, 0], self._rows_2d).astype(jnp.float32)   # whole rows: sorted
        logits, counts = self._controlled(raw, counts, inputs)
        keys_per_row = jax.vmap(lambda seed, count: jax.random.fold_in(jax.random.key(seed), count))(
            inputs["seeds"], inputs["counters"])
        # The warpers sort every row's logits: only when some row samples (a greedy batch skips them).
        new_ids = jax.lax.cond(
            jnp.any(inputs["do_sample"]),
            lambda: next_tokens_per_row(logits, keys_per_row, inputs["do_sample"], inputs["temperature"],
                                        inputs["top_k"], inputs["top_p"]),
            lambda: jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32))
        new_ids = jax.lax.with_sharding_constraint(new_ids, self._replicated)
        logprobs = jax.lax.cond(jnp.any(inputs["logprobs"] > 0), lambda: token_logprobs(raw, new_ids, top),
                                lambda: no_logprobs)
        logprobs = jax.lax.with_sharding_constraint(logprobs, self._replicated)
        keys, values = out.cache.keys, out.cache.values
        if self.mtp:
            mtp_keys, mtp_values, drafts = drafting(next_tokens(inputs["ids"], last, inputs["next_id"], new_ids), last)
            keys, values, loads = {**keys, "mtp": mtp_keys}, {**values, "mtp": mtp_values}, (drafts, *loads)
        return new_ids, logprobs, keys, values, counts, *recorded, *loads

    def _row_routing(self, routing: jax.Array, tokens: int, prompt_rows: int | None) -> jax.Array:
        """routing: [B, L, S, K] the step's (a mixed step's flat tokens: [G * Ng, L, 1, K]) -> [rows, tokens, L, K]
        each row's tokens' expert ids (a mixed step's slot rows: their one token, then -1), replicated, int16
        where the expert ids fit."""
        if prompt_rows is not None:   # `_flat_tokens` undone: each group's prompt rows whole, then its slots'
            flat = routing[:, :, 0].reshape(self.groups, -1, *routing.shape[1::2])          # [G, Ng, L, K]
            prompts = flat[:, :prompt_rows * tokens].reshape(self.groups, prompt_rows, tokens, *flat.shape[2:])
            slots = flat[:, prompt_rows * tokens:, None]                                    # [G, slots, 1, L, K]
            slots = jnp.concatenate([slots, jnp.full((*slots.shape[:2], tokens - 1, *slots.shape[3:]), -1,
                                                     slots.dtype)], axis=2)
            rows = jnp.concatenate([prompts, slots], axis=1).reshape(-1, tokens, *flat.shape[2:])
        else:
            rows = routing.swapaxes(1, 2)
        dtype = routing_dtype(self.model.config.num_experts)
        return jax.lax.with_sharding_constraint(rows.astype(dtype), self._replicated)

    def _drafted(self, params, adapter, before_norm, pools: tuple, inputs: dict, next_ids, start) -> tuple:
        """The MTP layer's step (`mtp_drafts`) -> (its keys and values pools, drafts [rows, num_speculative_tokens]
        replicated)."""
        drafts, mtp_keys, mtp_values = mtp_drafts(self.model, params, adapter, before_norm, next_ids, pools, inputs,
                                                  start, self.config.num_speculative_tokens)
        return mtp_keys, mtp_values, jax.lax.with_sharding_constraint(drafts, self._replicated)

    def _controlled(self, logits: jax.Array, counts: tuple, inputs: dict) -> tuple[jax.Array, tuple]:
        """logits: [R, V] float32 -> (them after each row's bias, grammar mask and penalties, the counts with this
        step's tokens): one `lax.cond` for all (a branch costs the step a read of its predicate), run only when some
        row has a bias, a grammar or a penalty (a row without adds zeros, allows every token and is penalized by
        nothing)."""
        used = jnp.any(inputs["bias"] != 0) | jnp.any(inputs["penalty"] > 0) | jnp.any(inputs["allowed"] != -1)
        return jax.lax.cond(used, partial(self._biased_and_penalized, inputs), lambda l, c: (l, c), logits, counts)

    @staticmethod
    def _biased_and_penalized(inputs: dict, logits: jax.Array, counts: tuple) -> tuple[jax.Array, tuple]:
        """Each row's biases added and its grammar's disallowed tokens at -inf; the counts updated by the penalized rows (`penalty`: a first prompt row resets
        its slot's, prompt rows mark their ids, decode rows count their input id); then every row's logits
        penalized by its slot's."""
        logits = add_bias(logits, inputs["bias_ids"], inputs["bias"])
        logits = allowed_only(logits, inputs["allowed"])
        generated, in_prompt = counts
        slots, kind, ids = inputs["slots"], inputs["penalty"], inputs["ids"]
        nowhere = generated.shape[0]   # an out-of-range slot: the scatter drops the row's update
        reset = jnp.where(kind == PENALTY_FIRST_PROMPT, slots, nowhere)
        generated = generated.at[reset].set(0, mode="drop")
        in_prompt = in_prompt.at[reset].set(False, mode="drop")
        prompt = ((kind == PENALTY_PROMPT) | (kind == PENALTY_FIRST_PROMPT))[:, None] & (inputs["mask"] > 0)
        in_prompt = in_prompt.at[jnp.where(prompt, slots[:, None], nowhere), ids].set(True, mode="drop")
        generated = generated.at[jnp.where(kind == PENALTY_DECODE, slots, nowhere), ids[:, 0]].add(1, mode="drop")
        logits = penalize(logits, generated[slots], in_prompt[slots], inputs["presence_penalty"],
                          inputs["frequency_penalty"], inputs["repetition_penalty"])
        return logits, (generated, in_prompt)

    def _verified(self, logits: jax.Array, inputs: dict) -> jax.Array:
        """logits: [R, S, V] a verification step's -> [R, 1 + S] each row's count of new tokens, then the tokens
        (`speculative.accepted_tokens`; position j's key is the row's key for its output index counter + j)."""
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(self.model.mesh, P(
            spec_entry(self.model.layout.batch_axes), None, None)))
        length = logits.shape[1]
        keys = jax.vmap(lambda seed, count: jax.vmap(lambda j: jax.random.fold_in(jax.random.key(seed), count + j))(
            jnp.arange(length)))(inputs["seeds"], inputs["counters"])
        tokens, counts = accepted_tokens(logits, inputs["ids"], inputs["mask"], keys, inputs["do_sample"],
                                         inputs["temperature"], inputs["top_k"], inputs["top_p"])
        return jax.lax.with_sharding_constraint(jnp.concatenate([counts[:, None], tokens], axis=1), self._replicated)

    def _segments(self, tokens: int, prompt_rows: int) -> tuple[tuple[int, int], ...]:
        """A mixed step's sequences per group: (prompt rows, chunk tokens), (slots, 1)."""
        return (prompt_rows, tokens), (self.config.max_slots // self.groups, 1)

    def _flat_tokens(self, rows: jax.Array, tokens: int, prompt_rows: int) -> jax.Array:
        """rows: [G * Q, C] a mixed step's rows -> [G * Ng, 1] its tokens: each group's prompt rows whole, then
        its slots' first column."""
        grouped = rows.reshape(self.groups, -1, tokens)
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
