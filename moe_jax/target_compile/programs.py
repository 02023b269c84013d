"""The programs a model runs, lowered on abstract inputs (`jax.ShapeDtypeStruct`s in their shardings): what
`compile_for_target` compiles, on real devices or on abstract target ones alike.

    lowered = train_program(model, request)        # one optimizer step on request.batch_size x seq_len tokens
    lowered = prefill_program(model, request)      # generate's prefill: max_slots prompts into the KV cache
    lowered = decode_program(model, request)       # generate's decode: one token for max_slots rows
    lowered = batching_step_program(model, request)   # the server's continuous-batching step (mixed or prefill)

Each is the library's own program (`make_train_step`'s jit, `Generator`'s prefill and decode), not a copy: what
compiles here is what a run executes. Nothing is allocated; the model's parameters are `abstract_params()`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..inference.generate import Generator
from ..inference.sampling import Sampling
from ..kv_cache import bucket_length
from ..planning.compiled_step import abstract_cache
from ..planning.request import PlanRequest
from ..training.optimizers import build_optimizer
from ..training.state import abstract_train_state
from ..training.step import make_train_step
from .host_placement import lower_train_step

GREEDY = Sampling(do_sample=False, top_k=None)


def _replicated(model, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(model.mesh, P()))


def _batch(model, rows: int, length: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=model.batch_sharding())


def _weights(model):
    """(params, adapter, placement) as the generator's programs take them."""
    placement = model.expert_placement
    if placement is not None:
        placement = jax.tree.map(lambda leaf: _replicated(model, leaf.shape, leaf.dtype), placement)
    return model.params, model.adapter, placement


def train_program(model, request: PlanRequest, *, trainable=None, grad_clip: float | None = 1.0):
    """The train step (`make_train_step`) lowered for one batch of `request.batch_size` x `request.seq_len`
    tokens, at the capacity a run starts at; trainable: a selection as `make_train_step` takes it (frozen parts,
    or the adapter when the model has one). `request.offload` keeps that part of the state in pinned host memory
    between steps (on abstract target GPUs, which have no memory spaces to name, written into the lowered step:
    `host_placement`)."""
    optimizer = build_optimizer(request.optimizer, learning_rate=1e-3)
    step = make_train_step(model, optimizer, grad_clip=grad_clip, grad_accum=request.grad_accum,
                           mixed_precision=request.mixed_precision, offload=request.offload,
                           **({} if trainable is None else {"trainable": trainable}))
    capacity = None if model.layout.ep_size == 1 else model.capacity_schedule.start().capacity
    state = abstract_train_state(model, step.optimizer, capacity, trainable=step.trainable,
                                 memory_kind=step.memory_kind)
    return lower_train_step(step, state, {"input_ids": _batch(model, request.batch_size, request.seq_len)})


def _rows(model, request: PlanRequest) -> int:
    group = model.data_parallel_size
    return -(-request.max_slots // group) * group


def _serving_lengths(model, request: PlanRequest) -> tuple[int, int]:
    """(prompt length, cache length): prompts of min(seq_len, max_model_len / 2) tokens, a cache of max_model_len."""
    length = bucket_length(request.max_model_len)
    limit = getattr(model.config, "max_position_embeddings", None)
    length = min(length, limit) if limit else length
    return max(1, min(request.seq_len, length // 2)), length


def prefill_program(model, request: PlanRequest):
    """`generate`'s prefill, lowered: `max_slots` prompts (rounded up to the data-parallel size) written into a
    KV cache of `max_model_len` tokens, greedy first tokens."""
    rows = _rows(model, request)
    prompt, length = _serving_lengths(model, request)
    key = jax.eval_shape(lambda: jax.random.key(0))
    arguments = (_weights(model), _batch(model, rows, prompt), _batch(model, rows, prompt),
                 abstract_cache(model, rows, length), _replicated(model, key.shape, key.dtype),
                 _replicated(model, (1,), jnp.int32))
    return Generator(model).jitted("prefill", GREEDY).lower(*arguments)


def decode_program(model, request: PlanRequest):
    """`generate`'s decode step, lowered: one greedy token for `max_slots` rows against a KV cache of
    `max_model_len` tokens (the cache donated, as generate runs it)."""
    rows = _rows(model, request)
    _, length = _serving_lengths(model, request)
    key = jax.eval_shape(lambda: jax.random.key(0))
    row_vector = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=NamedSharding(model.mesh, P(
        model.batch_sharding().spec[0])))
    finished = jax.ShapeDtypeStruct((rows,), jnp.bool_, sharding=row_vector.sharding)
    arguments = (_weights(model), row_vector, row_vector, abstract_cache(model, rows, length), finished,
                 _replicated(model, key.shape, key.dtype), _replicated(model, (1,), jnp.int32),
                 _replicated(model, (), jnp.int32))
    return Generator(model).jitted("decode", GREEDY).lower(*arguments)


def _engine(model, request: PlanRequest):
    from ..inference.continuous import ContinuousBatchingConfig, ServingEngine

    return ServingEngine(model, ContinuousBatchingConfig(max_slots=request.max_slots,
                                                         max_model_len=request.max_model_len))


def batching_step_program(model, request: PlanRequest):
    """The continuous-batching engine's step that admits prompts (a mixed step: chunks of prompts beside every
    slot's next token; or a prefill step), lowered at its widest page table: what `moe-jax serve` runs with
    `max_slots` slots of `max_model_len` tokens."""
    engine = _engine(model, request)
    name, rows, tokens = engine.program_shapes()[0]
    return engine.programs.lower(name, rows, tokens, max(engine.page_widths))


def batching_decode_program(model, request: PlanRequest):
    """The continuous-batching engine's decode step for every slot, at its widest page table."""
    engine = _engine(model, request)
    name, rows, tokens = max((shape for shape in engine.program_shapes() if shape[0] == "decode"),
                             key=lambda shape: shape[1])
    return engine.programs.lower(name, rows, tokens, max(engine.page_widths))


# What each kind of compile builds: --train the train step; --serve the server's continuous-batching programs;
# --generate `generate`'s prefill and decode.
PROGRAMS = {"train": {"train_step": train_program},
            "serve": {"batching_step": batching_step_program, "batching_decode": batching_decode_program},
            "generate": {"prefill": prefill_program, "decode": decode_program}}
