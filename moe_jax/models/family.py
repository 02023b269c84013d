"""A model family as data: its config class, plans, module declarations and the free functions of its math.

The decoder skeleton (`moe_jax.models.decoder`) runs embed -> layers -> norm -> head for every family; a
`Family` says what differs. Each field is a plain value or a function of the family's config, so a family file
is its config dataclass, a few functions and one `Family(...)`. The defaults are the common case (Qwen3-MoE's
RoPE attention, softmax router, SwiGLU experts [E, 2I, H] / [E, H, I]).

    FAMILY = register_family(Family(
        model_type="mixtral", architecture="MixtralForCausalLM", config_class=MixtralConfig,
        tp_plan={...}, route=route, moe_block=moe_block,  # route: Mixtral's fp32 softmax top-k
        experts_intermediate_size=lambda config: config.intermediate_size,
    ))

Signatures of the functions (config first; see the defaults below):
    route(config, router_logits [N, E], *extra, replay=None) -> (weights [N, K], expert ids [N, K])
        (replay: [N, K] expert ids recorded by an earlier forward, forced in place of the top-k: `ops.routing`)
    experts_forward(config, backend) -> this family's experts function, one per activation kind:
        (tokens [N, H], expert_ids [N, K], weights [N, K], **params) -> [N, H]   (`ops.experts`)
    moe_block(config, weights, hidden [B, S, H], sharded_experts, *, inference, rng, constrain, route)
        -> (output [B, S, H], router_logits [B*S, E], statistics)
    self_attention(config, weights, h [B, S, H], options, rope, attention_mask, step, layer_kv)
        -> (output [B, S, H], the layer's stored cache arrays, or None without a cache)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..distributed.plans import DEFAULT_BASE_MODEL_FSDP_PLAN
from ..module_tree import ModuleTree
from ..nn.activations import get_activation
from ..nn.attention import attention, cached_attention
from ..nn.moe import sparse_moe_block
from ..ops.experts import swiglu_experts
from ..ops.routing import softmax_top_k

# Every family here shards its experts the same way under EP (HF's base_model_ep_plan of each config).
EXPERTS_EP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}

# The logical axis of the output features of each module whose output the layer code constrains by it (keys as
# in `base_model_tp_plan`): the plan's rules for these modules set the axis' mesh axes.
ROPE_ATTENTION_OUTPUT_AXES = {
    "layers.*.self_attn.q_proj": "heads",
    "layers.*.self_attn.k_proj": "kv_heads",
    "layers.*.self_attn.v_proj": "kv_heads",
}
OUTPUT_AXES = {
    **ROPE_ATTENTION_OUTPUT_AXES,
    "layers.*.mlp.gate_proj": "mlp",
    "layers.*.mlp.up_proj": "mlp",
    "layers.*.mlp.gate": "experts",
}


# ---- declarations (HF module names, in the order PyTorch lists them) ---------------------------------------
def declare_attention(tree: ModuleTree, config, layer: int, *, bias: bool = False) -> None:
    """q/k/v/o projections (with `bias` on all four)."""
    hidden, width, kv_width = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    tree.linear("q_proj", width, hidden, bias)
    tree.linear("k_proj", kv_width, hidden, bias)
    tree.linear("v_proj", kv_width, hidden, bias)
    tree.linear("o_proj", hidden, width, bias)


def declare_router(tree: ModuleTree, config) -> None:
    tree.linear("gate", config.num_experts, config.hidden_size)


def declare_experts(tree: ModuleTree, config, intermediate: int) -> None:
    """SwiGLU experts in HF's packed layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    with tree.module("experts"):
        tree.param("gate_up_proj", (config.num_experts, 2 * intermediate, config.hidden_size))
        tree.param("down_proj", (config.num_experts, config.hidden_size, intermediate))
        tree.module_without_params("act_fn")


def declare_dense_mlp(tree: ModuleTree, config, intermediate: int, activation_module: str = "act_fn") -> None:
    """A gated MLP: gate_proj / up_proj [I, H], down_proj [H, I], and its activation module."""
    hidden = config.hidden_size
    tree.linear("gate_proj", intermediate, hidden)
    tree.linear("up_proj", intermediate, hidden)
    tree.linear("down_proj", hidden, intermediate)
    tree.module_without_params(activation_module)


def router_then_experts(tree: ModuleTree, config, intermediate: int) -> None:
    """The MoE block with the router listed first (Qwen2-MoE, Mixtral, OLMoE); experts of width `intermediate`."""
    declare_router(tree, config)
    declare_experts(tree, config, intermediate)


def experts_then_router(tree: ModuleTree, config, intermediate: int) -> None:
    """The MoE block with the experts listed first (Qwen3-MoE)."""
    declare_experts(tree, config, intermediate)
    declare_router(tree, config)


# ---- structure and math --------------------------------------------------------------------------------
def sparse_step_layers(config, layer: int) -> bool:
    """Qwen's rule: MoE unless the layer is in mlp_only_layers or off the decoder_sparse_step grid."""
    return (layer not in config.mlp_only_layers and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


def softmax_route(config, router_logits, replay=None):
    """router_logits: [N, E] -> (softmax top-k weights [N, K] in the logits' dtype, renormalised when
    config.norm_topk_prob; expert ids [N, K]). replay: [N, K] recorded ids (`ops.routing`), or None."""
    return softmax_top_k(router_logits, config.num_experts_per_tok, normalize=config.norm_topk_prob, replay=replay)


def swiglu(config, backend: str | None) -> Callable:
    """The experts of most families: SwiGLU on [E, 2I, H] / [E, H, I] (`ops.experts.swiglu_experts`)."""
    return partial(swiglu_experts, act=get_activation(config.hidden_act), backend=backend)


def plain_moe_block(config, weights: dict, hidden, sharded_experts, *, inference: bool, rng, constrain, route):
    """The plain MoE block: router `gate`, then the experts (`nn.moe.sparse_moe_block`)."""
    return sparse_moe_block(weights, hidden, route=route, sharded_experts=sharded_experts, constrain=constrain)


def rope_attention(config, weights: dict, h, options: dict, rope: tuple, attention_mask, step, layer_kv):
    """RoPE attention (`nn.attention`): h [B, S, H] (normed) -> (output [B, S, H], the layer's cache arrays with
    the new tokens stored, or None without a cache). `options`: the family's `attention_options` for the layer;
    `layer_kv`: the layer's cache storage (`moe_jax.kv_cache`), whose mask replaces `attention_mask`."""
    cos, sin = rope
    options = dict(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                   head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, constrain=step.layouts.constrain,
                   implementation=step.attention, **options)
    if layer_kv is None:
        return attention(weights, h, cos, sin, attention_mask=None if step.unpadded else attention_mask,
                         segment_ids=step.segment_ids, core=step.attention_core, **options), None
    return cached_attention(weights, h, cos, sin, layer_kv, **options)


def kv_cache_heads(config) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, width) of what one layer's cache stores per token: its keys', then its values'."""
    return (config.num_key_value_heads, config.head_dim), (config.num_key_value_heads, config.head_dim)


@dataclass(frozen=True)
class Family:
    """One HF MoE family: what the shared decoder needs to build, shard and run it."""

    model_type: str
    architecture: str  # HF's ForCausalLM class name: the facade class's name, and error texts'
    config_class: Any  # a frozen dataclass with `from_dict` / `to_dict` (`models.config.HFConfigMixin`)
    route: Callable = softmax_route
    # HF's config class's plans, relative to the base model (`base_model_tp_plan`, ...).
    tp_plan: Mapping[str, str] | None = None
    ep_plan: Mapping[str, str] | None = field(default_factory=lambda: dict(EXPERTS_EP_PLAN))
    fsdp_plan: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_BASE_MODEL_FSDP_PLAN))
    output_axes: Mapping[str, str] = field(default_factory=lambda: dict(OUTPUT_AXES))
    # Structure.
    is_sparse: Callable[[Any, int], bool] = lambda config, layer: True
    declare_attention: Callable = declare_attention  # (tree, config, layer)
    declare_sparse_mlp: Callable = router_then_experts  # (tree, config, experts' intermediate size)
    experts_intermediate_size: Callable[[Any], int] = lambda config: config.moe_intermediate_size
    dense_intermediate_size: Callable[[Any], int] = lambda config: config.intermediate_size
    feed_forward_module: str = "mlp"  # the layer's feed-forward module (Llama 4: "feed_forward")
    dense_activation_module: str = "act_fn"  # the dense MLP's activation module (Llama 4: "activation_fn")
    # Math.
    experts_forward: Callable = swiglu
    moe_block: Callable = plain_moe_block
    self_attention: Callable = rope_attention
    attention_options: Callable[[Any, int], dict] = lambda config, layer: {}
    cache_heads: Callable = kv_cache_heads
    # RoPE's cos/sin in the activations' dtype, as HF's rotary embeddings return them (None), or this dtype.
    rope_dtype: Any = None
    # Whether the reference computes HF's softmax load-balancing loss (DeepSeek-V3, Llama 4: none; aux_loss 0).
    has_router_aux_loss: bool = True
    # Which dim of each expert weight tensor parallelism splits (`ShardedExperts.intermediate_dims`; None: the
    # [E, 2I, H] / [E, H, I] layout).
    experts_intermediate_dims: Mapping[str, int | str] | None = None
    # A kept-quantised twin's rewrite of the declared parameters into the checkpoint's stored form (codes and
    # scales under the hub's names), run last by `declare_tree`; None for every plain family.
    declare_storage: Callable | None = None  # (tree, config)
    # How many multi-token-prediction layers (`models.mtp`) a model of this config may hold (DeepSeek-V3:
    # num_nextn_predict_layers); 0: none.
    max_mtp_layers: Callable[[Any], int] = lambda config: 0
    # HF marks the experts' fused weights as [E, in, out] (`use_experts_implementation(is_transposed=True)`,
    # gpt-oss): PEFT's target_parameters then read their in / out features the other way round.
    experts_transposed: bool = False

    def sparse_layers(self, config) -> list[int]:
        return [layer for layer in range(config.num_hidden_layers) if self.is_sparse(config, layer)]

    def layer_signature(self, config, layer: int) -> tuple:
        """What besides its parameters makes a layer's math differ from another's: consecutive layers with
        equal signatures (and parameter layouts) share one scan."""
        return self.is_sparse(config, layer), tuple(sorted(self.attention_options(config, layer).items()))

    @property
    def experts(self) -> Callable:
        """Deprecated name of `experts_forward`."""
        warnings.warn("Family.experts is now Family.experts_forward; the old name will be removed.",
                      DeprecationWarning, stacklevel=2)
        return self.experts_forward


def _family_init_taking_old_names(init: Callable) -> Callable:
    """Family(experts=...) (the field's former name) still builds a family, with a DeprecationWarning."""

    def __init__(self, *args, experts: Callable | None = None, **kwargs):
        if experts is not None:
            warnings.warn("Family(experts=...) is now Family(experts_forward=...); the old name will be removed.",
                          DeprecationWarning, stacklevel=2)
            kwargs.setdefault("experts_forward", experts)
        init(self, *args, **kwargs)

    return __init__


Family.__init__ = _family_init_taking_old_names(Family.__init__)

FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Make a family known by its HF `model_type` (the facade builds its model class from it)."""
    FAMILIES[family.model_type] = family
    return family


# (model_type, quant_method) -> the family whose checkpoint weights stay in that quantised format on the devices
# (declared under the hub's names, e.g. `gate_up_proj_blocks` / `_scales`, and decoded inside the step).
KEPT_QUANTIZED_FAMILIES: dict[tuple[str, str], Family] = {}


def register_kept_quantized(method: str, family: Family) -> Family:
    KEPT_QUANTIZED_FAMILIES[(family.model_type, method)] = family
    return family


def kept_quantized_family(model_type: str, method: str) -> Family:
    """The family of `model_type` that keeps `method` (a `quantization_config.quant_method`) weights quantised."""
    family = KEPT_QUANTIZED_FAMILIES.get((model_type, method))
    if family is None:
        kept = ", ".join(f"{kind} ({name})" for kind, name in sorted(KEPT_QUANTIZED_FAMILIES)) or "none"
        raise ValueError(f"{model_type} weights in {method!r} cannot be kept quantised yet (kept quantised: {kept}, "
                         "and fp8 for families with SwiGLU experts); load with dequantize=True to hold them "
                         "dequantised.")
    return family
