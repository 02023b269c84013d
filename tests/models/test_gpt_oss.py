"""gpt-oss: config, declared tree and resolved plans equal HF's; its router, experts and sink attention
equal straightforward references; logits equal PyTorch's (sinks, alternating sliding/full layers, YaRN,
biases). Sharded layouts: tests/models/test_fixture_parity.py and scripts/checks/check_all_layouts.py."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import MODEL_CLASSES, GptOssForCausalLM
from moe_jax.models import GptOssConfig
from moe_jax.nn.attention_core import attend
from moe_jax.ops.experts import biased_clamped_swiglu_experts
from moe_jax.ops.routing import top_k_softmax

from .hf_reference import (
    LOGITS_ATOL,
    TINY_GPT_OSS,
    assert_config_fields_match_hf,
    assert_loss_gradients_match_pytorch,
    assert_padded_batch_matches_hf,
    assert_plans_match_hf,
    assert_tree_matches_hf,
    hf_logits,
    hf_state_dict,
    perturb_vector_params,
    tiny_hf_model,
)

PLAN_LAYOUTS = [dict(tp_size=2), dict(tp_size=2, fsdp_size=4, ep_size=4)]


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torch")
    model = tiny_hf_model("gpt_oss", TINY_GPT_OSS)
    perturb_vector_params(model)
    input_ids = np.random.default_rng(0).integers(0, TINY_GPT_OSS["vocab_size"], (8, 11))
    return model, hf_state_dict(model), input_ids, hf_logits(model, input_ids)


def test_registered_and_config_defaults():
    assert MODEL_CLASSES["gpt_oss"] is GptOssForCausalLM
    config = GptOssConfig(num_hidden_layers=4)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.rope_parameters["rope_type"] == "yarn" and config.num_experts == 128
    assert GptOssConfig.from_dict({"num_experts": 16}).num_local_experts == 16
    with pytest.raises(ValueError, match="layer_types must give one of"):
        GptOssConfig(num_hidden_layers=2, layer_types=("sliding_attention",))


def test_router_takes_the_top_k_logits_then_softmax_over_them():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]])
    weights, index = top_k_softmax(logits, 2)
    assert index.tolist() == [[1, 3], [0, 2]]
    np.testing.assert_allclose(np.asarray(weights), np.asarray(jax.nn.softmax(jnp.asarray([[3.0, 2.0], [5.0, 4.0]]))),
                               rtol=1e-6)


def numpy_experts(x, ids, weights, gate_up, gate_up_bias, down, down_bias, alpha=1.702, limit=7.0):
    """HF's GptOssExperts loop: per (token, choice), interleaved gate/up, clamps, (up + 1) * glu."""
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[n, k]
            if e >= gate_up.shape[0]:
                continue
            gu = x[n] @ gate_up[e] + gate_up_bias[e]
            gate, up = np.minimum(gu[::2], limit), np.clip(gu[1::2], -limit, limit)
            glu = gate / (1 + np.exp(-alpha * gate))
            out[n] += weights[n, k] * (((up + 1) * glu) @ down[e] + down_bias[e])
    return out


def test_experts_equal_the_reference_loop_and_ignore_other_shards_choices():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 8)).astype(np.float32)
    ids = np.asarray([[0, 2], [3, 1], [1, 4], [4, 4], [2, 0], [3, 3]], np.int32)  # 4 = "not mine" with E = 4
    weights = rng.uniform(size=(6, 2)).astype(np.float32)
    params = [rng.normal(scale=2.0, size=shape).astype(np.float32) for shape in ((4, 8, 10), (4, 10), (4, 5, 8), (4, 8))]
    ours = biased_clamped_swiglu_experts(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights), *map(jnp.asarray, params))
    np.testing.assert_allclose(np.asarray(ours), numpy_experts(x, ids, weights, *params), rtol=2e-5, atol=2e-5)


def test_sinks_take_probability_mass_and_no_value():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 3, 2, 4)), jnp.float32) for _ in range(3))
    sinks = jnp.asarray([0.5, -1.0])
    out = np.asarray(attend(q, k, v, sinks=sinks))
    scale = 4 ** -0.5
    for head in range(2):
        for query in range(3):
            logits = np.asarray(q[0, query, head] @ k[0, : query + 1, head].T) * scale
            exp = np.exp(np.append(logits, sinks[head]) - max(logits.max(), float(sinks[head])))
            probs = exp[:-1] / exp.sum()
            np.testing.assert_allclose(out[0, query, head], probs @ np.asarray(v[0, : query + 1, head]), rtol=1e-5)


@pytest.mark.reference
def test_config_fields_match_hf():
    pytest.importorskip("torch")
    import transformers

    assert_config_fields_match_hf(GptOssConfig, transformers.GptOssConfig, TINY_GPT_OSS)


@pytest.mark.reference
def test_tree_matches_hf_names_shapes_and_order(reference):
    hf_model, state, _, _ = reference
    assert_tree_matches_hf(GptOssForCausalLM(TINY_GPT_OSS), hf_model, state)


@pytest.mark.reference
@pytest.mark.parametrize("layout", PLAN_LAYOUTS, ids=lambda layout: "-".join(f"{k[:2]}{v}" for k, v in layout.items()))
def test_resolved_plans_match_hf(layout):
    pytest.importorskip("torch")
    assert_plans_match_hf(GptOssForCausalLM, "gpt_oss", TINY_GPT_OSS, layout)


@pytest.mark.reference
def test_logits_and_padded_batch_match_pytorch(reference):
    hf_model, state, input_ids, expected = reference
    model = GptOssForCausalLM(TINY_GPT_OSS, DistributedConfig(tp_size=1), devices=jax.devices()[:1])
    model.set_params(state)
    np.testing.assert_allclose(np.asarray(model(input_ids)), expected, atol=LOGITS_ATOL, rtol=0)
    assert_padded_batch_matches_hf(model, hf_model, input_ids, real_tokens_only=True)


@pytest.mark.reference
def test_loss_gradients_match_pytorch_with_experts_over_8_devices(reference):
    """One step's gradients (shifted cross-entropy, as HF's loss with labels) for every parameter: sinks,
    router and expert biases included, with the experts dispatched over ep=8."""
    hf_model, state, input_ids, _ = reference
    model = GptOssForCausalLM(TINY_GPT_OSS, DistributedConfig(fsdp_size=8, ep_size=8), scan_layers=False)
    assert_loss_gradients_match_pytorch(model, hf_model, state, input_ids)
