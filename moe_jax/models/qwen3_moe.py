"""Qwen3-MoE (HF `qwen3_moe`): config, module tree with HF names, plans, and the forward math.

    layer i:  x += attention(rms_norm(x))                       q/k RMSNorm per head before RoPE
              x += sparse_moe(rms_norm(x))  if i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
                   mlp(rms_norm(x))         otherwise
    router:   p = softmax(x @ gate.T in fp32); w, idx = top_k(p); w /= sum(w) if norm_topk_prob
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..module_tree import ModuleTree
from .config import HFConfigMixin
from .family import Family, declare_attention, experts_then_router, register_family, sparse_step_layers


@dataclass(frozen=True)
class Qwen3MoeConfig(HFConfigMixin):
    """The fields of HF's `Qwen3MoeConfig` the model reads (defaults are HF's)."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    model_type: ClassVar[str] = "qwen3_moe"
    attribute_map: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @property
    def attention_window(self) -> int | None:
        return self.sliding_window if self.use_sliding_window else None


def declare_qk_norm_attention(tree: ModuleTree, config: Qwen3MoeConfig, layer: int) -> None:
    """q/k/v/o (bias per attention_bias), then an RMSNorm over each head's q and k."""
    declare_attention(tree, config, layer, bias=config.attention_bias)
    tree.norm("q_norm", config.head_dim)
    tree.norm("k_norm", config.head_dim)


FAMILY = register_family(Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    config_class=Qwen3MoeConfig,
    tp_plan={
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
    is_sparse=sparse_step_layers,
    declare_attention=declare_qk_norm_attention,
    declare_sparse_mlp=experts_then_router,  # HF registers the experts before the router here
    attention_options=lambda config, layer: {"qk_norm_kind": "per_head", "sliding_window": config.attention_window},
))
