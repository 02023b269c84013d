"""The decoder every family here shares, written once; a family file fills in what differs.

    x = embed(ids)
    for each layer:  x += attention(rms_norm(x), **attention_options(layer))
                     x += moe_output(...)  if the layer is sparse, else mlp(rms_norm(x))
    logits = lm_head(rms_norm(x))

Hooks a family overrides: `attention_options(layer)` (q/k norm kind, window, clip), `declare_attention`
(bias flags, q/k norm shapes), `self_attention` and `cache_heads` (another attention: DeepSeek's MLA,
Llama 4's), `declare_sparse_mlp` (module order as HF lists it), `moe_output` (shared experts, router
jitter), `route`, `is_sparse`, `experts_intermediate_size`, `dense_intermediate_size`; class attributes
`feed_forward_module` and `dense_activation_module` name HF's modules.

Each run of identical layers (`LayerStack`) is one `jax.lax.scan` over its stacked parameters; single
layers run unrolled. Every layer is wrapped in `jax.checkpoint` with the model's remat policy.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..distributed.activations import LogicalAxisRules, logical_axis_rules
from ..module_tree import ModuleTree
from ..nn.activations import get_activation
from ..nn.attention import attention, cached_attention
from ..nn.embedding import embed
from ..nn.linear import linear
from ..nn.mlp import mlp
from ..nn.moe import sparse_moe_block
from ..nn.norms import rms_norm
from ..nn.rotary import rope_inverse_frequencies, rope_parameters_from_config, rotary_cos_sin
from ..ops.experts import swiglu_experts
from .base import MoeForCausalLM
from .kv_cache import KVCache
from .layer_stack import LayerRun
from .step_options import REMAT_POLICIES, StepOptions

# Every family here shards its experts the same way under EP (HF's base_model_ep_plan of each config).
EXPERTS_EP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}


class MoeDecoderForCausalLM(MoeForCausalLM):
    """A pre-norm decoder with RoPE attention, sparse MoE and dense MLP layers (Qwen/OLMoE/Mixtral)."""

    base_model_ep_plan = EXPERTS_EP_PLAN
    dense_activation_module = "act_fn"  # the dense MLP's activation module (HF name; Llama 4: "activation_fn")
    # RoPE's cos/sin in the activations' dtype, as HF's rotary embeddings return them (None); Llama 4's reference
    # keeps its complex freqs_cis in float32.
    rope_dtype: ClassVar[jnp.dtype | None] = None
    # The logical axis of the output features of each module whose output the layer code constrains by it
    # (keys as in `base_model_tp_plan`): the plan's rules for these modules set the axis' mesh axes.
    base_model_output_axes: ClassVar[dict[str, str]] = {
        "layers.*.self_attn.q_proj": "heads",
        "layers.*.self_attn.k_proj": "kv_heads",
        "layers.*.self_attn.v_proj": "kv_heads",
        "layers.*.mlp.gate_proj": "mlp",
        "layers.*.mlp.up_proj": "mlp",
        "layers.*.mlp.gate": "experts",
    }

    # ---- structure ---------------------------------------------------------------------------------
    def is_sparse(self, layer: int) -> bool:
        return True

    def sparse_layers(self) -> list[int]:
        return [layer for layer in range(self.config.num_hidden_layers) if self.is_sparse(layer)]

    @property
    def experts_intermediate_size(self) -> int:
        return self.config.moe_intermediate_size

    @property
    def dense_intermediate_size(self) -> int:
        """Width of the dense (non-MoE) layers' MLP."""
        return self.config.intermediate_size

    def declare_attention(self, tree: ModuleTree, bias: bool = False) -> None:
        """q/k/v/o projections (with `bias` on all four); families add q/k norms or sinks."""
        c, hidden = self.config, self.config.hidden_size
        tree.linear("q_proj", c.num_attention_heads * c.head_dim, hidden, bias)
        tree.linear("k_proj", c.num_key_value_heads * c.head_dim, hidden, bias)
        tree.linear("v_proj", c.num_key_value_heads * c.head_dim, hidden, bias)
        tree.linear("o_proj", hidden, c.num_attention_heads * c.head_dim, bias)

    def declare_router(self, tree: ModuleTree) -> None:
        tree.linear("gate", self.config.num_experts, self.config.hidden_size)

    def declare_experts(self, tree: ModuleTree) -> None:
        c = self.config
        with tree.module("experts"):
            tree.param("gate_up_proj", (c.num_experts, 2 * self.experts_intermediate_size, c.hidden_size))
            tree.param("down_proj", (c.num_experts, c.hidden_size, self.experts_intermediate_size))
            tree.module_without_params("act_fn")

    def declare_dense_mlp(self, tree: ModuleTree, intermediate: int) -> None:
        hidden = self.config.hidden_size
        tree.linear("gate_proj", intermediate, hidden)
        tree.linear("up_proj", intermediate, hidden)
        tree.linear("down_proj", hidden, intermediate)
        tree.module_without_params(self.dense_activation_module)

    def declare_sparse_mlp(self, tree: ModuleTree) -> None:
        """The MoE block's modules in the order HF lists them (router first by default)."""
        self.declare_router(tree)
        self.declare_experts(tree)

    def declare_tree(self) -> ModuleTree:
        c = self.config
        tree = ModuleTree()
        with tree.module("model"):
            with tree.module("embed_tokens"):
                tree.param("weight", (c.vocab_size, c.hidden_size))
            with tree.module("layers"):
                for layer in range(c.num_hidden_layers):
                    with tree.module(layer):
                        with tree.module("self_attn"):
                            self.declare_attention(tree)
                        with tree.module(self.feed_forward_module):
                            if self.is_sparse(layer):
                                self.declare_sparse_mlp(tree)
                            else:
                                self.declare_dense_mlp(tree, self.dense_intermediate_size)
                        tree.norm("input_layernorm", c.hidden_size)
                        tree.norm("post_attention_layernorm", c.hidden_size)
            tree.norm("norm", c.hidden_size)
            tree.module_without_params("rotary_emb")
        with tree.module("lm_head"):
            if not c.tie_word_embeddings:
                tree.param("weight", (c.vocab_size, c.hidden_size))
        return tree

    @property
    def logical_axis_rules(self) -> LogicalAxisRules:
        """The logical axes' mesh axes on this model's layout, from its resolved TP plan: the output axis of
        each module in `base_model_output_axes` (and the head's, `vocab`) that this model has."""
        prefix, present = self.base_model_prefix, self.plan_names()
        output_axes = {f"{prefix}.{module}": axis for module, axis in self.base_model_output_axes.items()}
        output_axes["lm_head"] = "vocab"
        return logical_axis_rules(self.layout, self.resolved_plans.tp,
                                  {module: axis for module, axis in output_axes.items() if module in present})

    def layer_signature(self, layer: int) -> tuple:
        return self.is_sparse(layer), tuple(sorted(self.attention_options(layer).items()))

    # ---- math --------------------------------------------------------------------------------------
    @property
    def experts_forward(self):
        return partial(swiglu_experts, act=get_activation(self.config.hidden_act), backend=self.experts_backend)

    def attention_options(self, layer: int) -> dict:
        """Keyword arguments of `moe_jax.nn.attention.attention` for this layer (besides shapes)."""
        return {}

    def moe_output(self, weights: dict, hidden, run_experts, *, inference: bool, rng, constrain, route):
        """hidden: [B, S, H] -> (output [B, S, H], router_logits [B*S, E], dispatch statistics).
        `rng`: this layer's key for training-time randomness (or None); `constrain`: lays out activations by
        their logical axes;
        `route`: the family's router, run where the tokens are."""
        return sparse_moe_block(weights, hidden, route=route, run_experts=run_experts, constrain=constrain)

    def self_attention(self, weights: dict, h, layer: int, rope: tuple, attention_mask, step: StepOptions,
                       layer_cache: tuple | None, layer_run_key: str | None):
        """The attention module: h [B, S, H] (normed) -> (output [B, S, H], layer cache with the new tokens
        stored, or None without a cache). Arguments as `decoder_layer`'s."""
        c = self.config
        cos, sin = rope
        options = dict(
            num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps, constrain=step.layouts.constrain, **self.attention_options(layer),
        )
        if layer_cache is None:
            return attention(weights, h, cos, sin, attention_mask=attention_mask, **options), None
        ring = layer_run_key is not None and layer_run_key in step.cache.window_masks
        attended, keys, values = cached_attention(
            weights, h, cos, sin, *layer_cache, slot=None if ring else step.cache.length, key_mask=attention_mask,
            **options,
        )
        return attended, (keys, values)

    def cache_heads(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of what one layer's cache stores per token: its keys', then its values'."""
        c = self.config
        return (c.num_key_value_heads, c.head_dim), (c.num_key_value_heads, c.head_dim)

    def decoder_layer(self, weights: dict, x, layer: int, layer_index, rope: tuple, attention_mask,
                      step: StepOptions, layer_cache: tuple | None = None, layer_run_key: str | None = None):
        """One layer: x [B, S, H] -> (x, router logits [B*S, E] or None, statistics or None, layer cache).

        `layer` is static (options, experts module: the same for every layer of a scanned run);
        `layer_index` is the layer's number, traced inside a scan (per-layer randomness). With a cache,
        `layer_cache` is this layer's (keys, values) [B, T, K, D], `layer_run_key` its run's cache key, and
        `attention_mask` the keys' mask (`cached_attention`); the new tokens' keys and values come back
        stored in it (None without a cache)."""
        c, layouts = self.config, step.layouts
        h = rms_norm(weights["input_layernorm"], x, c.rms_norm_eps)
        attended, layer_cache = self.self_attention(weights["self_attn"], h, layer, rope, attention_mask, step,
                                                    layer_cache, layer_run_key)
        x = x + attended
        h = rms_norm(weights["post_attention_layernorm"], x, c.rms_norm_eps)
        router_logits = statistics = None
        feed_forward = self.feed_forward_module
        if self.is_sparse(layer):
            out, router_logits, statistics = self.moe_output(
                weights[feed_forward], h, step.run_experts[layer], inference=step.inference,
                rng=step.layer_rng(layer_index), constrain=layouts.constrain,
                route=layouts.token_local(self.route),
            )
        else:
            out = mlp(weights[feed_forward], h, c.hidden_act, constrain=layouts.constrain)
        x = layouts.constrain(x + out, ("batch", "length", "embed"))
        return x, router_logits, statistics, layer_cache

    def _run_layers(self, run: LayerRun, weights: dict, x, rope, attention_mask, step: StepOptions,
                    run_cache: tuple | None):
        """The layers of `run` on x [B, S, H] -> (x, router logits per sparse layer, statistics per layer,
        the run's cache (keys, values) [L, B, T, K, D] with the new tokens written, or None)."""
        layer_fn = partial(self.decoder_layer, layer=run.start, rope=rope, attention_mask=attention_mask, step=step,
                           layer_run_key=run.key)
        policy = REMAT_POLICIES[step.remat]
        if step.remat != "none":
            layer_fn = jax.checkpoint(layer_fn, policy=policy)
        if not run.scanned:
            layer_cache = None if run_cache is None else tuple(array[0] for array in run_cache)
            x, logits, statistics, layer_cache = layer_fn(weights, x, layer_index=run.start, layer_cache=layer_cache)
            run_cache = None if layer_cache is None else tuple(array[None] for array in layer_cache)
            return (x, [logits] if logits is not None else [], [statistics] if statistics is not None else [],
                    run_cache)

        def body(carry, inputs):
            layer_weights, index, layer_cache = inputs
            carry, logits, statistics, layer_cache = layer_fn(layer_weights, carry, layer_index=index,
                                                              layer_cache=layer_cache)
            return carry, (logits, statistics, layer_cache)

        x, (logits, statistics, run_cache) = jax.lax.scan(
            body, x, (weights, jnp.arange(run.start, run.stop), run_cache)
        )
        if logits is None:
            return x, [], [], run_cache
        count = run.stop - run.start
        per_layer = [jax.tree.map(lambda leaf, i=i: leaf[i], statistics) for i in range(count)]
        return x, [logits[i] for i in range(count)], per_layer, run_cache

    def forward_math(self, params, input_ids, attention_mask, positions, step: StepOptions):
        """input_ids, attention_mask, positions: [B, S] -> (hidden [B, S, H] after the final norm, router
        logits [B*S, E] per sparse layer, dispatch statistics per sparse layer, the updated `step.cache`
        (None without one))."""
        c = self.config
        model = params["model"]
        x = embed(model["embed_tokens"], input_ids)
        if step.compute_dtype is not None:
            x = x.astype(step.compute_dtype)  # rows gathered from the masters: their gradient stays float32
        x = step.layouts.constrain(x, ("batch", "length", "embed"))
        inv_freq, scaling = rope_inverse_frequencies(rope_parameters_from_config(c.to_dict()))
        rope = rotary_cos_sin(positions, inv_freq, scaling, dtype=self.rope_dtype or x.dtype)
        cache = step.cache
        key_mask = attention_mask
        if cache is not None:
            key_mask = jax.lax.dynamic_update_slice(cache.key_mask, attention_mask.astype(cache.key_mask.dtype),
                                                    (0, cache.length))
        router_logits, statistics, keys, values, window_masks = [], [], {}, {}, {}
        for run in self.layer_stack.runs:
            run_cache, run_mask = None, key_mask
            if cache is not None:
                run_cache = (cache.keys[run.key], cache.values[run.key])
                if run.key in cache.window_masks:  # a window ring: its mask, then the new tokens'
                    ring = cache.window_masks[run.key]
                    run_mask = jnp.concatenate([ring, attention_mask.astype(ring.dtype)], axis=1)
                    window_masks[run.key] = run_mask[:, -ring.shape[1]:]
            x, run_logits, run_statistics, run_cache = self._run_layers(
                run, model["layers"][run.key], x, rope, run_mask, step, run_cache
            )
            router_logits += run_logits
            statistics += run_statistics
            if run_cache is not None:
                keys[run.key], values[run.key] = run_cache
        if cache is not None:
            cache = KVCache(keys=keys, values=values, key_mask=key_mask, length=cache.length + input_ids.shape[1],
                            window_masks=window_masks)
        return rms_norm(model["norm"], x, c.rms_norm_eps), router_logits, statistics, cache

    def head_logits(self, params, hidden):
        head = params["lm_head"] if not self.config.tie_word_embeddings else params["model"]["embed_tokens"]
        return linear(head, hidden)
