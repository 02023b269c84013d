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

from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

from ..module_tree import ModuleTree
from ..nn.moe import sparse_moe_block
from ..ops.experts import biased_clamped_swiglu_experts
from ..ops.routing import top_k_softmax
from .config import HFConfigMixin
from .family import ROPE_ATTENTION_OUTPUT_AXES, Family, declare_attention, register_family

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


def route(config: GptOssConfig, router_logits):
    """router_logits: [N, E] (bias included) -> (weights [N, K] in the logits' dtype, expert ids [N, K])."""
    return top_k_softmax(router_logits, config.num_experts_per_tok)


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
