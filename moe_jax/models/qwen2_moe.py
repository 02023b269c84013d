"""Qwen2-MoE (HF `qwen2_moe`): config, module tree with HF names, plans, and the forward math.

    layer i:  x += attention(rms_norm(x))   q/k/v bias (`qkv_bias`), no q/k norm; sliding window
                                            iff layer_types[i] == "sliding_attention"
              x += moe(rms_norm(x))   if i not in mlp_only_layers and num_experts > 0
                                         and (i + 1) % decoder_sparse_step == 0
                   mlp(rms_norm(x))   otherwise
    moe(h):   experts(h) + sigmoid(shared_expert_gate(h)) * shared_expert(h)
    router:   p = softmax(h @ gate.T in fp32); w, idx = top_k(p); w /= sum(w) if norm_topk_prob

The shared expert is a dense gated MLP of width `shared_expert_intermediate_size` that every token runs; its
gate is a `Linear(H, 1)` without bias. Neither has a TP rule in HF's plan, so both stay whole under TP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

from ..module_tree import ModuleTree
from ..nn.mlp import mlp
from ..nn.moe import shared_expert_output
from .config import HFConfigMixin
from .family import (
    Family,
    declare_dense_mlp,
    plain_moe_block,
    register_family,
    router_then_experts,
    sparse_step_layers,
)

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Qwen2MoeConfig(HFConfigMixin):
    """The fields of HF's `Qwen2MoeConfig` the model reads (defaults are HF's).

    As in HF's `__post_init__`: `sliding_window` is stored as 0 when `use_sliding_window` is False, and
    `layer_types` defaults to "sliding_attention" for even layers below `max_window_layers` when
    `use_sliding_window` is True, "full_attention" elsewhere.
    """

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 16
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    num_experts_per_tok: int = 4
    num_experts: int = 60
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: tuple[int, ...] = ()
    qkv_bias: bool = True
    layer_types: tuple[str, ...] | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    model_type: ClassVar[str] = "qwen2_moe"
    attribute_map: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}

    def __post_init__(self):
        set_field = partial(object.__setattr__, self)
        set_field("mlp_only_layers", tuple(self.mlp_only_layers or ()))
        if self.num_key_value_heads is None:
            set_field("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_field("head_dim", self.hidden_size // self.num_attention_heads)
        if not self.use_sliding_window:
            set_field("sliding_window", 0)
        if self.layer_types is None:
            set_field("layer_types", tuple(
                "sliding_attention" if (i + 1) % 2 and i < self.max_window_layers and self.use_sliding_window
                else "full_attention"
                for i in range(self.num_hidden_layers)
            ))
        else:
            set_field("layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}; "
                "give one of 'full_attention' / 'sliding_attention' per layer, or leave it None."
            )
        if unknown := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"layer_types contains {unknown}; Qwen2-MoE layers are one of {LAYER_TYPES}.")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError(
                f"layer_types marks layers {[i for i, t in enumerate(self.layer_types) if t == 'sliding_attention']} "
                f"as 'sliding_attention' but sliding_window={self.sliding_window!r} (use_sliding_window="
                f"{self.use_sliding_window}); set use_sliding_window=True and a positive sliding_window."
            )

    def attention_window(self, layer: int) -> int | None:
        """Keys visible per query in `layer` (itself included), None for full causal attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def declare_qkv_bias_attention(tree: ModuleTree, config: Qwen2MoeConfig, layer: int) -> None:
    """q/k/v with bias per qkv_bias, o_proj without."""
    hidden, width = config.hidden_size, config.num_attention_heads * config.head_dim
    tree.linear("q_proj", width, hidden, config.qkv_bias)
    tree.linear("k_proj", config.num_key_value_heads * config.head_dim, hidden, config.qkv_bias)
    tree.linear("v_proj", config.num_key_value_heads * config.head_dim, hidden, config.qkv_bias)
    tree.linear("o_proj", hidden, width)


def declare_sparse_mlp(tree: ModuleTree, config: Qwen2MoeConfig, intermediate: int) -> None:
    """Router, experts, the shared expert (a gated MLP) and its gate, as HF lists them."""
    router_then_experts(tree, config, intermediate)
    with tree.module("shared_expert"):
        declare_dense_mlp(tree, config, config.shared_expert_intermediate_size)
    tree.linear("shared_expert_gate", 1, config.hidden_size)


def moe_block(config: Qwen2MoeConfig, weights, hidden, sharded_experts, *, inference, rng, constrain, route):
    """Routed experts plus the gated shared expert: hidden [B, S, H] -> [B, S, H]."""
    out, logits, statistics = plain_moe_block(config, weights, hidden, sharded_experts, inference=inference,
                                                   rng=rng, constrain=constrain, route=route)
    shared = shared_expert_output(weights, hidden, partial(mlp, act=config.hidden_act))
    return out + shared, logits, statistics


FAMILY = register_family(Family(
    model_type="qwen2_moe",
    architecture="Qwen2MoeForCausalLM",
    config_class=Qwen2MoeConfig,
    tp_plan={
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
    is_sparse=sparse_step_layers,
    declare_attention=declare_qkv_bias_attention,
    declare_sparse_mlp=declare_sparse_mlp,
    moe_block=moe_block,
    attention_options=lambda config, layer: {"sliding_window": config.attention_window(layer)},
))
