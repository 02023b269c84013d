"""The decoder layers as a pipeline over the mesh's `pp` axis, inside the one jitted step.

The batch is cut into M microbatches that stream through the stages (GPipe; with a circular layout each stage
holds `repeats` chunks of layers and a microbatch passes it `repeats` times). Every stage runs the same program,
`jax.vmap` over a leading stage axis with `spmd_axis_name="pp"` (MaxText's pipeline), so each device computes
only its stage's slice and the stage-to-stage hand-over (`jnp.roll` over that axis) is a collective-permute
across `pp`. The iterations are one `jax.lax.scan`, so the program and its compile time do not grow with M:

    iteration t, stage p: work item w = t - p (valid when 0 <= w < M * repeats): microbatch w % M, repeat w // M
    stage 0 reads microbatch w from its own buffer: the embeddings (repeat 0), then the last stage's output of
    it (later repeats), which the roll handed it; after the loop that buffer holds every result
    T = M * repeats + stages - 1 iterations; the bubble fraction is (stages - 1) / T

Bubble iterations (a stage with no valid work item) compute on zeros, and everything they produce is dropped by
selects: their outputs, dispatch statistics and router sums never reach the results or the gradients.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ..distributed.capacity import DispatchStatistics
from ..distributed.mesh import PP
from ..kv_cache import ContiguousKV, KVCache, RingKV
from ..nn.norms import rms_norm
from ..ops.routing import load_balancing_sums
from .decoder import decoder_layer, embedded_inputs
from .family import Family
from .pipeline_layout import PipelineLayout
from .step_options import REMAT_POLICIES, StepOptions

# What the pipeline's buffers (the stages' state, the outputs not yet written) hold before a stage writes them:
# bubble iterations read them. tests/models/test_pipeline.py sets NaN to show that nothing read there reaches the
# results, statistics or gradients (bubbles compute on zeros selected in their place).
BUBBLE_FILL = 0.0


def microbatched(array: jax.Array, microbatches: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...]: microbatch m holds rows m, M + m, 2M + m, ... (each data-parallel device's
    rows split among the microbatches in place: no data moves)."""
    batch = array.shape[0]
    return array.reshape(batch // microbatches, microbatches, *array.shape[1:]).swapaxes(0, 1)


def unmicrobatched(array: jax.Array) -> jax.Array:
    """[M, B / M, ...] -> [B, ...], the inverse of `microbatched`."""
    return array.swapaxes(0, 1).reshape(-1, *array.shape[2:])


def _zero_statistics(shape=()) -> DispatchStatistics:
    zero = jnp.zeros(shape, jnp.int32)
    return DispatchStatistics(zero, zero, zero, jnp.zeros(shape, jnp.float32))


def _where(keep, value, otherwise):
    return jax.tree.map(lambda a, b: jnp.where(keep, a, b), value, otherwise)


def pipeline_layers(family: Family, config, layout: PipelineLayout, microbatches: int, layers: dict, x, rope,
                    token_mask, masks: dict, step: StepOptions, aux_sums: bool, caches: dict | None = None):
    """The decoder layers on x [B, S, H] through the pipeline -> (x [B, S, H], router sums or None, statistics,
    updated caches or None, expert load [sparse layers, E] or None).

    layers: `params["model"]["layers"]` of a pipeline `LayerStack` (each group's leaves [stages * repeats *
    slots, ...], split over `pp`). rope: (cos, sin) [B, S, D]. token_mask: [B, S], 1 for the real tokens among
    x's (the router sums count them). masks: the keys' mask [B, K] per cache entry key
    (a sliding-window ring's own), "": the mask of every other entry. caches: cache entry key -> (keys, values)
    [rows, B, T, K, D] (`KVCache.keys` / `values`), each stage writing its rows for the microbatch it runs.
    Router sums (with `aux_sums`): (tokens per expert [E], router probabilities per expert [E], rows) over every
    sparse layer and microbatch (`moe_jax.ops.routing.load_balancing_from_sums` gives the aux loss). Packed
    rows (`step.segment_ids` [B, S]) travel with their microbatch: each stage attends within the documents of the
    rows it runs. The expert load (real tokens each sparse layer sent to each expert, as `ModelOutput.expert_load`)
    is counted where each layer runs and summed over stages once, after the loop."""
    stages, repeats, m_count = layout.stages, layout.repeats, microbatches
    work_items = m_count * repeats
    layouts = step.layouts
    inputs = layouts.constrain(microbatched(x, m_count), (None, "batch", "sequence", "embed"))
    masks = {key: microbatched(mask, m_count) for key, mask in masks.items()}
    token_masks = microbatched(token_mask, m_count)
    segments = None if step.segment_ids is None else microbatched(step.segment_ids, m_count)
    # Replayed routing travels with its microbatch: [M, B / M, layers, S, K].
    routings = None if step.routing is None else microbatched(step.routing.swapaxes(0, 1), m_count)
    ropes = jax.tree.map(lambda a: microbatched(a, m_count), rope)
    per_stage = lambda leaf: leaf.reshape(stages, repeats, -1, *leaf.shape[1:])  # noqa: E731
    stage_weights = jax.tree.map(per_stage, layers)
    stage_caches = None if caches is None else jax.tree.map(per_stage, caches)
    # Per (stage, repeat): the layer number at each slot (for per-layer randomness) and which kind each group's
    # chunk is; constants of the layout.
    layer_numbers = np.zeros((stages, repeats, layout.slots), np.int32)
    for stage in range(stages):
        for repeat in range(repeats):
            start, stop = layout.chunk(stage, repeat)
            layer_numbers[stage, repeat, :stop - start] = np.arange(start, stop)
    present = [[np.asarray(kind.present, bool).reshape(stages, repeats) for kind in group.kinds]
               for group in layout.groups]
    experts = config.num_experts if aux_sums else 1
    sparse = family.sparse_layers(config)
    # Per stage, every layer's row (a layer's load lands in the stage that runs it): [stages, L, E].
    load_shape = (config.num_hidden_layers, config.num_experts) if sparse else (0, 0)
    stage = partial(_stage, family, config, layout, step, aux_sums, experts, m_count)

    def keep_last_output(state, buffer, t):
        """Stage 0's buffer takes the last stage's output of iteration t - 1, which the roll just handed to stage
        0 (its work item t - stages): a circular schedule's next repeat reads it there, and after the last
        iteration the buffer holds every microbatch's result. Local to stage 0: nothing but the roll crosses
        stages while the loop runs."""
        finished = t - stages
        written = (finished >= 0) & (finished < work_items)
        slot = jnp.clip(finished, 0, work_items - 1) % m_count
        # Written for every stage at once, stage 0's only: an op on the stage axis as a whole stays on each stage's
        # devices, where taking stage 0's slice would gather it everywhere.
        keep = (written & (jnp.arange(stages) == 0))[:, None, None, None]
        return buffer.at[:, slot].set(jnp.where(keep, state, buffer[:, slot]))

    def iteration(carry, t):
        state, buffer, statistics, sums, loads, stage_caches = carry
        buffer = keep_last_output(state, buffer, t)
        stage_ids = jnp.arange(stages)
        work = t - stage_ids
        valid = (work >= 0) & (work < work_items)
        work = jnp.clip(work, 0, work_items - 1)
        micro, repeat = work % m_count, work // m_count
        # Stage 0 reads the embeddings (repeat 0) or the kept output (each stage reads its own buffer; only stage 0's
        # is used).
        state = jnp.where((stage_ids == 0)[:, None, None, None], buffer[:, micro[0]], state)
        state = jnp.where(valid[:, None, None, None], state, jnp.zeros_like(state))  # bubbles compute on zeros
        state = layouts.constrain_staged(state, ("batch", "sequence", "embed"))
        out, stage_statistics, stage_sums, stage_loads, stage_caches = jax.vmap(stage, spmd_axis_name=PP)(
            stage_weights, state, {key: mask[micro] for key, mask in masks.items()},
            token_masks[micro], None if segments is None else segments[micro],
            None if routings is None else routings[micro],
            jax.tree.map(lambda a: a[micro], ropes), repeat, micro, valid, jnp.asarray(layer_numbers),
            [[jnp.asarray(p) for p in kinds] for kinds in present], loads, stage_caches)
        out = layouts.constrain_staged(out, ("batch", "sequence", "embed"))
        statistics = statistics.combine(stage_statistics)
        sums = jax.tree.map(jnp.add, sums, stage_sums)
        return (jnp.roll(out, 1, axis=0), buffer, statistics, sums, stage_loads, stage_caches), None

    state = jnp.full((stages, *inputs.shape[1:]), BUBBLE_FILL, x.dtype)
    # Stage 0's buffer starts as the microbatches' embeddings (the other stages' are unused): it is stage 0's input
    # at every repeat, so neither the embeddings nor their gradient cross stages inside the loop.
    buffer = jnp.full((stages, *inputs.shape), BUBBLE_FILL, x.dtype).at[0].set(inputs)
    sums = (jnp.zeros((stages, experts), jnp.float32), jnp.zeros((stages, experts), jnp.float32),
            jnp.zeros((stages,), jnp.float32))
    carry = (layouts.constrain_staged(state, ("batch", "sequence", "embed")),
             layouts.constrain_staged(buffer, (None, "batch", "sequence", "embed")),
             _zero_statistics((stages,)), sums, jnp.zeros((stages, *load_shape), jnp.float32), stage_caches)
    iterations = work_items + stages - 1
    (state, buffer, statistics, sums, loads, stage_caches), _ = jax.lax.scan(iteration, carry,
                                                                             jnp.arange(iterations))
    buffer = keep_last_output(state, buffer, iterations)
    statistics = DispatchStatistics(statistics.dropped.sum(), statistics.padded.sum(),
                                    statistics.buffer_rows.max(), statistics.required_capacity.max())
    # The results leave stage 0 once, for the norm and head (replicated over pp).
    hidden = layouts.constrain(unmicrobatched(buffer[0]), ("batch", "sequence", "embed"))
    caches = None if caches is None else jax.tree.map(lambda leaf: leaf.reshape(-1, *leaf.shape[3:]), stage_caches)
    expert_load = loads.sum(0)[np.asarray(sparse)] if sparse else None
    return hidden, tuple(s.sum(0) for s in sums) if aux_sums else None, statistics, caches, expert_load


def _microbatch_rows(array, micro, m_count: int):
    """array [n, B, ...] -> the rows of microbatch `micro` [n, B / M, ...] (rows micro, M + micro, ...)."""
    split = array.reshape(array.shape[0], -1, m_count, *array.shape[2:])
    return jax.lax.dynamic_index_in_dim(split, micro, axis=2, keepdims=False)


def _with_microbatch_rows(array, rows, micro, m_count: int):
    """array [n, B, ...] with microbatch `micro`'s rows replaced by `rows` [n, B / M, ...]."""
    split = array.reshape(array.shape[0], -1, m_count, *array.shape[2:])
    return jax.lax.dynamic_update_index_in_dim(split, rows, micro, axis=2).reshape(array.shape)


def _stage(family: Family, config, layout: PipelineLayout, step: StepOptions, aux_sums: bool, experts: int,
           m_count: int, weights, x, masks, token_mask, segment_ids, routing, rope, repeat, micro, valid,
           layer_numbers, present, loads, caches):
    """One stage's chunk on its microbatch (under `vmap` over stages): x [mb, S, H] -> (x, statistics, sums,
    loads, caches). segment_ids: the microbatch's packed rows [mb, S], or None. routing: its replayed routing
    [mb, layers, S, K] (`StepOptions.routing`'s rows), or None. loads: this stage's expert load
    so far [L, E] (every layer's row; its own layers' rows grow). caches: key -> (keys, values) [repeats, slots,
    B, T, K, D] of this stage, or None."""
    if segment_ids is not None:
        step = replace(step, segment_ids=segment_ids)
    weights = jax.tree.map(lambda leaf: leaf[repeat], weights)   # this repeat's chunk: [slots of group, ...]
    numbers = layer_numbers[repeat]
    statistics = _zero_statistics()
    sums = (jnp.zeros((experts,), jnp.float32), jnp.zeros((experts,), jnp.float32), jnp.zeros((), jnp.float32))
    token_weight = token_mask.reshape(-1)
    for group, kinds_present in zip(layout.groups, present):
        result = x
        for index, kind in enumerate(group.kinds):
            key = group.key(index)
            here = kinds_present[index][repeat]
            mask = masks.get(key, masks[""])
            kv_view = None
            if caches is not None:  # a window ring's own mask, or the keys' mask at slot `length`
                kv_view = ((lambda arrays, row, mask=mask: RingKV(arrays, mask)) if key in masks else
                           (lambda arrays, row, mask=mask: ContiguousKV(arrays, step.cache.length, mask)))
            layer_fn = partial(decoder_layer, family, config, layer=kind.representative, rope=rope,
                               attention_mask=mask, step=step, kv_view=kv_view)
            if step.remat != "none":
                layer_fn = jax.checkpoint(layer_fn, policy=REMAT_POLICIES[step.remat])

            def body(carry, inputs, layer_fn=layer_fn):
                layer_weights, number, layer_cache, layer_routing = inputs
                carry, logits, layer_statistics, layer_cache = layer_fn(layer_weights, carry, layer_index=number,
                                                                        layer_cache=layer_cache,
                                                                        layer_routing=layer_routing)
                return carry, (logits, layer_statistics, layer_cache)

            chunk_cache = None
            if caches is not None:
                chunk_cache = tuple(_microbatch_rows(array[repeat], micro, m_count) for array in caches[key])
            slot_numbers = jax.lax.dynamic_slice_in_dim(numbers, group.start, group.slots)
            chunk_routing = (None if routing is None or not family.is_sparse(config, kind.representative)
                             else routing[:, slot_numbers].swapaxes(0, 1))    # [slots, mb, S, K]
            y, (logits, layer_statistics, chunk_cache) = jax.lax.scan(
                body, x, (weights[group.key(index)], slot_numbers, chunk_cache, chunk_routing))
            result = jnp.where(here, y, result)
            if caches is not None:
                written = here & valid
                caches = dict(caches)
                caches[key] = tuple(
                    array.at[repeat].set(jnp.where(written, _with_microbatch_rows(array[repeat], new, micro, m_count),
                                                   array[repeat]))
                    for array, new in zip(caches[key], chunk_cache))
            if layer_statistics is None:
                continue
            counted = here & valid
            if layer_statistics.expert_load is not None:   # [slots, E], one row per layer of the group
                loads = loads.at[slot_numbers].add(jnp.where(counted, layer_statistics.expert_load, 0.0))
            layer_statistics = DispatchStatistics(layer_statistics.dropped.sum(), layer_statistics.padded.sum(),
                                                  layer_statistics.buffer_rows.max(),
                                                  layer_statistics.required_capacity.max())
            statistics = statistics.combine(_where(counted, layer_statistics, _zero_statistics()))
            if aux_sums:
                for slot_logits in logits:
                    slot_sums = load_balancing_sums(slot_logits, config.num_experts_per_tok, token_weight,
                                                    per_token=step.layouts.token_local)
                    kept = _where(counted, slot_sums, jax.tree.map(jnp.zeros_like, slot_sums))
                    sums = jax.tree.map(jnp.add, sums, kept)
        x = result
    return x, statistics, sums, loads, caches


def pipeline_hidden(family: Family, config, layout: PipelineLayout, microbatches: int, params: dict, input_ids,
                    attention_mask, positions, step: StepOptions, aux_sums: bool):
    """`decoder_hidden` with the layers through the pipeline: input_ids, attention_mask, positions [B, S] ->
    (hidden [B, S, H] after the final norm, router sums or None, dispatch statistics, the updated `step.cache`
    or None, expert load [sparse layers, E] or None). The embeddings, the final norm and the head run outside the stages, on every stage's devices (laid
    out as without pp)."""
    model = params["model"]
    x, rope = embedded_inputs(family, config, model, input_ids, positions, step)
    cache = step.cache
    if cache is not None and not isinstance(cache, KVCache):
        raise ValueError(f"a {type(cache).__name__} cannot run through pipeline stages: continuous batching "
                         "(paged caches) needs pp_size=1; `generate` runs with pipeline stages.")
    if cache is None:
        masks, caches = {"": attention_mask}, None
    else:  # as decoder_hidden: the keys' mask with the new tokens, and each window ring's own
        key_mask = jax.lax.dynamic_update_slice(cache.key_mask, attention_mask.astype(cache.key_mask.dtype),
                                                (0, cache.length))
        masks, window_masks = {"": key_mask}, {}
        for key, ring in cache.window_masks.items():
            masks[key] = jnp.concatenate([ring, attention_mask.astype(ring.dtype)], axis=1)
            window_masks[key] = masks[key][:, -ring.shape[1]:]
        caches = {key: (cache.keys[key], cache.values[key]) for key in cache.keys}
    x, sums, statistics, caches, expert_load = pipeline_layers(family, config, layout, microbatches, model["layers"],
                                                               x, rope, attention_mask, masks, step, aux_sums, caches)
    if cache is not None:
        cache = KVCache(keys={key: pair[0] for key, pair in caches.items()},
                        values={key: pair[1] for key, pair in caches.items()}, key_mask=key_mask,
                        length=cache.length + input_ids.shape[1], window_masks=window_masks)
    return rms_norm(model["norm"], x, config.rms_norm_eps), sums, statistics, cache, expert_load
