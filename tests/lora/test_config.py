"""`LoraConfig`: PEFT's fields and meaning, its adapter_config.json both ways, and one clear error for what moe_jax
does not do."""

from __future__ import annotations

import math

import pytest

from moe_jax.lora import LoraConfig

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_scaling_is_alpha_over_r_or_over_its_root_with_rslora():
    assert LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]).scaling == 2.0
    assert LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_rslora=True).scaling == 4.0
    assert math.isclose(LoraConfig(r=8, lora_alpha=8, target_parameters=EXPERTS, use_rslora=True).scaling,
                        8 / math.sqrt(8))


def test_names_are_kept_sorted_as_peft_stores_them_and_a_string_is_a_regular_expression():
    config = LoraConfig(target_modules=["v_proj", "q_proj", "q_proj"], target_parameters=EXPERTS)
    assert config.target_modules == ["q_proj", "v_proj"]
    assert config.target_parameters == sorted(EXPERTS)
    assert LoraConfig(target_modules=r".*\.q_proj").target_modules == r".*\.q_proj"


@pytest.mark.parametrize("values, message", [
    (dict(r=0), r"LoRA rank r=0 must be a positive integer"),
    (dict(r=-2), r"r=-2 must be a positive integer"),
    (dict(r=2.5), r"r=2.5 must be a positive integer"),
    (dict(lora_alpha=0), r"lora_alpha=0 must be a positive number"),
    (dict(lora_dropout=0.05), r"lora_dropout=0.05 is not supported: .* pass lora_dropout=0"),
    (dict(use_dora=True), r"DoRA \(use_dora=True\) is not supported; train plain LoRA"),
    (dict(bias="all"), r"LoRA biases .* use bias='none' \(got bias='all'\)"),
    (dict(init_lora_weights="pissa"), r"init_lora_weights='pissa' is not supported"),
    (dict(target_modules=None), r"needs target_modules .* or target_parameters"),
])
def test_bad_settings_are_refused_naming_the_value_and_the_fix(values, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**{"target_modules": ["q_proj"], **values})


def test_adapter_config_json_round_trips_with_peft_s_fields():
    config = LoraConfig(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj"], target_parameters=EXPERTS,
                        base_model_name_or_path="tiny/")
    values = config.to_peft_dict()
    assert values["peft_type"] == "LORA" and values["task_type"] == "CAUSAL_LM" and values["lora_dropout"] == 0.0
    assert LoraConfig.from_peft_dict(values) == config


def test_a_peft_config_with_an_unsupported_feature_is_refused_and_dropout_only_warned_about():
    values = LoraConfig(r=4, target_modules=["q_proj"]).to_peft_dict()
    with pytest.raises(ValueError, match=r"per-module ranks \(rank_pattern\) are not supported"):
        LoraConfig.from_peft_dict({**values, "rank_pattern": {"q_proj": 8}})
    with pytest.raises(ValueError, match=r"DoRA"):
        LoraConfig.from_peft_dict({**values, "use_dora": True})
    with pytest.raises(ValueError, match=r"peft_type 'IA3' is not LoRA"):
        LoraConfig.from_peft_dict({**values, "peft_type": "IA3"})
    with pytest.warns(UserWarning, match=r"lora_dropout=0.1 is not applied"):
        assert LoraConfig.from_peft_dict({**values, "lora_dropout": 0.1}).r == 4
