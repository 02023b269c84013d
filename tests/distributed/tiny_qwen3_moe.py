"""A declared module/parameter tree with Qwen3-MoE's names and plans, for plan tests.

It declares structure only (no math): the real model lives in `moe_jax.models` once it exists. The
fixture `tests/fixtures/reference_plans.json` records the same tiny model built by transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_jax.distributed.plans import DEFAULT_BASE_MODEL_FSDP_PLAN, PlannedModel
from moe_jax.distributed.tree import ModuleTree

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "reference_plans.json").read_text())

QWEN3_MOE_BASE_TP_PLAN = {
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
QWEN3_MOE_BASE_EP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}


def declare_tree(cfg: dict) -> ModuleTree:
    hidden, heads, kv_heads, head_dim = (
        cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    )
    experts, moe_inter, inter = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    tree = ModuleTree()
    with tree.module("model"):
        with tree.module("embed_tokens"):
            tree.param("weight", (cfg["vocab_size"], hidden))
        with tree.module("layers"):
            for index in range(cfg["num_hidden_layers"]):
                with tree.module(index):
                    with tree.module("self_attn"):
                        for name, out in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim),
                                          ("v_proj", kv_heads * head_dim)):
                            with tree.module(name):
                                tree.param("weight", (out, hidden))
                        with tree.module("o_proj"):
                            tree.param("weight", (hidden, heads * head_dim))
                        for name in ("q_norm", "k_norm"):
                            with tree.module(name):
                                tree.param("weight", (head_dim,), init="ones")
                    sparse = index not in cfg["mlp_only_layers"] and (index + 1) % cfg["decoder_sparse_step"] == 0
                    with tree.module("mlp"):
                        if sparse:
                            with tree.module("experts"):
                                tree.param("gate_up_proj", (experts, 2 * moe_inter, hidden))
                                tree.param("down_proj", (experts, hidden, moe_inter))
                                tree.module_without_params("act_fn")
                            with tree.module("gate"):
                                tree.param("weight", (experts, hidden))
                        else:
                            for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                                ("down_proj", (hidden, inter))):
                                with tree.module(name):
                                    tree.param("weight", shape)
                            tree.module_without_params("act_fn")
                    for name in ("input_layernorm", "post_attention_layernorm"):
                        with tree.module(name):
                            tree.param("weight", (hidden,), init="ones")
        with tree.module("norm"):
            tree.param("weight", (hidden,), init="ones")
        tree.module_without_params("rotary_emb")
    with tree.module("lm_head"):
        tree.param("weight", (cfg["vocab_size"], hidden))
    return tree


class Qwen3MoeForCausalLM(PlannedModel):
    """Named as the HF class, so error texts read the same as the reference's."""

    _tp_plan = {"lm_head": "colwise_gather_output"}
    _fsdp_plan = {"lm_head": "keep_full_weight"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, **config_changes):
        self.config = {**FIXTURE["model_config"], **config_changes}
        self.module_tree = declare_tree(self.config)
        self.init_parallel_plans(
            {"tp": QWEN3_MOE_BASE_TP_PLAN, "ep": QWEN3_MOE_BASE_EP_PLAN, "fsdp": DEFAULT_BASE_MODEL_FSDP_PLAN}
        )


TinyQwen3MoeForCausalLM = Qwen3MoeForCausalLM
