"""Mixtral (HF `mixtral`): config, module tree with HF names, plans, and the forward math.

    layer i:  x += attention(rms_norm(x))       no bias, no q/k norm; sliding window on every layer when
                                                `sliding_window` is set
              x += sparse_moe(rms_norm(x))      every layer
    router:   logits = x @ gate.T (model dtype); p = softmax(fp32(logits)); w, idx = top_k(p); w /= sum(w)
              (always renormalised; w stays fp32, so the expert outputs are summed in fp32)
    jitter:   training only, router_jitter_noise = j > 0: x *= U(1 - j, 1 + j) before router and experts

The in-memory names are HF 5.x's (`mlp.gate`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), not
the checkpoint's `block_sparse_moe.*`; converting a checkpoint's names is the loader's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import jax

from ..ops.routing import mixtral_top_k
from .config import HFConfigMixin
from .family import Family, plain_moe_block, register_family


@dataclass(frozen=True)
class MixtralConfig(HFConfigMixin):
    """The fields of HF's `MixtralConfig` the model reads (defaults are HF's).

    `num_experts` is an alias of `num_local_experts` (HF's `attribute_map`).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096 * 32
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    num_experts_per_tok: int = 2
    num_local_experts: int = 8
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    model_type: ClassVar[str] = "mixtral"
    attribute_map: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts"}

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"sliding_window={self.sliding_window} must be a positive number of keys per query or None "
                "(full causal attention)."
            )
        if self.router_jitter_noise < 0:
            raise ValueError(f"router_jitter_noise must be >= 0, got {self.router_jitter_noise}")

    @property
    def num_experts(self) -> int:
        return self.num_local_experts


def router_jitter(hidden_states: jax.Array, key: jax.Array, noise: float) -> jax.Array:
    """Mixtral's training jitter: hidden_states [..., H] times U(1 - noise, 1 + noise) drawn per element in
    the hidden dtype (HF: `hidden_states *= torch.empty_like(hidden_states).uniform_(1 - j, 1 + j)`)."""
    factor = jax.random.uniform(key, hidden_states.shape, hidden_states.dtype, 1.0 - noise, 1.0 + noise)
    return hidden_states * factor


def route(config: MixtralConfig, router_logits, replay=None):
    """router_logits: [N, E] in the model dtype -> (weights [N, K] float32, expert ids [N, K])."""
    return mixtral_top_k(router_logits, config.num_experts_per_tok, replay=replay)


def moe_block(config: MixtralConfig, weights, hidden, sharded_experts, *, inference, rng, constrain, route):
    """Router jitter in training (needs `rng`, this layer's key: `fold_in(rng, layer)`), then the block:
    hidden [B, S, H] -> [B, S, H]."""
    noise = config.router_jitter_noise
    if noise > 0 and not inference:
        if rng is None:
            raise ValueError(
                f"Mixtral's router jitter (router_jitter_noise={noise}) scales the MoE input by "
                "U(1 - j, 1 + j) noise in training and needs a PRNG key: call "
                "model.forward(input_ids, inference=False, rng=jax.random.key(step)), run with "
                "inference=True (no jitter, as HF's eval mode), or set router_jitter_noise=0."
            )
        hidden = router_jitter(hidden, rng, noise)
    return plain_moe_block(config, weights, hidden, sharded_experts, inference=inference, rng=rng,
                                constrain=constrain, route=route)


FAMILY = register_family(Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    config_class=MixtralConfig,
    tp_plan={
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    },
    route=route,
    moe_block=moe_block,
    experts_intermediate_size=lambda config: config.intermediate_size,
    attention_options=lambda config, layer: {"sliding_window": config.sliding_window},
))
