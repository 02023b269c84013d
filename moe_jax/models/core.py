"""One built model as data (`ModelCore`) and its step as a free function (`step_math`).

A `ModelCore` holds what the step needs besides parameters and inputs: the family and its config, how layers are
stored (`LayerStack`), the experts module of each sparse layer (bound to the mesh by the plans), the activation
layouts (logical axes -> mesh axes), the remat policy and whether the layout dispatches tokens. `step_math` is
pure and never jitted here: the facade's `apply`, the train step, the generator and the NNX face each own the
one jit around it, at their boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ..distributed.activations import ActivationLayouts, LogicalAxisRules, logical_axis_rules
from ..distributed.capacity import DispatchStatistics
from ..distributed.context import ContextLayout
from ..distributed.eplb import ExpertPlacement, identity_placement
from ..distributed.mesh import DeviceLayout
from ..nn.attention_core import attention_for_device, segment_starts
from ..nn.context_attention import ContextAttention
from ..nn.norms import rms_norm
from ..ops.routing import load_balancing_from_sums, load_balancing_loss
from .decoder import decoder_hidden, head_logits, rope_tables
from .family import Family
from .layer_stack import LayerStack
from .mtp import mtp_forward, mtp_step
from .outputs import ModelOutput
from .pipeline import pipeline_hidden
from .routing_replay import layer_rows, recorded
from .step_options import StepOptions


@dataclass(frozen=True)
class ModelCore:
    """What `step_math` needs of one built model besides parameters and inputs.

    sharded_experts: sparse layer -> its experts module, `(tokens [N, H], ids [N, K], weights [N, K], params, *,
    inference, capacity) -> (out [N, H], statistics)` (a `distributed.experts.ShardedExperts`).
    dispatches: the layout dispatches tokens (ep > 1), so the capacity is a static argument of the step.
    adapter: the layout of the model's LoRA adapter, or None: `attach(nested params, adapter arrays)` returns the
    nested params with each adapted weight's factors beside it (`moe_jax.lora.AdapterLayout`).
    ep_size: the ranks experts are dispatched over (1: none), the width of `ModelOutput.ep_rank_load`.
    num_redundant_experts: R extra expert slots per sparse layer; each step takes an `ExpertPlacement`.
    mtp_layers: the multi-token-prediction layers after the decoder layers (`models.mtp`; 0: none).
    device: the first device of the model's mesh, whose kind picks the attention kernels
    (`nn.attention_core.attention_for_device`; None: the host's default backend's).
    context: the context-parallel layout (`distributed.context`; None: each sequence on one device)."""

    family: Family
    config: Any
    layer_stack: LayerStack
    sharded_experts: Mapping[int, Any]
    layouts: ActivationLayouts
    remat: str = "none"
    dispatches: bool = False
    microbatches: int = 1     # pipeline microbatches (with pipeline stages: `layer_stack.pipeline`)
    adapter: Any = None
    ep_size: int = 1
    num_redundant_experts: int = 0
    mtp_layers: int = 0
    device: Any = None
    context: ContextLayout | None = None


def nested_weights(core: ModelCore, params: Mapping[str, Any], adapter: Mapping[str, Any] | None = None,
                   placement: ExpertPlacement | None = None) -> dict:
    """params (storage layout) nested by module, with `adapter`'s factors (its storage layout) attached to the
    weights they adapt, and each sparse layer's slice of `placement` (an `ExpertPlacement` [sparse layers, ...])
    beside its experts' weights: the tree the family's math walks. The base arrays are not copied."""
    nested = core.layer_stack.nest(params)
    if placement is not None:
        nested = attach_placement(core, nested, placement)
    if adapter is None:
        return nested
    if core.adapter is None:
        raise ValueError("an adapter was passed, but the model has none: add_adapter() or load_adapter() first.")
    return core.adapter.attach(nested, adapter)


def attach_placement(core: ModelCore, nested: dict, placement: ExpertPlacement) -> dict:
    """`nested` with `placement`'s rows of each sparse run under its experts module's "placement" entry: one
    layer's arrays for a single layer, a scanned run's rows stacked (the scan slices them with the weights)."""
    sparse = {layer: row for row, layer in enumerate(core.family.sparse_layers(core.config))}
    module = core.family.feed_forward_module
    layers = dict(nested["model"]["layers"])
    for run in core.layer_stack.runs:
        if run.start not in sparse:
            continue
        first = sparse[run.start]
        rows = slice(first, first + len(run.layers)) if run.scanned else first
        feed_forward = dict(layers[run.key][module])
        feed_forward["experts"] = {**feed_forward["experts"],
                                   "placement": jax.tree.map(lambda array, rows=rows: array[rows], placement)}
        layers[run.key] = {**layers[run.key], module: feed_forward}
    return {**nested, "model": {**nested["model"], "layers": layers}}


def model_axis_rules(family: Family, layout: DeviceLayout, tp_plan: Mapping[str, str], present: set[str],
                     prefix: str = "model", head_rows: tuple[str, ...] = ()) -> LogicalAxisRules:
    """The logical axes' mesh axes on `layout`, from the resolved TP plan: the output axis of each module in the
    family's `output_axes` (and the head's, `vocab`) that the model has (`present`: its plan names); head_rows:
    the tp axes the head's weight splits its vocab rows over."""
    output_axes = {f"{prefix}.{module}": axis for module, axis in family.output_axes.items()}
    output_axes["lm_head"] = "vocab"
    return logical_axis_rules(layout, tp_plan, {module: axis for module, axis in output_axes.items()
                                                if module in present}, head_rows)


def step_math(core: ModelCore, params: Mapping[str, Any], input_ids, *, attention_mask=None, positions=None,
              cache=None, capacity: float | None = None, rng: jax.Array | None = None, inference: bool = True,
              return_hidden: bool = False, compute_dtype=None, segment_ids=None,
              adapter: Mapping[str, Any] | None = None, expert_placement: ExpertPlacement | None = None,
              return_mtp_logits: bool = False, final_norm: bool = True, routing=None,
              return_routing: bool = False, context_order: bool = False) -> ModelOutput:
    """The pure step: params (storage layout), input_ids [B, S] -> `ModelOutput` (logits [B, S, V], or the final
    hidden states [B, S, H] with `return_hidden`; router logits, aux loss, dispatch statistics, the cache).
    Arguments as the facade's `apply`, whose checks (`check_step`) its callers run at their jit boundary.
    adapter: the LoRA adapter's arrays (storage layout of `core.adapter`), applied beside the base weights.
    expert_placement: with redundant expert slots, which logical expert each slot holds (an `ExpertPlacement`
    input: a new one is new data, not a new program); None: the identity placement.

    segment_ids: [B, S] packed rows: several documents per row, numbered 1, 2, ... (0: padding). Tokens attend
    only within their document, positions restart at each document (unless given), and the router's aux loss
    counts only real tokens; `attention_mask` is then ignored (the padding is segment 0).

    return_mtp_logits: also run the model's multi-token-prediction layers (`models.mtp`; ValueError without
    them): `mtp_logits` [D, B, S, V], depth k's row k - 1 at position i predicting token i + k + 1, or, with
    `return_hidden`, `mtp_hidden_states` [D, B, S, H] (each shared head's input) instead. Their dispatch counts
    join `statistics`; their routing joins neither `router_logits` nor `expert_load`. Not with a cache or
    pipeline stages.

    final_norm=False (with `return_hidden`, no pipeline stages): the hidden states before the final norm (what the
    MTP layers read; `final_normed` applies it).

    routing: [B, L, S, K] expert ids (L sparse layers; -1: the router chooses) each token runs instead of its
    router's top-k, weighted by the router at them (`models.routing_replay`, `ops.routing`); the MTP layers
    route themselves. return_routing: `routing` [B, L, S, K] of the output holds the ids each sparse layer ran
    (not through pipeline stages).

    Under context parallelism (`core.context`) the step runs on the sequence in the context order and returns
    hidden states, logits, router logits and routing in the natural order; context_order=True leaves the hidden
    states / logits in the context order (a loss that orders its targets the same saves the reordering)."""
    if return_mtp_logits:
        check_mtp_step(core, cache)
    if return_routing and core.layer_stack.pipeline is not None:
        raise ValueError("return_routing=True is not supported through pipeline stages (pp_size > 1): each layer's "
                         "routing stays in its stage; record it on a layout without pp (replaying it works there).")
    if not core.dispatches:
        capacity = None  # no dispatch buffers: one program whatever the caller holds
    compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
    layouts, config, family = core.layouts, core.config, core.family
    input_ids = layouts.batch(jnp.asarray(input_ids, jnp.int32))
    batch, sequence = input_ids.shape
    if segment_ids is not None:
        if cache is not None:
            raise ValueError("packed rows (segment_ids) are a training / scoring input: not with a KV cache.")
        segment_ids = layouts.batch(jnp.asarray(segment_ids, jnp.int32))
        attention_mask = (segment_ids > 0).astype(jnp.int32)
        if positions is None:   # each document counts from 0
            positions = jnp.arange(sequence, dtype=jnp.int32)[None, :] - segment_starts(segment_ids)
    unpadded = attention_mask is None
    attention_mask = (jnp.ones((batch, sequence), jnp.int32) if attention_mask is None
                      else layouts.batch(jnp.asarray(attention_mask, jnp.int32)))
    if positions is None:
        first = 0 if cache is None else cache.next_index
        positions = jnp.broadcast_to(first + jnp.arange(sequence, dtype=jnp.int32)[None, :], (batch, sequence))
    positions = layouts.batch(jnp.asarray(positions, jnp.int32))
    context = None
    if core.context is not None:
        check_context_step(core, cache, return_mtp_logits)
        context = ContextAttention(core.context, layouts.rules)
        order = core.context.to_context_order
        in_length = lambda x: layouts.constrain(x, ("batch", "length"))  # noqa: E731
        input_ids, attention_mask, positions = (in_length(order(x)) for x in (input_ids, attention_mask, positions))
        segment_ids = None if segment_ids is None else in_length(order(segment_ids))
        routing = None if routing is None else order(jnp.asarray(routing), axis=2)
    step = StepOptions(
        sharded_experts=core.sharded_experts, capacity=capacity, inference=inference, rng=rng, remat=core.remat,
        layouts=layouts, compute_dtype=compute_dtype, cache=cache, segment_ids=segment_ids, unpadded=unpadded,
        attention=attention_for_device(core.device),
        routing=None if routing is None else layouts.constrain(
            layer_rows(routing, family.sparse_layers(config), config.num_hidden_layers),
            (None, "batch", None, None)),
        record_routing=return_routing, context=context,
    )
    if core.num_redundant_experts and expert_placement is None:
        expert_placement = identity_placement(len(family.sparse_layers(config)), config.num_experts,
                                              num_redundant_experts=core.num_redundant_experts, ep_size=core.ep_size)
    nested = nested_weights(core, params, adapter, expert_placement if core.num_redundant_experts else None)
    mtp = {}
    if core.layer_stack.pipeline is not None:
        aux_sums = family.has_router_aux_loss and bool(family.sparse_layers(config))
        hidden, sums, total, cache, expert_load = pipeline_hidden(
            family, config, core.layer_stack.pipeline, core.microbatches, nested, input_ids, attention_mask,
            positions, step, aux_sums)
        # Each layer's routing stays in its stage: no router logits; the aux loss comes from sums.
        router_logits = []
        aux_loss = (load_balancing_from_sums(*sums, config.num_experts) if aux_sums
                    else jnp.zeros((), jnp.float32))
    else:
        hidden, router_logits, statistics, cache = decoder_hidden(family, config, core.layer_stack.runs, nested,
                                                                  input_ids, attention_mask, positions, step,
                                                                  final_norm=final_norm and not return_mtp_logits)
        total = DispatchStatistics.zeros()
        if return_mtp_logits:   # the MTP layers read the last hidden states before the final norm
            stacked, mtp_statistics = mtp_forward(
                family, config, nested["model"], hidden, input_ids,
                rope_tables(family, config, positions, hidden.dtype), attention_mask, step, core.mtp_layers,
                logits=not return_hidden)
            mtp = {"mtp_hidden_states" if return_hidden else "mtp_logits": stacked}
            hidden = rms_norm(nested["model"]["norm"], hidden, config.rms_norm_eps)
            for layer_statistics in mtp_statistics:
                total = total.combine(layer_statistics)
        for layer_statistics in statistics:
            total = total.combine(layer_statistics)
        loads = [layer_statistics.expert_load for layer_statistics in statistics]
        expert_load = jnp.stack(loads) if loads and all(load is not None for load in loads) else None
        if core.num_redundant_experts:
            ep_rank_load = jnp.stack([layer_statistics.ep_rank_load for layer_statistics in statistics])
        aux_loss = load_balancing_loss(
            router_logits or None, config.num_experts, config.num_experts_per_tok, attention_mask,
            per_token=layouts.token_local,
        ) if family.has_router_aux_loss else jnp.zeros((), jnp.float32)
    if not core.num_redundant_experts:
        # Slot s of the plain layout is expert s, rank r holds E / ep of them in order.
        ep_rank_load = None if core.ep_size == 1 or expert_load is None else expert_load.reshape(
            expert_load.shape[0], core.ep_size, -1).sum(-1).astype(jnp.int32)
    if return_routing:
        mtp["routing"] = recorded([layer_statistics.routing for layer_statistics in statistics], batch)
    if core.context is not None:
        hidden, router_logits, mtp = natural_order(core.context, hidden, router_logits, mtp, batch, keep_hidden=context_order)
    if return_hidden:
        return ModelOutput(None, hidden, router_logits, aux_loss, total, cache, expert_load, ep_rank_load, **mtp)
    # The logits stay where the head's dot computes them: split over tp where tp splits the head's vocab rows,
    # colwise_gather_output included. A global jax.Array is whole to whoever reads it (np.asarray, an op inside
    # jit gathers what it needs); gathering [B, S, V] onto every device made XLA gather the weight instead and
    # run the whole dot on each: slower on tp layouts (docs/benchmarks.md, "Against the reference").
    logits = layouts.constrain(head_logits(config, nested, hidden), ("batch", "length", "head_rows"))
    return ModelOutput(logits, None, router_logits, aux_loss, total, cache, expert_load, ep_rank_load, **mtp)


def check_context_step(core: ModelCore, cache, return_mtp_logits: bool) -> None:
    """Why a step cannot run under context parallelism (ValueError), if it cannot."""
    if cache is not None:
        raise ValueError(f"cp_size={core.context.size}: a KV cache's steps (generate, serving) do not split the "
                         "sequence over cp; generate or serve with a layout without cp (cp_size=1), e.g. the same "
                         "devices as fsdp or tp.")
    if return_mtp_logits:
        raise ValueError(f"cp_size={core.context.size}: the MTP layers read each position's next token along the "
                         "whole sequence, which cp splits; train the MTP loss with cp_size=1.")


def natural_order(context: ContextLayout, hidden, router_logits: list, extras: dict, batch: int, *, keep_hidden: bool):
    """A context-ordered step's outputs back in the natural order: hidden [B, S, ...] (unless `keep_hidden`),
    router logits [B*S, E] per layer, routing [B, L, S, K]."""
    def rows(logits):
        return context.to_natural_order(logits.reshape(batch, -1, logits.shape[-1])).reshape(logits.shape)

    if "routing" in extras:
        extras = {**extras, "routing": context.to_natural_order(extras["routing"], axis=2)}
    return (hidden if keep_hidden else context.to_natural_order(hidden)), [rows(x) for x in router_logits], extras


def check_mtp_step(core: ModelCore, cache) -> None:
    """Why a step cannot return MTP logits (ValueError), if it cannot."""
    if not core.mtp_layers:
        raise ValueError("return_mtp_logits=True needs multi-token-prediction layers, which this model does not hold: "
                         "load a checkpoint that has them (DeepSeek-V3's model.layers.{num_hidden_layers}.*), or "
                         "build the model with mtp_layers=N.")
    if cache is not None or core.layer_stack.pipeline is not None:
        raise ValueError("return_mtp_logits=True runs the MTP layers over the whole sequence: not with a KV cache "
                         "nor with pipeline stages (pp_size > 1).")


def final_normed(core: ModelCore, params: dict, hidden):
    """params: nested; hidden: [B, S, H] before the final norm (`step_math(..., final_norm=False)`) -> after it."""
    return rms_norm(params["model"]["norm"], hidden, core.config.rms_norm_eps)


def mtp_cache_step(core: ModelCore, params: Mapping[str, Any], hidden, next_ids, *, cache, attention_mask,
                   adapter: Mapping[str, Any] | None = None):
    """The first MTP layer at a step's positions, with its own paged cache (drafting, `inference.speculative`).

    hidden: [B, S, H] the main model's last hidden states before its final norm at these positions (or this
    layer's own output, drafting further ahead); next_ids: [B, S] the token after each position; attention_mask:
    [B, S] the real positions (only theirs are stored); cache: a `PagedKVCache` whose pools are the MTP layer's, as
    one run keyed "mtp" ([G, 1, pages, P, K, D]) -> (its hidden states [B, S, H], logits [B, S, V], the cache with
    these positions stored). Its MoE block runs the plain expert placement."""
    family, config = core.family, core.config
    positions = cache.next_index + jnp.arange(next_ids.shape[1], dtype=jnp.int32)[None, :]
    step = StepOptions(sharded_experts=core.sharded_experts, capacity=None, inference=True, rng=None, remat="none",
                       layouts=core.layouts, cache=cache, attention=attention_for_device(core.device))
    layer = config.num_hidden_layers
    weights = nested_weights(core, params, adapter)["model"]["layers"][str(layer)]
    cache_step = cache.begin(attention_mask)
    rope = rope_tables(family, config, positions, hidden.dtype)
    out = mtp_step(family, config, weights, layer, hidden, next_ids, rope, attention_mask, step,
                   layer_cache=cache_step.arrays("mtp"), kv_view=cache_step.view("mtp"))
    return out.hidden, out.logits, cache_step.finish({"mtp": out.cache})
