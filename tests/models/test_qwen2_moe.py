"""Qwen2-MoE: config, declared tree and resolved plans equal HF's; logits equal the PyTorch reference's on one
device and on 8-device layouts (shared expert, q/k/v bias, per-layer sliding window)."""

from dataclasses import fields

import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import MODEL_CLASSES, Qwen2MoeForCausalLM
from moe_jax.models import Qwen2MoeConfig

from .hf_reference import (
    LOGITS_ATOL,
    TINY_QWEN2_MOE,
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
    model = tiny_hf_model("qwen2_moe", TINY_QWEN2_MOE)
    perturb_vector_params(model)
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, TINY_QWEN2_MOE["vocab_size"], (8, 11))
    return model, hf_state_dict(model), input_ids, hf_logits(model, input_ids)


def test_registered_under_hf_model_type():
    assert MODEL_CLASSES["qwen2_moe"] is Qwen2MoeForCausalLM


def test_config_sliding_window_follows_hf_post_init():
    off = Qwen2MoeConfig(num_hidden_layers=4, sliding_window=4096)
    assert off.sliding_window == 0 and off.layer_types == ("full_attention",) * 4
    assert [off.attention_window(i) for i in range(4)] == [None] * 4
    on = Qwen2MoeConfig(num_hidden_layers=5, use_sliding_window=True, sliding_window=7, max_window_layers=3)
    assert on.layer_types == ("sliding_attention", "full_attention", "sliding_attention", "full_attention",
                              "full_attention")
    assert [on.attention_window(i) for i in range(5)] == [7, None, 7, None, None]
    with pytest.raises(ValueError, match="sliding_attention.*sliding_window=0"):
        Qwen2MoeConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        Qwen2MoeConfig(num_hidden_layers=2, layer_types=["full_attention"])


def test_shared_expert_has_no_tp_rule():
    model = Qwen2MoeForCausalLM(TINY_QWEN2_MOE, DistributedConfig(tp_size=2, fsdp_size=4))
    assert not [name for name in model.resolved_plans.tp if "shared_expert" in name]
    assert model.resolved_plans.tp["model.layers.0.mlp.gate_proj"] == "colwise"


@pytest.mark.reference
def test_config_defaults_and_fields_match_hf():
    pytest.importorskip("torch")
    import transformers

    for values in ({}, TINY_QWEN2_MOE):
        hf = transformers.Qwen2MoeConfig(**values)
        for ours in (Qwen2MoeConfig.from_dict(hf.to_dict()), Qwen2MoeConfig.from_dict(values)):
            for name in [f.name for f in fields(ours) if f.name != "raw" and hasattr(hf, f.name)]:
                expected = getattr(hf, name)
                assert getattr(ours, name) == (tuple(expected) if isinstance(expected, list) else expected), name


@pytest.mark.reference
def test_tree_matches_hf_names_shapes_and_order(reference):
    hf_model, state, _, _ = reference
    assert_tree_matches_hf(Qwen2MoeForCausalLM(TINY_QWEN2_MOE), hf_model, state)


@pytest.mark.reference
@pytest.mark.parametrize("layout", PLAN_LAYOUTS, ids=layout_id)
def test_resolved_plans_match_hf(layout):
    pytest.importorskip("torch")
    assert_plans_match_hf(Qwen2MoeForCausalLM, "qwen2_moe", TINY_QWEN2_MOE, layout)


@pytest.mark.reference
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_logits_match_pytorch(reference, layout):
    _, state, input_ids, expected = reference
    model = Qwen2MoeForCausalLM(TINY_QWEN2_MOE, DistributedConfig(**layout) if layout else None)
    model.set_params(state)
    np.testing.assert_allclose(np.asarray(model(input_ids)), expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.reference
def test_padding_mask_logits_and_aux_loss_match_pytorch(reference):
    hf_model, state, input_ids, _ = reference
    model = Qwen2MoeForCausalLM(TINY_QWEN2_MOE)
    model.set_params(state)
    # Padded queries whose window holds only padding see no key: their output is meaningless on both sides.
    assert_padded_batch_matches_hf(model, hf_model, input_ids, real_tokens_only=True)
