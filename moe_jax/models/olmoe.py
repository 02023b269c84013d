"""OLMoE (HF `olmoe`): config, module tree with HF names, plans, and the forward math.

    layer i:  x += attention(rms_norm(x))   q = rms_norm(q_proj(h)), k = rms_norm(k_proj(h)) over the full
                                            projection width [N*D] / [K*D], then q, k, v clamped to
                                            [-clip_qkv, clip_qkv] when clip_qkv is set, then heads and RoPE
              x += sparse_moe(rms_norm(x))  every layer
    router:   p = softmax(x @ gate.T in fp32); w, idx = top_k(p); w /= sum(w) if norm_topk_prob

Because the q/k norms span the whole projection, HF's TP plan gathers the q/k/v outputs
(`colwise_gather_output`) and slices the o_proj input (`rowwise_split_input`); there is no dense MLP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..module_tree import ModuleTree
from .config import HFConfigMixin
from .family import Family, declare_attention, register_family


@dataclass(frozen=True)
class OlmoeConfig(HFConfigMixin):
    """The fields of HF's `OlmoeConfig` the model reads (defaults are HF's).

    `num_local_experts` is an alias of `num_experts` (HF's `attribute_map`). The head size is always
    `hidden_size // num_attention_heads`: HF sizes `q_norm` by `hidden_size`, so no other head size works.
    """

    vocab_size: int = 50304
    hidden_size: int = 2048
    intermediate_size: int = 2048
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    clip_qkv: float | None = None
    num_experts_per_tok: int = 8
    num_experts: int = 64
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.01
    norm_topk_prob: bool = False
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    model_type: ClassVar[str] = "olmoe"
    attribute_map: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads="
                f"{self.num_attention_heads}; OLMoE's q_norm spans hidden_size = num_attention_heads * head_dim."
            )

    @classmethod
    def from_dict(cls, values: dict) -> OlmoeConfig:
        head_dim = values.get("head_dim")
        hidden = values.get("hidden_size", cls.hidden_size)
        heads = values.get("num_attention_heads", cls.num_attention_heads)
        if head_dim is not None and head_dim * heads != hidden:
            raise ValueError(
                f"head_dim={head_dim} with num_attention_heads={heads} does not give hidden_size={hidden}; "
                "OLMoE's q_norm has hidden_size weights, so head_dim must be hidden_size // num_attention_heads."
            )
        return super().from_dict(values)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_local_experts(self) -> int:
        return self.num_experts


def declare_full_width_qk_norm_attention(tree: ModuleTree, config: OlmoeConfig, layer: int) -> None:
    """q/k/v/o (bias per attention_bias), then RMSNorms over the full q and k projection widths."""
    declare_attention(tree, config, layer, bias=config.attention_bias)
    tree.norm("q_norm", config.num_attention_heads * config.head_dim)
    tree.norm("k_norm", config.num_key_value_heads * config.head_dim)


FAMILY = register_family(Family(
    model_type="olmoe",
    architecture="OlmoeForCausalLM",
    config_class=OlmoeConfig,
    tp_plan={
        "layers.*.self_attn.q_proj": "colwise_gather_output",
        "layers.*.self_attn.k_proj": "colwise_gather_output",
        "layers.*.self_attn.v_proj": "colwise_gather_output",
        "layers.*.self_attn.o_proj": "rowwise_split_input",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    },
    declare_attention=declare_full_width_qk_norm_attention,
    # OLMoE has no dense layers; its experts use intermediate_size.
    experts_intermediate_size=lambda config: config.intermediate_size,
    attention_options=lambda config, layer: {"qk_norm_kind": "full_width", "clip_qkv": config.clip_qkv},
))
