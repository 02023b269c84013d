"""`generate`: a jitted prefill, then one jitted decode step per token, the KV cache donated between them.

    sequences = model.generate(input_ids, attention_mask, max_new_tokens=20)    # [B, S + n], as HF

Transformers' semantics: left-padded prompts, positions counted from each row's first real token, greedy
or sampled next tokens (`sampling.py`), rows that produced an EOS continue with `pad_token_id`, and the
loop stops when every row has finished or after `max_new_tokens`. The result is the prompt followed by
the new tokens.

What reaches the host per step is the new token ids [B], nothing else: sampling, the EOS bookkeeping and
the next positions stay on the device, and the host learns that every row finished from the ids it reads
anyway. Step i + 1 is dispatched before step i's ids are read, so the device never waits for the host.
Experts run at the largest dispatch capacity (`capacity=None`), which never drops a pair, so neither step
climbs a capacity ladder or reads dispatch statistics. Prompts are left-padded to a bucketed length and
the cache length is bucketed too (`cache.bucket_length`): one prefill and one decode compilation serve
every generation of nearby sizes.

`return_routing=True` records each sparse layer's expert ids for every token the programs read (routing replay,
`models.routing_replay`): the prefill and decode programs' routing variants (their own compilations; a call
without it runs the plain ones) also return their tokens' ids, which reach the host once, at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..distributed.host_arrays import host_to_global
from ..kv_cache import bucket_length, init_cache
from .generation_config import GenerationConfig
from .requests import routing_dtype
from .weights_update import updated_arrays
from .sampling import Sampling, next_tokens


@dataclass
class GenerationTimings:
    """Wall seconds: compile (both programs, first use), prefill (prompt -> first ids on the host) and
    decode (the remaining ids); token counts are over the caller's rows only."""

    compile_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens of the decode steps (all but the prefill's first) per second."""
        decoded = self.new_tokens - self.new_tokens // max(self.steps, 1)
        return decoded / self.decode_s if self.decode_s else 0.0


@dataclass
class GenerationResult:
    sequences: np.ndarray                                     # [B, S + n]
    timings: GenerationTimings = field(default_factory=GenerationTimings)
    routing: np.ndarray | None = None                         # [B, L, S + n, K] with return_routing


def prompt_positions(attention_mask: jax.Array) -> jax.Array:
    """[B, S] mask -> RoPE positions as Transformers' generate: real tokens count from 0; padding gets 1."""
    positions = jnp.cumsum(attention_mask, axis=-1) - 1
    return jnp.where(attention_mask == 0, 1, positions).astype(jnp.int32)


class Generator:
    """Prefill and decode programs of one model; each compiles once per (rows, prompt bucket, cache
    bucket, sampling rule)."""

    def __init__(self, model):
        self.model = model
        self._programs: dict[tuple, Callable] = {}
        self.compilations = 0
        # In a multi-process job each process reads every row's new ids: the programs hand them out
        # replicated (an all-gather of B ints per step). One process reads its own devices' copies as they are.
        self._host_ids = (jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec())
                          if jax.process_count() > 1 else None)

    def _for_host(self, tokens: jax.Array) -> jax.Array:
        return tokens if self._host_ids is None else jax.lax.with_sharding_constraint(tokens, self._host_ids)

    # ---- the two device programs ----------------------------------------------------------------
    # Each traces the model's `step_math` into its own jit (`generate` checked the inputs at the call).
    # weights: (params, adapter or None, expert placement or None), the model's parameters, its LoRA adapter's
    # arrays and its expert placement (redundant expert slots).
    # routing (static): the routing variant, whose last output is the tokens' expert ids [B, L, S, K].
    def _prefill(self, weights, input_ids, attention_mask, cache, key, eos, *, sampling: Sampling,
                 routing: bool = False):
        positions = prompt_positions(attention_mask)
        params, adapter, placement = weights
        out = self.model.step_math(params, input_ids, attention_mask=attention_mask, positions=positions,
                                   cache=cache, adapter=adapter, expert_placement=placement, return_routing=routing)
        tokens = next_tokens(out.logits[:, -1], key, sampling)
        finished = _is_eos(tokens, eos)
        return (self._for_host(tokens), out.cache, positions[:, -1] + 1, finished) + self._routing(out, routing)

    def _decode(self, weights, tokens, positions, cache, finished, key, eos, pad, *, sampling: Sampling,
                routing: bool = False):
        params, adapter, placement = weights
        out = self.model.step_math(params, tokens[:, None], attention_mask=jnp.ones_like(tokens)[:, None],
                                   positions=positions[:, None], cache=cache, adapter=adapter,
                                   expert_placement=placement, return_routing=routing)
        chosen = next_tokens(out.logits[:, -1], key, sampling)
        chosen = jnp.where(finished, pad, chosen)
        return (self._for_host(chosen), out.cache, positions + 1, finished | _is_eos(chosen, eos)) + self._routing(
            out, routing)

    def _routing(self, out, routing: bool) -> tuple:
        """() or (the step's routing [B, L, S, K] in the recorded dtype, as the host reads it)."""
        if not routing:
            return ()
        return (self._for_host(out.routing.astype(routing_dtype(self.model.config.num_experts))),)

    def _program(self, name: str, sampling: Sampling, arguments: tuple, routing: bool = False):
        """The jitted `name` program (with `routing`: its routing variant), compiled (and timed) on first use for
        these argument shapes."""
        shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(arguments))
        key = (name, sampling, shapes, routing)
        compile_s = 0.0
        if key not in self._programs:
            start = time.perf_counter()
            self._programs[key] = self.jitted(name, sampling, routing).lower(*arguments).compile()
            compile_s = time.perf_counter() - start
            self.compilations += 1
        return self._programs[key], compile_s

    def jitted(self, name: str, sampling: Sampling, routing: bool = False):
        """The `name` ("prefill" / "decode") program's jit: its arguments as `generate` passes them."""
        function = self._prefill if name == "prefill" else self._decode
        # Argument 3 is the cache in both programs: donated, so each step updates it in place.
        return jax.jit(partial(function, sampling=sampling, routing=routing), donate_argnums=(3,))

    def update_parameters(self, params=None, *, adapter=None) -> None:
        """New weights for the next `generate` (the model's `params`, and its LoRA `adapter`'s arrays), e.g. a train
        state's: checked against the current ones (`weights_update.updated_arrays`: the same names and shapes,
        floating arrays cast to the current dtypes, placed in the current shardings on the devices), so the
        compiled programs run them as they are."""
        model = self.model
        params = None if params is None else updated_arrays(model.params, params, "params")
        adapter = None if adapter is None else updated_arrays(model.adapter, adapter, "adapter")
        model.params = model.params if params is None else params
        model.adapter = model.adapter if adapter is None else adapter

    # ---- the host loop ------------------------------------------------------------------------------
    def generate(self, input_ids, attention_mask=None, *, config: GenerationConfig, seed: int = 0,
                 params=None, on_tokens: Callable[[int, np.ndarray], None] | None = None,
                 return_routing: bool = False) -> GenerationResult:
        """input_ids: [B, S] ints (left-padded), attention_mask: [B, S] (None: all real) -> the prompt and
        the new tokens [B, S + n]. `on_tokens(step, ids [B])` sees each step's ids as they arrive. The model's
        LoRA adapter (`model.adapter`), if any, is applied, and its expert placement (`model.expert_placement`).
        return_routing: the result's `routing` [B, L, S + n, K] holds the expert ids of every token read, aligned
        with the sequences (`sequence_routing`)."""
        model = self.model
        params = model.params if params is None else params
        weights = (params, model.adapter, model.expert_placement)
        input_ids, attention_mask = _check_prompt(input_ids, attention_mask)
        batch, prompt_length = input_ids.shape
        new_tokens = config.new_tokens(prompt_length)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and prompt_length + new_tokens > limit:
            raise ValueError(f"a prompt of {prompt_length} tokens plus {new_tokens} new ones is longer than the "
                             f"model's {limit} positions (config.max_position_embeddings); shorten the prompt or "
                             "generate fewer tokens.")
        sampling = Sampling(config.do_sample, config.temperature, config.top_k, config.top_p)
        # Traced, not static: the EOS set and pad id change no compilation (only the number of EOS ids does).
        eos = jnp.asarray(config.eos_token_id or (-1,), jnp.int32)
        pad = jnp.asarray(config.padding_token(), jnp.int32)
        eos_ids = np.asarray(config.eos_token_id, np.int64)

        group = model.data_parallel_size * model.pipeline_microbatches  # rows each program splits evenly
        rows = -(-batch // group) * group
        bucket = bucket_length(prompt_length)
        if limit is not None:
            bucket = max(prompt_length, min(bucket, limit - new_tokens))
        ids = np.zeros((rows, bucket), np.int32)
        mask = np.zeros((rows, bucket), np.int32)
        ids[:batch, bucket - prompt_length:] = input_ids
        mask[:batch, bucket - prompt_length:] = attention_mask
        mask[batch:, -1] = 1  # filler rows (batch rounded up to the data-parallel size) see one key
        cache = init_cache(model, rows, bucket + new_tokens)
        # What `model.apply` checks (the programs trace `step_math`): the prefill's inputs cover the decode's.
        model.check_step(params, (rows, bucket), cache=cache, adapter=model.adapter)
        base_key = jax.random.key(seed)
        batch_sharding = model.batch_sharding()
        ids, mask = host_to_global(ids, batch_sharding), host_to_global(mask, batch_sharding)

        timings = GenerationTimings(prompt_tokens=int(attention_mask.sum()))
        arguments = (weights, ids, mask, cache, base_key, eos)
        prefill, compile_s = self._program("prefill", sampling, arguments, return_routing)
        timings.compile_s += compile_s
        prefill_start = time.perf_counter()
        tokens, cache, positions, finished, *read = prefill(*arguments)
        produced, done = [], np.zeros(batch, bool)
        pending = tokens
        first_compile_s = 0.0  # the decode program compiles while the prefill runs: not prefill time
        for step in range(new_tokens):
            following = None
            if step + 1 < new_tokens:
                arguments = (weights, pending, positions, cache, finished, jax.random.fold_in(base_key, step + 1),
                             eos, pad)
                decode, compile_s = self._program("decode", sampling, arguments, return_routing)
                timings.compile_s += compile_s
                first_compile_s += compile_s if step == 0 else 0.0
                following = decode(*arguments)
                read += following[4:]   # the routing of `pending`, the step's input
            current = np.asarray(jax.device_get(pending))[:batch]
            if step == 0:
                timings.prefill_s = time.perf_counter() - prefill_start - first_compile_s
                decode_start = time.perf_counter()
            produced.append(current)
            if on_tokens is not None:
                on_tokens(step, current)
            done |= np.isin(current, eos_ids)
            if following is None or done.all():
                break
            pending, cache, positions, finished = following[:4]
        timings.decode_s = time.perf_counter() - decode_start
        timings.steps = len(produced)
        timings.new_tokens = batch * len(produced)
        sequences = np.concatenate([input_ids, np.stack(produced, axis=1)], axis=1)
        routing = sequence_routing(read, attention_mask, np.stack(produced, axis=1), eos_ids) if read else None
        return GenerationResult(sequences, timings, routing)


def sequence_routing(read: list, attention_mask: np.ndarray, produced: np.ndarray, eos_ids: np.ndarray) -> np.ndarray:
    """The steps' routing (the prefill's [rows, L, bucket, K], then each decode's [rows, L, 1, K]: its input's,
    the token generated before it) -> [B, L, S + n, K] aligned with the sequences (attention_mask [B, S], produced
    [B, n]): -1 at the prompts' padding, after each row's first EOS and at the last token (never read)."""
    batch, prompt = attention_mask.shape
    read = [np.asarray(jax.device_get(step))[:batch] for step in read]
    prefill, decoded = read[0], read[1:]
    routing = np.full((batch, prefill.shape[1], prompt + produced.shape[1], prefill.shape[3]), -1, prefill.dtype)
    routing[:, :, :prompt] = np.where(attention_mask[:, None, :, None] > 0, prefill[:, :, -prompt:], -1)
    for step, ids in enumerate(decoded):
        routing[:, :, prompt + step] = ids[:, :, 0]
    eos = np.isin(produced, eos_ids)
    ended = np.cumsum(eos, axis=1) - eos > 0                                   # padding after a row's first EOS
    routing[:, :, prompt:] = np.where(ended[:, None, :, None], -1, routing[:, :, prompt:])
    routing[:, :, -1] = -1   # read only when a step follows it, which nothing needs: as the engine's outputs
    return routing


def _is_eos(tokens: jax.Array, eos: jax.Array) -> jax.Array:
    """tokens: [B], eos: [n] ids (-1 where there is none) -> [B] bool."""
    return jnp.any(tokens[:, None] == eos[None, :], axis=-1)


def _check_prompt(input_ids, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    input_ids = np.asarray(input_ids)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, sequence], got shape {input_ids.shape}.")
    if not np.issubdtype(input_ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}.")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: generate needs at least one token per row.")
    if attention_mask is None:
        attention_mask = np.ones_like(input_ids)
    attention_mask = np.asarray(attention_mask)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {attention_mask.shape}, expected {input_ids.shape}.")
    if (attention_mask[:, -1] == 0).any():
        raise ValueError("prompts must be left-padded (the last column of attention_mask is 0 for some row): "
                         "tokenize with padding_side='left', as Transformers' generate expects.")
    return input_ids.astype(np.int32), attention_mask.astype(np.int32)
