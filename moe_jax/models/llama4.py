"""Llama 4, text model (HF `llama4_text`, `Llama4ForCausalLM`): config, module tree with HF names, plans, math.

    layer i:  x += attention(rms_norm(x))      RoPE layers (no_rope_layers[i] == 1): complex RoPE on pairs,
                                               then L2 q/k norm (use_qk_norm), chunked attention mask
                                               (attention_chunk_size); NoPE layers: no RoPE, no norm, full
                                               causal mask, queries scaled by the temperature
                                               log1p(floor((t + 1) / floor_scale)) * attn_scale + 1 at cache
                                               index t (attn_temperature_tuning)
              x += feed_forward(rms_norm(x))   MoE if i in moe_layers (every interleave_moe_layer_step-th),
                                               else a dense MLP of intermediate_size_mlp
    moe(h):   shared_expert(h) + sum_k expert_k(sigmoid(logit_k) * h)    over the top-k router logits
    experts:  gate_up_proj [E, H, 2I] (gate then up on the last dim), down_proj [E, I, H]

The reference runs every expert on every token, the unchosen ones on zero inputs; only the chosen experts
are computed here (`ops.experts.prescaled_swiglu_experts`), the same sum. The reference has no EP plan (the
experts shard by TP: `packed_rowwise` / `colwise` / `moe_tp_experts`), so `ep_size > 1` raises its "has no
`ep_plan`" error.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import ClassVar

import jax
import jax.numpy as jnp

from ..module_tree import ModuleTree
from ..nn.activations import get_activation
from ..nn.attention import project_qkv
from ..nn.attention_core import attend, segment_starts
from ..nn.context_attention import chunk_origins
from ..nn.linear import linear
from ..nn.mlp import mlp
from ..nn.moe import sparse_moe_block
from ..nn.norms import l2_norm
from ..nn.rotary import rotate_pairs
from ..ops.experts import prescaled_swiglu_experts
from ..ops.routing import top_k_sigmoid
from .config import HFConfigMixin
from .family import ROPE_ATTENTION_OUTPUT_AXES, Family, declare_attention, declare_dense_mlp, register_family

LAYER_TYPES = ("chunked_attention", "full_attention")


@dataclass(frozen=True)
class Llama4TextConfig(HFConfigMixin):
    """The fields of HF's `Llama4TextConfig` the model reads (defaults are HF's), completed as its
    `__post_init__` does: `no_rope_layers` (1 = RoPE) every `no_rope_layer_interval`-th layer NoPE,
    `moe_layers` from `interleave_moe_layer_step`, `layer_types` chunked for RoPE layers, full for NoPE ones."""

    vocab_size: int = 202048
    hidden_size: int = 5120
    intermediate_size: int = 8192
    intermediate_size_mlp: int = 16384
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_experts_per_tok: int = 1
    num_local_experts: int = 16
    moe_layers: tuple[int, ...] | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    rope_parameters: dict | None = None
    no_rope_layers: tuple[int, ...] | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    layer_types: tuple[str, ...] | None = None
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    attention_bias: bool = False
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    model_type: ClassVar[str] = "llama4_text"

    def __post_init__(self):
        set_field = partial(object.__setattr__, self)
        layers = self.num_hidden_layers
        if self.num_key_value_heads is None:
            set_field("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_field("head_dim", self.hidden_size // self.num_attention_heads)
        if not self.no_rope_layers:
            set_field("no_rope_layers", tuple(int((i + 1) % self.no_rope_layer_interval != 0) for i in range(layers)))
        if self.moe_layers is None:
            step = self.interleave_moe_layer_step
            set_field("moe_layers", tuple(range(step - 1, layers, step)))
        if self.layer_types is None:
            set_field("layer_types", tuple("chunked_attention" if rope else "full_attention"
                                           for rope in self.no_rope_layers))
        if len(self.no_rope_layers) < layers or len(self.layer_types) != layers:
            raise ValueError(f"no_rope_layers ({len(self.no_rope_layers)}) needs an entry per layer and layer_types "
                             f"({len(self.layer_types)}) exactly one, for the {layers} layers.")
        if unknown := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"layer_types contains {unknown}; Llama 4 layers are one of {LAYER_TYPES}.")

    @property
    def num_experts(self) -> int:
        return self.num_local_experts

    def uses_rope(self, layer: int) -> bool:
        return bool(self.no_rope_layers[layer])


def declare_rope_attention(tree: ModuleTree, config: Llama4TextConfig, layer: int) -> None:
    """q/k/v/o (bias per attention_bias); HF lists a parameter-free `qk_norm` module on RoPE layers (use_qk_norm)."""
    declare_attention(tree, config, layer, bias=config.attention_bias)
    if config.use_qk_norm and config.uses_rope(layer):
        tree.module_without_params("qk_norm")


def declare_sparse_mlp(tree: ModuleTree, config: Llama4TextConfig, intermediate: int) -> None:
    """Experts [E, H, 2I] / [E, I, H] (in x out), the router, the shared expert."""
    with tree.module("experts"):
        tree.param("gate_up_proj", (config.num_experts, config.hidden_size, 2 * intermediate))
        tree.param("down_proj", (config.num_experts, intermediate, config.hidden_size))
        tree.module_without_params("act_fn")
    tree.linear("router", config.num_experts, config.hidden_size)
    with tree.module("shared_expert"):
        declare_dense_mlp(tree, config, config.intermediate_size, "activation_fn")


def attention_options(config: Llama4TextConfig, layer: int) -> dict:
    chunked = config.layer_types[layer] == "chunked_attention"
    return {"rope": config.uses_rope(layer), "attention_chunk_size": config.attention_chunk_size if chunked else None}


def experts_forward(config: Llama4TextConfig, backend: str | None):
    return partial(prescaled_swiglu_experts, act=get_activation(config.hidden_act), backend=backend)


def temperature(config: Llama4TextConfig, first: jax.Array, length: int) -> jax.Array:
    """The NoPE layers' query scale at cache indices first .. first + length - 1: [length] float32, or [B, length]
    when `first` is [B, 1] (each row its own index) or [B, length] (each token its own offset: packed rows)."""
    index = (first + jnp.arange(length)).astype(jnp.float32)
    return jnp.log1p(jnp.floor((index + 1.0) / config.floor_scale)) * config.attn_scale + 1.0


def self_attention(config: Llama4TextConfig, weights, h, options, rope, attention_mask, step, layer_kv):
    """RoPE layers: complex RoPE on pairs, L2 q/k norm, chunked mask; NoPE layers: temperature-scaled queries."""
    c, (cos, sin) = config, rope
    constrain = step.layouts.constrain
    q, k, v = project_qkv(weights, h, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                          head_dim=c.head_dim, constrain=constrain)
    if options["rope"]:
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        if c.use_qk_norm:
            q, k = l2_norm(q, c.rms_norm_eps), l2_norm(k, c.rms_norm_eps)
    if c.attn_temperature_tuning and not options["rope"]:
        first = 0 if layer_kv is None else layer_kv.first_index
        if step.segment_ids is not None:   # packed rows: each document's tokens count from its own start
            first = -segment_starts(step.segment_ids)
        if step.context is not None:       # the context order: each token's own index (in its document)
            index = step.context.index(h.shape[1])
            first = index - jnp.arange(h.shape[1])
            if step.segment_ids is not None:
                first = first - chunk_origins(index, step.segment_ids > 0, step.segment_ids)
        scale = jnp.broadcast_to(temperature(c, first, h.shape[1]), h.shape[:2])      # [B, S]
        q = (q * scale[:, :, None, None]).astype(q.dtype)
    chunk = options["attention_chunk_size"]
    stored = None
    if layer_kv is None:
        out = (step.attention_core or attend)(q, k, v, scale=c.head_dim ** -0.5,
                          key_padding_mask=None if step.unpadded else attention_mask,
                     attention_chunk_size=chunk, segment_ids=step.segment_ids, implementation=step.attention)
    else:
        def core(q, keys, values, **mask_options):
            return attend(q, keys.astype(v.dtype), values.astype(v.dtype), scale=c.head_dim ** -0.5,
                          attention_chunk_size=chunk, implementation=step.attention, **mask_options)

        out, stored = layer_kv.attend(core, q, k, v)
    batch, sequence = h.shape[:2]
    out = linear(weights["o_proj"], out.reshape(batch, sequence, -1))
    return constrain(out, ("batch", "sequence", "embed")), stored


def route(config: Llama4TextConfig, router_logits, replay=None):
    """router_logits: [N, E] -> (sigmoid of the top-k logits [N, K], expert ids [N, K])."""
    return top_k_sigmoid(router_logits, config.num_experts_per_tok, replay=replay)


def moe_block(config: Llama4TextConfig, weights: dict, hidden, sharded_experts, *, inference: bool, rng, constrain,
              route):
    """The shared expert plus the chosen experts on pre-scaled inputs: hidden [B, S, H] -> [B, S, H]."""
    routed, logits, statistics = sparse_moe_block(weights, hidden, route=route, sharded_experts=sharded_experts,
                                                  constrain=constrain, router="router")
    shared = mlp(weights["shared_expert"], hidden, config.hidden_act, constrain=constrain)
    return shared + routed, logits, statistics


FAMILY = register_family(Family(
    model_type="llama4_text",
    architecture="Llama4ForCausalLM",
    config_class=Llama4TextConfig,
    tp_plan={
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.feed_forward.shared_expert.gate_proj": "colwise",
        "layers.*.feed_forward.shared_expert.up_proj": "colwise",
        "layers.*.feed_forward.shared_expert.down_proj": "rowwise",
        "layers.*.feed_forward.experts.gate_up_proj": "packed_rowwise",
        "layers.*.feed_forward.experts.down_proj": "colwise",
        "layers.*.feed_forward.experts": "moe_tp_experts",
        "layers.*.feed_forward.gate_proj": "colwise",
        "layers.*.feed_forward.up_proj": "colwise",
        "layers.*.feed_forward.down_proj": "rowwise",
    },
    ep_plan=None,  # the experts see every token pre-scaled: nothing to dispatch
    output_axes={
        **ROPE_ATTENTION_OUTPUT_AXES,
        "layers.*.feed_forward.shared_expert.gate_proj": "mlp",
        "layers.*.feed_forward.shared_expert.up_proj": "mlp",
        "layers.*.feed_forward.gate_proj": "mlp",
        "layers.*.feed_forward.up_proj": "mlp",
        "layers.*.feed_forward.router": "experts",
    },
    route=route,
    is_sparse=lambda config, layer: layer in config.moe_layers,
    declare_attention=declare_rope_attention,
    declare_sparse_mlp=declare_sparse_mlp,
    experts_intermediate_size=lambda config: config.intermediate_size,
    dense_intermediate_size=lambda config: config.intermediate_size_mlp,
    feed_forward_module="feed_forward",
    dense_activation_module="activation_fn",
    experts_forward=experts_forward,
    moe_block=moe_block,
    self_attention=self_attention,
    attention_options=attention_options,
    # HF's freqs_cis is complex64 whatever the model dtype; cos/sin rounded to fp16 gave 10x PyTorch's fp16 error.
    rope_dtype=jnp.float32,
    has_router_aux_loss=False,  # the reference's forward computes none
    experts_intermediate_dims={"gate_up_proj": "packed_last", "down_proj": 1},
))


class Llama4MultimodalConfig:
    """Reads a multimodal Llama 4 config.json (`llama4`: Scout, Maverick) as its `text_config`, a
    `Llama4TextConfig`; the vision settings are not used."""

    model_type: ClassVar[str] = "llama4"

    @classmethod
    def from_dict(cls, values: dict) -> Llama4TextConfig:
        text = values.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("a `llama4` config.json needs its `text_config` (the language model's settings); "
                             f"got {type(text).__name__}.")
        return Llama4TextConfig.from_dict({**text, "model_type": Llama4TextConfig.model_type})


# The text model of a multimodal Llama 4 checkpoint, as Transformers' `AutoModelForCausalLM` loads it: the
# `text_config`, the weights under `language_model.`, the vision tower skipped. It saves as a text model
# (`llama4_text`, keys without the prefix).
MULTIMODAL_FAMILY = register_family(replace(FAMILY, model_type="llama4", config_class=Llama4MultimodalConfig))
