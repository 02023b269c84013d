"""Mixtral: config, declared tree and resolved plans equal HF's; logits equal the PyTorch reference's on one
device and on 8-device layouts (fp32 renormalised routing, explicit head_dim, sliding window on every layer);
router jitter runs only in training and needs a PRNG key."""

from dataclasses import fields

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import MODEL_CLASSES, MixtralForCausalLM
from moe_jax.models import MixtralConfig, mixtral
from moe_jax.models.mixtral import router_jitter

from .hf_reference import (
    LOGITS_ATOL,
    TINY_MIXTRAL,
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
JITTERED = {**TINY_MIXTRAL, "router_jitter_noise": 0.1}


def layout_id(layout):
    return "single" if layout is None else "-".join(f"{k.split('_')[0]}{v}" for k, v in layout.items())


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torch")
    model = tiny_hf_model("mixtral", TINY_MIXTRAL)
    perturb_vector_params(model)
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, TINY_MIXTRAL["vocab_size"], (8, 11))
    return model, hf_state_dict(model), input_ids, hf_logits(model, input_ids)


def test_registered_under_hf_model_type():
    assert MODEL_CLASSES["mixtral"] is MixtralForCausalLM


def test_num_experts_is_an_alias_of_num_local_experts():
    config = MixtralConfig.from_dict({"num_experts": 16})
    assert config.num_experts == config.num_local_experts == 16
    assert MixtralConfig(num_local_experts=4).num_experts == 4
    with pytest.raises(ValueError, match="disagree"):
        MixtralConfig.from_dict({"num_local_experts": 16, "num_experts": 8})


def test_head_dim_defaults_to_hidden_over_heads():
    assert MixtralConfig(hidden_size=64, num_attention_heads=4).head_dim == 16
    assert MixtralConfig(hidden_size=64, num_attention_heads=4, head_dim=32).head_dim == 32
    assert MixtralConfig(num_key_value_heads=None).num_key_value_heads == 32
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive"):
        MixtralConfig(sliding_window=0)


def test_router_weights_stay_float32_and_renormalised():
    model = MixtralForCausalLM({**TINY_MIXTRAL, "num_experts_per_tok": 3})
    logits = jax.random.normal(jax.random.key(0), (5, 8), jnp.bfloat16)
    weights, index = mixtral.route(model.config, logits)
    assert weights.dtype == jnp.float32 and index.shape == (5, 3)
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)


def test_router_jitter_scales_by_uniform_factor():
    x = jnp.full((4, 64, 32), 2.0, jnp.float32)
    jittered = np.asarray(router_jitter(x, jax.random.key(0), 0.1))
    assert jittered.min() >= 2.0 * 0.9 and jittered.max() <= 2.0 * 1.1 and jittered.std() > 0.05
    assert router_jitter(x.astype(jnp.bfloat16), jax.random.key(0), 0.1).dtype == jnp.bfloat16


@pytest.fixture(scope="module")
def jittered_model():
    model = MixtralForCausalLM(JITTERED)
    model.init_params(seed=0)
    return model


def test_training_jitter_without_key_raises(jittered_model):
    with pytest.raises(ValueError, match="needs a PRNG key"):
        jittered_model(np.zeros((1, 4), np.int32), inference=False)


def test_training_forward_takes_a_key_and_is_reproducible(jittered_model):
    input_ids = np.random.default_rng(0).integers(0, 128, (2, 6))
    first = jittered_model(input_ids, inference=False, rng=jax.random.key(3))
    again = jittered_model(input_ids, inference=False, rng=jax.random.key(3))
    other = jittered_model(input_ids, inference=False, rng=jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert not np.allclose(first, other, atol=1e-5)


def test_training_jitter_with_key_perturbs_the_moe_input(jittered_model):
    model = jittered_model
    input_ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 6)), jnp.int32)

    @jax.jit
    def logits(params, key):
        jittered = model.apply(params, input_ids, inference=False, rng=key).logits
        plain = model.apply(params, input_ids, inference=True, rng=key).logits  # inference ignores the key
        return jittered, plain

    (first, plain), (again, _), (other, _) = (logits(model.params, jax.random.key(seed)) for seed in (0, 0, 1))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert not np.allclose(first, plain, atol=1e-5) and not np.allclose(first, other, atol=1e-5)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(model(input_ids)), atol=1e-6, rtol=0)


@pytest.mark.reference
def test_config_defaults_and_fields_match_hf():
    pytest.importorskip("torch")
    import transformers

    for values in ({}, TINY_MIXTRAL):
        hf = transformers.MixtralConfig(**values)
        for ours in (MixtralConfig.from_dict(hf.to_dict()), MixtralConfig.from_dict(values)):
            for name in [f.name for f in fields(ours) if f.name != "raw" and hasattr(hf, f.name)]:
                expected = getattr(hf, name)
                if name == "head_dim":  # HF resolves a None head_dim in the attention module
                    expected = expected or hf.hidden_size // hf.num_attention_heads
                assert getattr(ours, name) == expected, name
            assert ours.num_experts == hf.num_experts


@pytest.mark.reference
def test_tree_matches_hf_names_shapes_and_order(reference):
    hf_model, state, _, _ = reference
    assert_tree_matches_hf(MixtralForCausalLM(TINY_MIXTRAL), hf_model, state)


@pytest.mark.reference
@pytest.mark.parametrize("layout", PLAN_LAYOUTS, ids=layout_id)
def test_resolved_plans_match_hf(layout):
    pytest.importorskip("torch")
    assert_plans_match_hf(MixtralForCausalLM, "mixtral", TINY_MIXTRAL, layout)


@pytest.mark.reference
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_logits_match_pytorch(reference, layout):
    _, state, input_ids, expected = reference
    model = MixtralForCausalLM(TINY_MIXTRAL, DistributedConfig(**layout) if layout else None)
    model.set_params(state)
    np.testing.assert_allclose(np.asarray(model(input_ids)), expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.reference
def test_padding_mask_logits_and_aux_loss_match_pytorch_without_jitter_at_inference(reference):
    hf_model, state, input_ids, _ = reference
    # HF's eval mode never jitters: router_jitter_noise > 0 changes nothing at inference.
    model = MixtralForCausalLM(JITTERED)
    model.set_params(state)
    assert_padded_batch_matches_hf(model, hf_model, input_ids)
