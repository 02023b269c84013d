"""DeepSeek-V3 (HF `deepseek_v3`): config, module tree with HF names, plans, and the forward math.

    layer i:  x += mla(rms_norm(x))                  multi-head latent attention (`nn.latent_attention`)
              x += mlp(rms_norm(x))                  if i < first_k_dense_replace (dense, intermediate_size)
                   moe(rms_norm(x))                  otherwise
    moe(h):   experts(h) + shared_experts(h)         shared: an MLP of moe_intermediate_size * n_shared_experts
    router:   logits = h @ gate.weight.T in float32; s = sigmoid(logits)
              choose with s + gate.e_score_correction_bias, within the topk_group best of n_group groups;
              w = s[chosen] (unbiased), / sum if norm_topk_prob, * routed_scaling_factor
              (`ops.routing.group_limited_sigmoid_top_k`)

`e_score_correction_bias` is a persistent buffer: loaded and saved, never trained, float32 and replicated
whatever the layout. The reference's TP plan covers the experts, the shared experts and the dense MLPs;
MLA stays replicated under TP. Hub checkpoints may be FP8 block-quantised (`converters.fp8`, a load-only
layout) and carry num_nextn_predict_layers multi-token-prediction layers after the last decoder layer
(`models.mtp`): a model loaded from such a checkpoint holds them (the reference skips them), one loaded from a
checkpoint without them does not. The key map built from the config is converters'
(`converters.key_maps.CONFIG_KEY_MAPS`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import jax.numpy as jnp

from ..module_tree import ModuleTree, ParamSpec
from ..nn.activations import get_activation
from ..nn.latent_attention import LatentDims, cached_latent_attention, latent_attention
from ..nn.linear import linear
from ..nn.mlp import mlp
from ..nn.rotary import rope_parameters_from_config
from ..ops.experts import swiglu_experts
from ..ops.quantized import FP8Experts
from ..ops.routing import group_limited_sigmoid_top_k
from .config import HFConfigMixin
from .family import Family, declare_dense_mlp, declare_experts, register_family, register_kept_quantized
from .mtp import MTP_OWN_PARAMS

# quantization_config's default weight_block_size (converters.fp8.DEFAULT_BLOCK; models import no converters).
FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class DeepseekV3Config(HFConfigMixin):
    """The fields of HF's `DeepseekV3Config` the model reads (defaults are HF's).

    Aliases as HF's `attribute_map`: `num_local_experts` is `n_routed_experts`, `num_mtp_layers` is
    `num_nextn_predict_layers`. `head_dim` is `qk_rope_head_dim` (what the rotary tables cover), as HF sets it.
    """

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    num_nextn_predict_layers: int = 1
    output_router_logits: bool = False
    head_dim: int | None = None
    quantization_config: dict | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    model_type: ClassVar[str] = "deepseek_v3"
    attribute_map: ClassVar[dict[str, str]] = {"num_local_experts": "n_routed_experts",
                                               "num_mtp_layers": "num_nextn_predict_layers"}

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        object.__setattr__(self, "head_dim", self.qk_rope_head_dim)

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """HF's `yarn_apply_mscale(rope_parameters, qk_head_dim ** -0.5)`: a scaled RoPE with `mscale_all_dim`
        multiplies the logit scale by `(0.1 * mscale_all_dim * ln(factor) + 1) ** 2`."""
        scale = self.qk_head_dim ** -0.5
        rope = rope_parameters_from_config(self.to_dict())
        if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor > 1:
            mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    @property
    def weight_block_size(self) -> tuple[int, int]:
        """The FP8 block of quantised hub weights (quantization_config), [128, 128] by default."""
        block = (self.quantization_config or {}).get("weight_block_size") or FP8_BLOCK
        return int(block[0]), int(block[1])


def latent_dims(config: DeepseekV3Config) -> LatentDims:
    c = config
    return LatentDims(num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                      qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                      v_head_dim=c.v_head_dim, scale=c.softmax_scale, rope_interleave=c.rope_interleave)


def declare_latent_attention(tree: ModuleTree, config: DeepseekV3Config, layer: int) -> None:
    """MLA: q through a low-rank bottleneck (or one q_proj), a shared compressed kv + rope key, o_proj."""
    c, hidden, bias = config, config.hidden_size, config.attention_bias
    heads = c.num_attention_heads
    if c.q_lora_rank is None:
        tree.linear("q_proj", heads * c.qk_head_dim, hidden)
    else:
        tree.linear("q_a_proj", c.q_lora_rank, hidden, bias)
        tree.norm("q_a_layernorm", c.q_lora_rank)
        tree.linear("q_b_proj", heads * c.qk_head_dim, c.q_lora_rank)
    tree.linear("kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, hidden, bias)
    tree.norm("kv_a_layernorm", c.kv_lora_rank)
    tree.linear("kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    tree.linear("o_proj", hidden, heads * c.v_head_dim, bias)


def declare_sparse_mlp(tree: ModuleTree, config: DeepseekV3Config, intermediate: int) -> None:
    """DeepseekV3MoE lists experts, gate (with its correction-bias buffer), shared_experts."""
    declare_experts(tree, config, intermediate)
    with tree.module("gate"):
        tree.param("weight", (config.num_experts, config.hidden_size))
        tree.buffer("e_score_correction_bias", (config.num_experts,))
    with tree.module("shared_experts"):
        declare_dense_mlp(tree, config, config.moe_intermediate_size * config.n_shared_experts)


def cache_heads(config: DeepseekV3Config) -> tuple[tuple[int, int], tuple[int, int]]:
    """A layer caches its normed latent (1 x kv_lora_rank) and rotated shared key (1 x qk_rope_head_dim)."""
    return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)


def self_attention(config: DeepseekV3Config, weights, h, options, rope, attention_mask, step, layer_kv):
    """Multi-head latent attention (`nn.latent_attention`); the cache holds latents and rotated keys."""
    cos, sin = rope
    constrain = step.layouts.constrain
    if layer_kv is None:
        return latent_attention(weights, h, cos, sin, dims=latent_dims(config), attention_mask=attention_mask,
                                constrain=constrain, segment_ids=step.segment_ids, core=step.attention_core), None
    return cached_latent_attention(weights, h, cos, sin, layer_kv, dims=latent_dims(config), constrain=constrain)


def route(config: DeepseekV3Config, router_logits, correction_bias, replay=None):
    """router_logits: [N, E] float32; correction_bias: [N, E] (the [E] buffer, one row per token, so the
    router runs where the tokens are) -> (weights [N, K] float32, expert ids [N, K])."""
    c = config
    return group_limited_sigmoid_top_k(
        router_logits, correction_bias[0], c.num_experts_per_tok, num_groups=c.n_group,
        top_k_groups=c.topk_group, normalize=c.norm_topk_prob, scaling=c.routed_scaling_factor, replay=replay,
    )


def moe_block(config: DeepseekV3Config, weights: dict, hidden, sharded_experts, *, inference: bool, rng, constrain,
              route):
    """Routed experts plus the shared experts: hidden [B, S, H] -> [B, S, H]."""
    batch, sequence, width = hidden.shape
    tokens = hidden.reshape(batch * sequence, width)
    gate = weights["gate"]
    # The reference's router runs in float32 whatever the model's dtype (a LoRA adapter on it included).
    router_logits = constrain(linear({**gate, "weight": gate["weight"].astype(jnp.float32)},
                                     tokens.astype(jnp.float32)), ("tokens", "experts"))
    bias = jnp.broadcast_to(gate["e_score_correction_bias"], router_logits.shape)
    top_k_weights, top_k_index = route(router_logits, bias)
    routed, statistics = sharded_experts(tokens, top_k_index, top_k_weights, weights["experts"])
    routed = routed.astype(hidden.dtype).reshape(batch, sequence, width)
    shared = mlp(weights["shared_experts"], hidden, config.hidden_act, constrain=constrain)
    return routed + shared, router_logits, statistics


FAMILY = register_family(Family(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    config_class=DeepseekV3Config,
    tp_plan={
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
    output_axes={
        "layers.*.self_attn.q_proj": "heads",
        "layers.*.self_attn.q_a_proj": "q_lora",
        "layers.*.self_attn.q_b_proj": "heads",
        "layers.*.self_attn.kv_a_proj_with_mqa": "kv_lora",
        "layers.*.self_attn.kv_b_proj": "heads",
        "layers.*.mlp.shared_experts.gate_proj": "mlp",
        "layers.*.mlp.shared_experts.up_proj": "mlp",
        "layers.*.mlp.gate_proj": "mlp",
        "layers.*.mlp.up_proj": "mlp",
        "layers.*.mlp.gate": "experts",
    },
    route=route,
    is_sparse=lambda config, layer: layer >= config.first_k_dense_replace,
    declare_attention=declare_latent_attention,
    declare_sparse_mlp=declare_sparse_mlp,
    self_attention=self_attention,
    cache_heads=cache_heads,
    moe_block=moe_block,
    has_router_aux_loss=False,  # balanced by the router's bias instead; the reference reports none
    max_mtp_layers=lambda config: config.num_nextn_predict_layers,
))


# ---- kept FP8: the released checkpoints' block-quantised weights on the devices as they are stored --------------
KEPT_FP8_EXPERTS = ("gate_up_proj", "down_proj")


def declare_fp8_storage(tree: ModuleTree, config: DeepseekV3Config) -> None:
    """Every linear weight of the layers but the router's (`mlp.gate`) and an MTP layer's own (its embedding,
    eh_proj and shared head stay unquantised), and the routed experts' weights, as the
    hub's FP8 checkpoints hold them: float8_e4m3fn codes under the weight's name plus float32 block multipliers
    (`{weight}_scale_inv`: [ceil(O / bR), ceil(I / bC)] per matrix, [E, ...] for the experts)."""
    rows_block, columns_block = config.weight_block_size
    grid = lambda rows, columns: (-(-rows // rows_block), -(-columns // columns_block))  # noqa: E731
    stored: dict[str, ParamSpec] = {}
    for name, spec in tree.params.items():
        linear_weight = (name.startswith("model.layers.") and name.endswith(".weight") and len(spec.shape) == 2
                         and not name.endswith((".mlp.gate.weight", *MTP_OWN_PARAMS)))
        expert_weight = name.rpartition(".")[2] in KEPT_FP8_EXPERTS and ".mlp.experts." in name
        if not (linear_weight or expert_weight):
            stored[name] = spec
            continue
        *experts, rows, columns = spec.shape
        if name.endswith("gate_up_proj") and (rows // 2) % rows_block:
            raise ValueError(f"kept FP8 experts need the intermediate size ({rows // 2}) to be a multiple of the "
                             f"block's {rows_block} rows (gate and up are stored as separate blocks); load with "
                             "dequantize=True.")
        stored[name] = ParamSpec(spec.shape, "float8_e4m3fn", "zeros", keep_dtype=True)
        stored[f"{name}_scale_inv"] = ParamSpec((*experts, *grid(rows, columns)), "float32", "ones", keep_dtype=True)
    tree.params = stored


def fp8_swiglu_experts(hidden, expert_ids, weights, *, gate_up_proj, gate_up_proj_scale_inv, down_proj,
                       down_proj_scale_inv, act, backend, lora=None):
    """SwiGLU experts on kept FP8 weights: decoded one expert at a time inside the grouped matmul (a LoRA
    adapter's factors, if any, applied beside them)."""
    return swiglu_experts(hidden, expert_ids, weights,
                          FP8Experts.checked(gate_up_proj, gate_up_proj_scale_inv, hidden.dtype),
                          FP8Experts.checked(down_proj, down_proj_scale_inv, hidden.dtype), act=act, backend=backend,
                          lora=lora)


def fp8_experts_forward(config: DeepseekV3Config, backend: str | None):
    return partial(fp8_swiglu_experts, act=get_activation(config.hidden_act), backend=backend)


FP8_FAMILY = register_kept_quantized("fp8", dataclasses.replace(
    FAMILY,
    # The scales are split with their experts, as the codes; a linear's scales follow its module's TP rule.
    ep_plan={**FAMILY.ep_plan, **{f"layers.*.mlp.experts.{proj}_scale_inv": "grouped_gemm"
                                  for proj in KEPT_FP8_EXPERTS}},
    declare_storage=declare_fp8_storage,
    experts_forward=fp8_experts_forward,
))
