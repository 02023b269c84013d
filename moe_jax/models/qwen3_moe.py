"""Qwen3-MoE (HF `qwen3_moe`): config, module tree with HF names, plans, and the forward math.

    layer i:  x += attention(rms_norm(x))                       q/k RMSNorm per head before RoPE
              x += sparse_moe(rms_norm(x))  if i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
                   mlp(rms_norm(x))         otherwise
    router:   p = softmax(x @ gate.T in fp32); w, idx = top_k(p); w /= sum(w) if norm_topk_prob
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
from ..nn.mlp import mlp
from ..nn.moe import sparse_moe_block
from ..nn.norms import rms_norm
from ..nn.rotary import rope_inverse_frequencies, rope_parameters_from_config, rotary_cos_sin
from ..ops.experts import swiglu_experts
from ..ops.routing import softmax_top_k
from .base import MoeForCausalLM, register_model


@dataclass(frozen=True)
class Qwen3MoeConfig:
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

    @classmethod
    def from_dict(cls, values: dict) -> Qwen3MoeConfig:
        known = {f.name for f in fields(cls)} - {"raw"}
        # HF's attribute_map: config.json stores num_experts as num_local_experts.
        values = {"num_experts": values["num_local_experts"], **values} if "num_local_experts" in values else values
        kwargs = {k: v for k, v in values.items() if k in known}
        if kwargs.get("mlp_only_layers") is not None:
            kwargs["mlp_only_layers"] = tuple(kwargs["mlp_only_layers"])
        else:
            kwargs.pop("mlp_only_layers", None)
        if kwargs.get("head_dim") is None:
            kwargs["head_dim"] = values.get("hidden_size", cls.hidden_size) // values.get(
                "num_attention_heads", cls.num_attention_heads)
        return cls(**kwargs, raw=dict(values))

    def to_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "raw"}
        values["mlp_only_layers"] = list(self.mlp_only_layers)
        return {**self.raw, **values, "model_type": "qwen3_moe"}

    @property
    def attention_window(self) -> int | None:
        return self.sliding_window if self.use_sliding_window else None


@register_model
class Qwen3MoeForCausalLM(MoeForCausalLM):
    model_type = "qwen3_moe"
    config_class = Qwen3MoeConfig
    base_model_tp_plan = {
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
    }
    base_model_ep_plan = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }

    def is_sparse(self, layer: int) -> bool:
        c = self.config
        return layer not in c.mlp_only_layers and c.num_experts > 0 and (layer + 1) % c.decoder_sparse_step == 0

    def sparse_layers(self) -> list[int]:
        return [layer for layer in range(self.config.num_hidden_layers) if self.is_sparse(layer)]

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
                            norm_module("q_norm", head_dim)
                            norm_module("k_norm", head_dim)
                        with tree.module("mlp"):
                            if self.is_sparse(layer):
                                with tree.module("experts"):
                                    tree.param("gate_up_proj", (c.num_experts, 2 * c.moe_intermediate_size, hidden))
                                    tree.param("down_proj", (c.num_experts, hidden, c.moe_intermediate_size))
                                    tree.module_without_params("act_fn")
                                linear_module("gate", c.num_experts, hidden)
                            else:
                                linear_module("gate_proj", c.intermediate_size, hidden)
                                linear_module("up_proj", c.intermediate_size, hidden)
                                linear_module("down_proj", hidden, c.intermediate_size)
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
        return softmax_top_k(router_logits, self.config.num_experts_per_tok, normalize=self.config.norm_topk_prob)

    def forward_math(self, params, input_ids, attention_mask, run_experts, inference, rng=None):
        c = self.config
        model = params["model"]
        batch, sequence = input_ids.shape
        x = embed(model["embed_tokens"], input_ids)
        rope = rope_parameters_from_config({**c.raw, **c.to_dict()})
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
                sliding_window=c.attention_window, qk_norm_kind="per_head", rms_norm_eps=c.rms_norm_eps,
            )
            h = rms_norm(weights["post_attention_layernorm"], x, c.rms_norm_eps)
            if layer in run_experts:
                out, logits, layer_statistics = sparse_moe_block(
                    weights["mlp"], h, route=self.route, run_experts=run_experts[layer], inference=inference
                )
                router_logits.append(logits)
                statistics.append(layer_statistics)
            else:
                out = mlp(weights["mlp"], h, c.hidden_act)
            x = x + out
        x = rms_norm(model["norm"], x, c.rms_norm_eps)
        head = params["lm_head"] if not c.tie_word_embeddings else model["embed_tokens"]
        return linear(head, x), router_logits, statistics
