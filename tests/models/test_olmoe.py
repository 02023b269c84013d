"""OLMoE: config, declared tree and resolved plans equal HF's; logits equal the PyTorch reference's on one
device and on 8-device layouts (full-width q/k norms, clip_qkv, gathered-output attention TP plan)."""

from dataclasses import fields

import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import MODEL_CLASSES, OlmoeForCausalLM
from moe_jax.models import OlmoeConfig

from .hf_reference import (
    LOGITS_ATOL,
    TINY_OLMOE,
    assert_padded_batch_matches_hf,
    assert_plans_match_hf,
    assert_tree_matches_hf,
    hf_logits,
    hf_state_dict,
    perturb_vector_params,
    tiny_hf_model,
)

# Live comparisons with PyTorch on one device and one mixed layout; the other layouts are compared with
# committed PyTorch logits in test_fixture_parity.py (no torch needed there).
# Live against torch on one device; sharded layouts are compared with the committed reference fixtures
# (tests/models/test_fixture_parity.py) and, every layout, by scripts/checks/check_all_layouts.py.
LAYOUTS = [None]
PLAN_LAYOUTS = [dict(tp_size=2), dict(tp_size=2, fsdp_size=4, ep_size=4)]


def layout_id(layout):
    return "single" if layout is None else "-".join(f"{k.split('_')[0]}{v}" for k, v in layout.items())


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torch")
    model = tiny_hf_model("olmoe", TINY_OLMOE)
    perturb_vector_params(model)
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, TINY_OLMOE["vocab_size"], (8, 11))
    return model, hf_state_dict(model), input_ids, hf_logits(model, input_ids)


def test_registered_under_hf_model_type():
    assert MODEL_CLASSES["olmoe"] is OlmoeForCausalLM


def test_num_local_experts_is_an_alias_of_num_experts():
    config = OlmoeConfig.from_dict({"num_local_experts": 16})
    assert config.num_experts == config.num_local_experts == 16
    assert OlmoeConfig(num_experts=12).num_local_experts == 12
    with pytest.raises(ValueError, match="disagree"):
        OlmoeConfig.from_dict({"num_local_experts": 16, "num_experts": 8})


def test_head_dim_must_split_hidden_size():
    assert OlmoeConfig(hidden_size=64, num_attention_heads=4).head_dim == 16
    assert OlmoeConfig().num_key_value_heads == OlmoeConfig().num_attention_heads
    with pytest.raises(ValueError, match="head_dim must be hidden_size // num_attention_heads"):
        OlmoeConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32})


def test_attention_tp_plan_gathers_outputs():
    model = OlmoeForCausalLM(TINY_OLMOE, DistributedConfig(tp_size=2, fsdp_size=4))
    tp = model.resolved_plans.tp
    assert tp["model.layers.0.self_attn.q_proj.weight"] == "colwise_gather_output"
    assert tp["model.layers.0.self_attn.o_proj.weight"] == "rowwise_split_input"
    assert tp["model.layers.0.mlp.experts"] == "moe_tp_experts"


@pytest.mark.reference
def test_config_defaults_and_fields_match_hf():
    pytest.importorskip("torch")
    import transformers

    for values in ({}, TINY_OLMOE):
        hf = transformers.OlmoeConfig(**values)
        for ours in (OlmoeConfig.from_dict(hf.to_dict()), OlmoeConfig.from_dict(values)):
            for name in [f.name for f in fields(ours) if f.name != "raw" and hasattr(hf, f.name)]:
                assert getattr(ours, name) == getattr(hf, name), name
            assert ours.num_local_experts == hf.num_local_experts


@pytest.mark.reference
def test_tree_matches_hf_names_shapes_and_order(reference):
    hf_model, state, _, _ = reference
    assert_tree_matches_hf(OlmoeForCausalLM(TINY_OLMOE), hf_model, state)


@pytest.mark.reference
@pytest.mark.parametrize("layout", PLAN_LAYOUTS, ids=layout_id)
def test_resolved_plans_match_hf(layout):
    pytest.importorskip("torch")
    assert_plans_match_hf(OlmoeForCausalLM, "olmoe", TINY_OLMOE, layout)


@pytest.mark.reference
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_logits_match_pytorch(reference, layout):
    _, state, input_ids, expected = reference
    model = OlmoeForCausalLM(TINY_OLMOE, DistributedConfig(**layout) if layout else None)
    model.set_params(state)
    np.testing.assert_allclose(np.asarray(model(input_ids)), expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.reference
def test_padding_mask_logits_and_aux_loss_match_pytorch(reference):
    hf_model, state, input_ids, _ = reference
    model = OlmoeForCausalLM(TINY_OLMOE)
    model.set_params(state)
    assert_padded_batch_matches_hf(model, hf_model, input_ids)
