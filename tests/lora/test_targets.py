"""Which weights a `LoraConfig` adapts, matched as PEFT matches them, and the errors for names that match nothing
or match what cannot be adapted that way."""

from __future__ import annotations

import pytest

import moe_jax.causal_lm
from moe_jax.lora import LoraConfig
from moe_jax.lora.targets import find_targets

from ..models.hf_reference import TINY_DEEPSEEK_V3, TINY_GPT_OSS, TINY_QWEN3_MOE


def targets(model_type, values, **config):
    model = moe_jax.causal_lm.MODEL_CLASSES[model_type](values, abstract=True)
    return find_targets(LoraConfig(**config), model.module_tree, model.family)


def test_list_entries_match_a_name_or_its_dotted_suffix():
    found = targets("qwen3_moe", TINY_QWEN3_MOE, target_modules=["q_proj", "self_attn.v_proj"])
    assert [t.parameter for t in found][:2] == ["model.layers.0.self_attn.q_proj.weight",
                                               "model.layers.0.self_attn.v_proj.weight"]
    assert len(found) == 2 * TINY_QWEN3_MOE["num_hidden_layers"]
    assert all(t.experts is None and t.in_features == 32 for t in found)


def test_a_regular_expression_matches_whole_module_names_and_all_linear_leaves_out_the_head():
    found = targets("qwen3_moe", TINY_QWEN3_MOE, target_modules=r"model\.layers\.[12]\.self_attn\.(q|k)_proj")
    assert [t.module for t in found] == [f"model.layers.{i}.self_attn.{p}_proj" for i in (1, 2) for p in "qk"]
    every = targets("qwen3_moe", TINY_QWEN3_MOE, target_modules="all-linear")
    assert "lm_head" not in {t.module for t in every} and not any(t.module.endswith(".mlp.gate") for t in every)
    assert "model.layers.0.mlp.gate_proj" in {t.module for t in every}   # the dense first layer's MLP


def test_fused_expert_weights_have_one_adapter_per_expert_and_peft_s_nesting():
    found = targets("qwen3_moe", TINY_QWEN3_MOE, target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
    gate_up, down = found[0], found[1]
    assert gate_up.name == "gate_up_proj" and down.name == "down_proj"
    # [E, 2I, H]: PEFT's in is H, out 2I; gate_up_proj, declared first, is the inner ParamWrapper.
    assert (gate_up.experts, gate_up.in_features, gate_up.out_features, gate_up.wrappers_outside) == (8, 32, 32, 1)
    assert (down.in_features, down.out_features, down.wrappers_outside) == (16, 32, 0)
    assert gate_up.factor_shapes(4) == ((8, 4, 32), (8, 32, 4))


def test_gpt_oss_experts_are_read_transposed():
    gate_up = targets("gpt_oss", TINY_GPT_OSS, target_parameters=["mlp.experts.gate_up_proj"])[0]
    assert gate_up.transposed and (gate_up.in_features, gate_up.out_features) == (32, 32)
    down = targets("gpt_oss", TINY_GPT_OSS, target_parameters=["mlp.experts.down_proj"])[0]
    assert (down.in_features, down.out_features) == (16, 32)   # [E, I, H]: in I, out H


@pytest.mark.parametrize("config, message", [
    (dict(target_modules=["q_porj"]), r"'q_porj' matches no module of this model \(closest: q_proj"),
    (dict(target_modules=r"layers\.9\..*"), r"matches no module of this model"),
    (dict(target_parameters=["mlp.experts.gate_proj"]),
     r"'mlp.experts.gate_proj' matches no parameter of this model \(closest: .*mlp.experts.gate_up_proj"),
    (dict(target_modules=["gate"]), r"HF's router, which is not a torch.nn.Linear .* target_parameters=\['mlp.gate.weight'\]"),
    (dict(target_modules=["experts"]), r"not a torch.nn.Linear: adapt its fused expert weights with target_parameters="),
    (dict(target_modules=["embed_tokens"]), r"an embedding: LoRA on embeddings is not supported"),
    (dict(target_parameters=["input_layernorm.weight"]), r"only 2-D linear weights and 3-D fused expert weights"),
    (dict(target_modules=["q_proj"], target_parameters=["self_attn.q_proj.weight"]), r"adapted twice"),
])
def test_a_bad_target_is_refused_naming_it_and_the_closest_valid_name(config, message):
    with pytest.raises(ValueError, match=message):
        targets("qwen3_moe", TINY_QWEN3_MOE, **config)


def test_deepseek_s_router_weight_is_a_2d_parameter_target():
    found = targets("deepseek_v3", TINY_DEEPSEEK_V3, target_parameters=["mlp.gate.weight"])
    assert [t.module for t in found] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    assert found[0].experts is None and (found[0].in_features, found[0].out_features) == (32, 8)


def test_a_list_entry_matches_whole_name_segments_only():
    """PEFT matches `target == name or name.endswith("." + target)`: "proj" is no module's name, so it matches
    nothing (not every `*_proj`), and "_proj" neither."""
    for partial in ("proj", "_proj", "attn.q_proj"):
        with pytest.raises(ValueError, match=f"target_modules entry '{partial}' matches no module"):
            targets("qwen3_moe", TINY_QWEN3_MOE, target_modules=[partial])
    found = targets("qwen3_moe", TINY_QWEN3_MOE, target_modules=["o_proj"])
    assert [t.module for t in found] == [f"model.layers.{i}.self_attn.o_proj"
                                         for i in range(TINY_QWEN3_MOE["num_hidden_layers"])]
