"""gpt-oss (HF `gpt_oss`): config, module tree with HF names, plans, and the forward math.

    layer i:  x += attention(rms_norm(x))     q/k/v/o with bias; a learned sink logit per head in the
                                              softmax; sliding window on "sliding_attention" layers
                                              (layer_types, alternating by default); YaRN rope
              x += sparse_moe(rms_norm(x))    every layer
    router:   logits = x @ router.weight.T + router.bias; v, idx = top_k(logits); w = softmax(v) (over K)
    experts:  gate_up_proj [E, H, 2I] (gate and up interleaved on the last dim) + bias, clamped SwiGLU
              (alpha 1.702, limit 7), down_proj [E, I, H] + bias (`ops.experts.biased_clamped_swiglu_experts`)

No dense layers, no shared experts. The reference's plans: no TP plan besides lm_head (attention and
experts are replicated under TP), an EP plan that shards both expert biases with their experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

from ..module_tree import ModuleTree
from ..nn.moe import sparse_moe_block
from ..ops.experts import biased_clamped_swiglu_experts
from ..ops.quantized import VALUES_PER_BLOCK, MXFP4Experts
from ..ops.routing import top_k_softmax
from .config import HFConfigMixin
from .family import (
    ROPE_ATTENTION_OUTPUT_AXES,
    Family,
    declare_attention,
    register_family,
    register_kept_quantized,
)

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssConfig(HFConfigMixin):
    """The fields of HF's `GptOssConfig` the model reads (defaults are HF's).

    `num_experts` is an alias of `num_local_experts` (HF's `attribute_map`); `layer_types` defaults to
    sliding, full, sliding, ... and `rope_parameters` to YaRN (factor 32 over 4096 positions, theta 150000).
    """

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int | None = 64
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] | None = None
    attention_bias: bool = True
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    rope_parameters: dict | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    model_type: ClassVar[str] = "gpt_oss"
    attribute_map: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts"}

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", tuple(
                "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.num_hidden_layers)))
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types must give one of {LAYER_TYPES} for each of the {self.num_hidden_layers} "
                             f"layers, got {list(self.layer_types)}.")
        if self.rope_parameters is None:
            object.__setattr__(self, "rope_parameters", {
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0})

    @property
    def num_experts(self) -> int:
        return self.num_local_experts


def declare_sink_attention(tree: ModuleTree, config: GptOssConfig, layer: int) -> None:
    """A learned sink logit per head, then q/k/v/o with bias per attention_bias."""
    tree.param("sinks", (config.num_attention_heads,))  # a module's own parameters come first in torch
    declare_attention(tree, config, layer, bias=config.attention_bias)


def declare_sparse_mlp(tree: ModuleTree, config: GptOssConfig, intermediate: int) -> None:
    """A biased router, then experts with biases: gate_up_proj [E, H, 2I] (gate and up interleaved)."""
    with tree.module("router"):
        tree.param("weight", (config.num_experts, config.hidden_size))
        tree.param("bias", (config.num_experts,))  # HF initialises it normal, not zero
    with tree.module("experts"):
        tree.param("gate_up_proj", (config.num_experts, config.hidden_size, 2 * intermediate))
        tree.param("gate_up_proj_bias", (config.num_experts, 2 * intermediate), init="zeros")
        tree.param("down_proj", (config.num_experts, intermediate, config.hidden_size))
        tree.param("down_proj_bias", (config.num_experts, config.hidden_size), init="zeros")


def experts_forward(config: GptOssConfig, backend: str | None):
    return partial(biased_clamped_swiglu_experts, alpha=config.swiglu_alpha, limit=config.swiglu_limit,
                   backend=backend)


def attention_options(config: GptOssConfig, layer: int) -> dict:
    sliding = config.layer_types[layer] == "sliding_attention"
    return {"sliding_window": config.sliding_window if sliding else None}


def route(config: GptOssConfig, router_logits, replay=None):
    """router_logits: [N, E] (bias included) -> (weights [N, K] in the logits' dtype, expert ids [N, K])."""
    return top_k_softmax(router_logits, config.num_experts_per_tok, replay=replay)


def moe_block(config: GptOssConfig, weights, hidden, sharded_experts, *, inference, rng, constrain, route):
    return sparse_moe_block(weights, hidden, route=route, sharded_experts=sharded_experts, constrain=constrain,
                            router="router")


FAMILY = register_family(Family(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    config_class=GptOssConfig,
    tp_plan={},
    ep_plan={
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.gate_up_proj_bias": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj_bias": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    },
    output_axes={**ROPE_ATTENTION_OUTPUT_AXES, "layers.*.mlp.router": "experts"},
    route=route,
    declare_attention=declare_sink_attention,
    declare_sparse_mlp=declare_sparse_mlp,
    experts_intermediate_size=lambda config: config.intermediate_size,
    experts_forward=experts_forward,
    experts_transposed=True,
    moe_block=moe_block,
    attention_options=attention_options,
))


# ---- kept MXFP4: the released checkpoints' expert weights on the devices as they are stored ----------------------
def declare_mxfp4_sparse_mlp(tree: ModuleTree, config: GptOssConfig, intermediate: int) -> None:
    """The router, then the experts as the hub's MXFP4 checkpoints hold them (HF's `Mxfp4GptOssExperts`):
    gate_up_proj_blocks [E, 2I, H / 32, 16] and _scales [E, 2I, H / 32] (uint8), down_proj_blocks [E, H, I / 32,
    16] and _scales [E, H, I / 32], the biases as in the dense layout."""
    experts, hidden = config.num_experts, config.hidden_size
    for name, size in (("hidden_size", hidden), ("intermediate_size", intermediate)):
        if size % VALUES_PER_BLOCK:
            raise ValueError(f"MXFP4 experts need {name} ({size}) divisible by {VALUES_PER_BLOCK} (one scale per "
                             "32 values).")
    with tree.module("router"):
        tree.param("weight", (experts, hidden))
        tree.param("bias", (experts,))
    with tree.module("experts"):
        for proj, rows, columns in (("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate)):
            groups = columns // VALUES_PER_BLOCK
            tree.param(f"{proj}_blocks", (experts, rows, groups, VALUES_PER_BLOCK // 2), dtype="uint8", init="zeros",
                       keep_dtype=True)
            tree.param(f"{proj}_scales", (experts, rows, groups), dtype="uint8", init="zeros", keep_dtype=True)
            tree.param(f"{proj}_bias", (experts, rows), init="zeros")


def mxfp4_experts(hidden, expert_ids, weights, *, gate_up_proj_blocks, gate_up_proj_scales, gate_up_proj_bias,
                  down_proj_blocks, down_proj_scales, down_proj_bias, alpha: float, limit: float,
                  backend: str | None, lora=None):
    """gpt-oss's experts on kept MXFP4 weights: decoded one expert at a time inside the grouped matmul (a LoRA
    adapter's factors, if any, applied beside them)."""
    gate_up = MXFP4Experts.checked(gate_up_proj_blocks, gate_up_proj_scales, hidden.dtype)
    down = MXFP4Experts.checked(down_proj_blocks, down_proj_scales, hidden.dtype)
    return biased_clamped_swiglu_experts(hidden, expert_ids, weights, gate_up, gate_up_proj_bias, down,
                                         down_proj_bias, alpha=alpha, limit=limit, backend=backend, lora=lora)


def mxfp4_experts_forward(config: GptOssConfig, backend: str | None):
    return partial(mxfp4_experts, alpha=config.swiglu_alpha, limit=config.swiglu_limit, backend=backend)


MXFP4_FAMILY = register_kept_quantized("mxfp4", dataclasses.replace(
    FAMILY,
    # The blocks and scales are split with their experts, as the dense weights they stand for.
    ep_plan={**{rule: style for rule, style in FAMILY.ep_plan.items() if not rule.endswith("_proj")},
             **{f"layers.*.mlp.experts.{proj}_{part}": "grouped_gemm"
                for proj in ("gate_up_proj", "down_proj") for part in ("blocks", "scales")}},
    declare_sparse_mlp=declare_mxfp4_sparse_mlp,
    experts_forward=mxfp4_experts_forward,
))
