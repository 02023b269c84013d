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

from dataclasses import dataclass, field, fields
from functools import partial

import jax.numpy as jnp

from ..distributed.tree import ModuleTree
from ..nn.activations import get_activation
from ..nn.attention import attention
from ..nn.embedding import embed
from ..nn.linear import linear
from ..nn.moe import sparse_moe_block
from ..nn.norms import rms_norm
from ..nn.rotary import rope_inverse_frequencies, rope_parameters_from_config, rotary_cos_sin
from ..ops.experts import swiglu_experts
from ..ops.routing import softmax_top_k
from .base import MoeForCausalLM, register_model


@dataclass(frozen=True)
class OlmoeConfig:
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
        known = {f.name for f in fields(cls)} - {"raw"}
        kwargs = {k: v for k, v in values.items() if k in known}
        if "num_local_experts" in values:
            if "num_experts" in values and values["num_experts"] != values["num_local_experts"]:
                raise ValueError(
                    f"num_experts={values['num_experts']} and num_local_experts={values['num_local_experts']} "
                    "disagree; OLMoE's num_local_experts is an alias of num_experts."
                )
            kwargs["num_experts"] = values["num_local_experts"]
        head_dim = values.get("head_dim")
        hidden = kwargs.get("hidden_size", cls.hidden_size)
        heads = kwargs.get("num_attention_heads", cls.num_attention_heads)
        if head_dim is not None and head_dim * heads != hidden:
            raise ValueError(
                f"head_dim={head_dim} with num_attention_heads={heads} does not give hidden_size={hidden}; "
                "OLMoE's q_norm has hidden_size weights, so head_dim must be hidden_size // num_attention_heads."
            )
        return cls(**kwargs, raw=dict(values))

    def to_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "raw"}
        return {**self.raw, **values, "model_type": "olmoe"}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_local_experts(self) -> int:
        return self.num_experts


@register_model
class OlmoeForCausalLM(MoeForCausalLM):
    model_type = "olmoe"
    config_class = OlmoeConfig
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise_gather_output",
        "layers.*.self_attn.k_proj": "colwise_gather_output",
        "layers.*.self_attn.v_proj": "colwise_gather_output",
        "layers.*.self_attn.o_proj": "rowwise_split_input",
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    }
    base_model_ep_plan = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }

    def sparse_layers(self) -> list[int]:
        return list(range(self.config.num_hidden_layers))

    def declare_tree(self) -> ModuleTree:
        c = self.config
        hidden, head_dim = c.hidden_size, c.head_dim
        tree = ModuleTree()

        def linear_module(name, out_features, in_features, bias=False):
            with tree.module(name):
                tree.param("weight", (out_features, in_features))
                if bias:
                    tree.param("bias", (out_features,), init="zeros")

        def norm_module(name, size):
            with tree.module(name):
                tree.param("weight", (size,), init="ones")

        with tree.module("model"):
            with tree.module("embed_tokens"):
                tree.param("weight", (c.vocab_size, hidden))
            with tree.module("layers"):
                for layer in range(c.num_hidden_layers):
                    with tree.module(layer):
                        with tree.module("self_attn"):
                            linear_module("q_proj", c.num_attention_heads * head_dim, hidden, c.attention_bias)
                            linear_module("k_proj", c.num_key_value_heads * head_dim, hidden, c.attention_bias)
                            linear_module("v_proj", c.num_key_value_heads * head_dim, hidden, c.attention_bias)
                            linear_module("o_proj", hidden, c.num_attention_heads * head_dim, c.attention_bias)
                            norm_module("q_norm", c.num_attention_heads * head_dim)
                            norm_module("k_norm", c.num_key_value_heads * head_dim)
                        with tree.module("mlp"):
                            linear_module("gate", c.num_experts, hidden)
                            with tree.module("experts"):
                                tree.param("gate_up_proj", (c.num_experts, 2 * c.intermediate_size, hidden))
                                tree.param("down_proj", (c.num_experts, hidden, c.intermediate_size))
                                tree.module_without_params("act_fn")
                        norm_module("input_layernorm", hidden)
                        norm_module("post_attention_layernorm", hidden)
            norm_module("norm", hidden)
            tree.module_without_params("rotary_emb")
        with tree.module("lm_head"):
            if not c.tie_word_embeddings:
                tree.param("weight", (c.vocab_size, hidden))
        return tree

    def experts_fn(self):
        return partial(swiglu_experts, act=get_activation(self.config.hidden_act), backend=self.experts_backend)

    def route(self, router_logits):
        """router_logits: [N, E] -> (weights [N, K] in the logits' dtype, expert ids [N, K])."""
        return softmax_top_k(router_logits, self.config.num_experts_per_tok, normalize=self.config.norm_topk_prob)

    def forward_math(self, params, input_ids, attention_mask, run_experts, inference, rng=None):
        """input_ids, attention_mask: [B, S] -> (logits [B, S, V], router logits [B*S, E] per layer,
        dispatch statistics per layer)."""
        c = self.config
        model = params["model"]
        batch, sequence = input_ids.shape
        x = embed(model["embed_tokens"], input_ids)
        rope = rope_parameters_from_config(c.to_dict())
        inv_freq, scaling = rope_inverse_frequencies(rope)
        positions = jnp.broadcast_to(jnp.arange(sequence)[None, :], (batch, sequence))
        cos, sin = rotary_cos_sin(positions, inv_freq, scaling, dtype=x.dtype)
        router_logits, statistics = [], []
        for layer in range(c.num_hidden_layers):
            weights = model["layers"][str(layer)]
            h = rms_norm(weights["input_layernorm"], x, c.rms_norm_eps)
            x = x + attention(
                weights["self_attn"], h, cos, sin, num_heads=c.num_attention_heads,
                num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, attention_mask=attention_mask,
                qk_norm_kind="full_width", rms_norm_eps=c.rms_norm_eps, clip_qkv=c.clip_qkv,
            )
            h = rms_norm(weights["post_attention_layernorm"], x, c.rms_norm_eps)
            out, logits, layer_statistics = sparse_moe_block(
                weights["mlp"], h, route=self.route, run_experts=run_experts[layer], inference=inference
            )
            router_logits.append(logits)
            statistics.append(layer_statistics)
            x = x + out
        x = rms_norm(model["norm"], x, c.rms_norm_eps)
        head = params["lm_head"] if not c.tie_word_embeddings else model["embed_tokens"]
        return linear(head, x), router_logits, statistics
