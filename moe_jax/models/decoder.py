"""The decoder every family shares, as free functions over a params pytree; a `Family` says what differs.

    x = embed(ids)
    for each layer:  x += family.self_attention(rms_norm(x), family.attention_options(layer))
                     x += family.moe_block(rms_norm(x))  if family.is_sparse(layer), else mlp(rms_norm(x))
    logits = lm_head(rms_norm(x))

Each run of identical layers (`LayerStack`) is one `jax.lax.scan` over its stacked parameters; single layers run
unrolled. Every layer is wrapped in `jax.checkpoint` with the step's remat policy.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ..module_tree import ModuleTree
from ..nn.embedding import embed
from ..nn.linear import linear
from ..nn.mlp import mlp
from ..nn.norms import rms_norm
from ..nn.rotary import rope_inverse_frequencies, rope_parameters_from_config, rotary_cos_sin
from ..ops.routing import expert_load
from .family import Family, declare_dense_mlp
from .layer_stack import LayerRun
from .mtp import declare_mtp_layer, mtp_layer_indices
from .step_options import REMAT_POLICIES, StepOptions


def declare_tree(family: Family, config, mtp_layers: int = 0) -> ModuleTree:
    """Every module and parameter of the causal LM, with HF's names, in the order PyTorch lists them; with
    `mtp_layers`, that many multi-token-prediction layers after the decoder layers (`models.mtp`)."""
    c, tree = config, ModuleTree()
    with tree.module("model"):
        with tree.module("embed_tokens"):
            tree.param("weight", (c.vocab_size, c.hidden_size))
        with tree.module("layers"):
            for layer in range(c.num_hidden_layers):
                with tree.module(layer):
                    declare_block(tree, family, c, layer)
            for layer in mtp_layer_indices(c, mtp_layers):
                with tree.module(layer):
                    declare_mtp_layer(tree, c)
                    declare_block(tree, family, c, layer)
        tree.norm("norm", c.hidden_size)
        tree.module_without_params("rotary_emb")
    with tree.module("lm_head"):
        if not c.tie_word_embeddings:
            tree.param("weight", (c.vocab_size, c.hidden_size))
    if family.declare_storage is not None:
        family.declare_storage(tree, c)
    return tree


def declare_block(tree: ModuleTree, family: Family, config, layer: int) -> None:
    """A decoder block's modules (inside its `model.layers.{layer}` module): attention, MLP or MoE, norms."""
    with tree.module("self_attn"):
        family.declare_attention(tree, config, layer)
    with tree.module(family.feed_forward_module):
        if family.is_sparse(config, layer):
            family.declare_sparse_mlp(tree, config, family.experts_intermediate_size(config))
        else:
            declare_dense_mlp(tree, config, family.dense_intermediate_size(config), family.dense_activation_module)
    tree.norm("input_layernorm", config.hidden_size)
    tree.norm("post_attention_layernorm", config.hidden_size)


def decoder_layer(family: Family, config, weights: dict, x, layer: int, layer_index, rope: tuple, attention_mask,
                  step: StepOptions, layer_cache: tuple | None = None, kv_view=None, cache_row=None,
                  layer_routing=None):
    """One layer: x [B, S, H] -> (x, router logits [B*S, E] or None, statistics or None, layer cache).
    layer_routing: [B, S, K] expert ids to replay in a sparse layer (`ops.routing`; rows of -1 route), or None.

    `layer` is static (options, experts module: the same for every layer of a scanned run); `layer_index` is the
    layer's number, traced inside a scan (per-layer randomness). With a cache, `layer_cache` is the stored
    (keys, values) and `kv_view(layer_cache, cache_row)` makes this layer's storage (`moe_jax.kv_cache`) from them,
    which also says what each query sees; the arrays come back with the new tokens stored (None without a
    cache)."""
    layouts = step.layouts
    h = rms_norm(weights["input_layernorm"], x, config.rms_norm_eps)
    layer_kv = None if layer_cache is None else kv_view(layer_cache, cache_row)
    attended, layer_cache = family.self_attention(config, weights["self_attn"], h,
                                                  family.attention_options(config, layer), rope, attention_mask,
                                                  step, layer_kv)
    x = x + attended
    h = rms_norm(weights["post_attention_layernorm"], x, config.rms_norm_eps)
    router_logits = statistics = None
    feed_forward = weights[family.feed_forward_module]
    if family.is_sparse(config, layer):
        out, router_logits, statistics = family.moe_block(
            config, feed_forward, h, _counting_load(step.layer_experts(layer), attention_mask, config.num_experts,
                                                    step.record_routing),
            inference=step.inference,
            rng=step.layer_rng(layer_index), constrain=layouts.constrain,
            route=_route(family, config, layouts, layer_routing),
        )
    else:
        out = mlp(feed_forward, h, config.hidden_act, constrain=layouts.constrain)
    x = layouts.constrain(x + out, ("batch", "sequence", "embed"))
    return x, router_logits, statistics, layer_cache


def _route(family: Family, config, layouts, replay):
    """The layer's router, run where the tokens are: `(router_logits [N, E], *extra) -> (weights, ids)`, with
    replay [B, S, K] (recorded ids, or None) handed to the family's `route` beside its own rows."""
    if replay is None:
        return layouts.token_local(partial(family.route, config))
    local = layouts.token_local(lambda logits, ids, *extra: family.route(config, logits, *extra, replay=ids))
    return lambda logits, *extra: local(logits, replay.reshape(-1, replay.shape[-1]), *extra)


def _counting_load(layer_experts, attention_mask, num_experts: int, record_routing: bool = False):
    """`layer_experts` whose statistics also carry the layer's `expert_load` over the real tokens (and, with
    redundant expert slots, its `ep_rank_load` over them: the experts module counts that, told which are real),
    and with `record_routing` the expert ids it ran ([N, K], logical ids whatever the placement)."""
    def run(tokens, top_k_index, top_k_weights, params):
        mask = attention_mask.reshape(-1)
        real = mask if mask.shape[0] == tokens.shape[0] else jnp.ones(tokens.shape[:1], jnp.int32)
        output, statistics = layer_experts(tokens, top_k_index, top_k_weights, params, token_mask=real)
        statistics = statistics.with_expert_load(expert_load(top_k_index, real, num_experts))
        return output, statistics.with_routing(top_k_index.astype(jnp.int32)) if record_routing else statistics
    return run


def run_layers(family: Family, config, run: LayerRun, weights: dict, x, rope, attention_mask, step: StepOptions,
               run_cache: tuple | None, kv_view=None):
    """The layers of `run` on x [B, S, H] -> (x, router logits per sparse layer, statistics per layer, the run's
    cache (keys, values) [L, ...] with the new tokens written, or None). kv_view: as `decoder_layer`'s; the cache
    rides through the scan whole (in the carry), so each layer's write updates it in place."""
    layer_fn = partial(decoder_layer, family, config, layer=run.start, rope=rope, attention_mask=attention_mask,
                       step=step, kv_view=kv_view)
    if step.remat != "none":
        layer_fn = jax.checkpoint(layer_fn, policy=REMAT_POLICIES[step.remat])
    # Replayed routing: the run's rows of `step.routing` (every layer's), sliced with the weights in a scan.
    routing = (step.routing[run.start:run.stop] if step.routing is not None and family.is_sparse(config, run.start)
               else None)
    if not run.scanned:
        x, logits, statistics, run_cache = layer_fn(weights, x, layer_index=run.start, layer_cache=run_cache,
                                                    cache_row=0, layer_routing=None if routing is None else routing[0])
        return x, [logits] if logits is not None else [], [statistics] if statistics is not None else [], run_cache

    def body(carry, inputs):
        carry, run_cache = carry
        layer_weights, index, layer_routing = inputs
        carry, logits, statistics, run_cache = layer_fn(layer_weights, carry, layer_index=index,
                                                        layer_cache=run_cache, cache_row=index - run.start,
                                                        layer_routing=layer_routing)
        return (carry, run_cache), (logits, statistics)

    (x, run_cache), (logits, statistics) = jax.lax.scan(body, (x, run_cache),
                                                        (weights, jnp.arange(run.start, run.stop), routing))
    if logits is None:
        return x, [], [], run_cache
    count = run.stop - run.start
    per_layer = [jax.tree.map(lambda leaf, i=i: leaf[i], statistics) for i in range(count)]
    return x, [logits[i] for i in range(count)], per_layer, run_cache


def embedded_inputs(family: Family, config, model: dict, input_ids, positions, step: StepOptions):
    """input_ids, positions: [B, S] -> (x [B, S, H] embedded, rope (cos, sin) [B, S, D]); model: params["model"]."""
    x = embed(model["embed_tokens"], input_ids)
    if step.compute_dtype is not None:
        x = x.astype(step.compute_dtype)  # rows gathered from the masters: their gradient stays float32
    x = step.layouts.constrain(x, ("batch", "sequence", "embed"))
    return x, rope_tables(family, config, positions, x.dtype)


def rope_tables(family: Family, config, positions, dtype) -> tuple:
    """positions: [B, S] -> RoPE's (cos, sin) [B, S, D] in the family's rope dtype, else `dtype`."""
    inv_freq, scaling = rope_inverse_frequencies(rope_parameters_from_config(config.to_dict()))
    return rotary_cos_sin(positions, inv_freq, scaling, dtype=family.rope_dtype or dtype)


def decoder_hidden(family: Family, config, runs: tuple[LayerRun, ...], params, input_ids, attention_mask, positions,
                   step: StepOptions, final_norm: bool = True):
    """input_ids, attention_mask, positions: [B, S] -> (hidden [B, S, H] after the final norm (before it with
    `final_norm=False`: what the MTP layers read), router logits
    [B*S, E] per sparse layer, dispatch statistics per sparse layer, the updated `step.cache` (None without one)).

    params: nested by module (`LayerStack.nest`: each run's layers under `model.layers.<run key>`)."""
    model = params["model"]
    x, rope = embedded_inputs(family, config, model, input_ids, positions, step)
    cache_step = None if step.cache is None else step.cache.begin(attention_mask)
    router_logits, statistics, stored = [], [], {}
    for run in runs:
        run_cache = kv_view = None
        if cache_step is not None:
            run_cache, kv_view = cache_step.arrays(run.key), cache_step.view(run.key)
        x, run_logits, run_statistics, run_cache = run_layers(family, config, run, model["layers"][run.key], x, rope,
                                                              attention_mask, step, run_cache, kv_view)
        router_logits += run_logits
        statistics += run_statistics
        if run_cache is not None:
            stored[run.key] = run_cache
    cache = None if cache_step is None else cache_step.finish(stored)
    hidden = rms_norm(model["norm"], x, config.rms_norm_eps) if final_norm else x
    return hidden, router_logits, statistics, cache


def head_logits(config, params, hidden):
    """hidden: [B, S, H] after the final norm -> logits [B, S, V] (the tied embeddings when the config says)."""
    head = params["model"]["embed_tokens"] if config.tie_word_embeddings else params["lm_head"]
    return linear(head, hidden)
