"""Routers and the load-balancing loss, against NumPy and transformers' PyTorch code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.routing import (
    load_balancing_loss,
    mixtral_top_k,
    softmax_top_k,
)

NUM_TOKENS, NUM_EXPERTS, TOP_K = 24, 8, 2


def _logits(seed=0, shape=(NUM_TOKENS, NUM_EXPERTS), dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _numpy_route(logits, top_k, normalize):
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    probs = shifted / shifted.sum(-1, keepdims=True)
    index = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, index, axis=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, index


@pytest.mark.parametrize("normalize", [False, True])
def test_softmax_top_k_matches_numpy(normalize):
    logits = _logits()
    weights, index = softmax_top_k(jnp.asarray(logits), TOP_K, normalize)
    want_weights, want_index = _numpy_route(logits.astype(np.float64), TOP_K, normalize)
    assert index.dtype == jnp.int32 and index.shape == (NUM_TOKENS, TOP_K)
    np.testing.assert_array_equal(np.asarray(index), want_index)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-6, atol=1e-7)


def test_softmax_top_k_casts_weights_back_to_logits_dtype():
    logits = jnp.asarray(_logits(), jnp.bfloat16)
    weights, _ = softmax_top_k(logits, TOP_K, normalize=True)
    assert weights.dtype == jnp.bfloat16


def test_mixtral_top_k_keeps_fp32_and_renormalises():
    logits = jnp.asarray(_logits(), jnp.bfloat16)
    weights, index = mixtral_top_k(logits, TOP_K)
    assert weights.dtype == jnp.float32 and index.dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
    want_weights, want_index = _numpy_route(np.asarray(logits, np.float64), TOP_K, normalize=True)
    np.testing.assert_array_equal(np.asarray(index), want_index)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-6)


def test_ties_go_to_the_lower_expert_id():
    logits = jnp.asarray([[0.0, 2.0, 2.0, 1.0, 2.0]], jnp.float32)
    _, index = softmax_top_k(logits, 2, normalize=False)
    np.testing.assert_array_equal(np.asarray(index), [[1, 2]])


@pytest.mark.parametrize("top_k", [0, NUM_EXPERTS + 1])
def test_bad_top_k_names_the_value(top_k):
    with pytest.raises(ValueError, match=f"top_k={top_k}"):
        softmax_top_k(jnp.asarray(_logits()), top_k, normalize=True)


def test_load_balancing_loss_accepts_list_or_stacked_layers():
    layers = [jnp.asarray(_logits(seed)) for seed in range(3)]
    from_list = load_balancing_loss(layers, NUM_EXPERTS, TOP_K)
    from_stack = load_balancing_loss(jnp.stack(layers), NUM_EXPERTS, TOP_K)
    np.testing.assert_allclose(np.asarray(from_list), np.asarray(from_stack), rtol=1e-7)
    assert float(load_balancing_loss(None, NUM_EXPERTS, TOP_K)) == 0.0


def test_load_balancing_loss_of_perfectly_balanced_routing_is_one():
    # Every expert wins exactly T/E tokens with probability ~1, so both per-expert
    # fractions are 1/E and the loss is E * E * (1/E)^2 = 1.
    eye = np.tile(np.eye(NUM_EXPERTS, dtype=np.float32) * 50.0, (3, 1))
    loss = load_balancing_loss([jnp.asarray(eye)], NUM_EXPERTS, top_k=1)
    np.testing.assert_allclose(float(loss), 1.0, rtol=1e-5)


def test_load_balancing_loss_rejects_mismatched_mask():
    with pytest.raises(ValueError, match="attention_mask has 5 entries"):
        load_balancing_loss([jnp.asarray(_logits())], NUM_EXPERTS, TOP_K, attention_mask=jnp.ones((5,)))


# ---- live comparison with transformers ---------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.reference
@pytest.mark.parametrize("normalize", [False, True])
def test_softmax_top_k_matches_qwen3_moe_router(normalize):
    torch = _torch()
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    # hidden_size == num_experts with an identity router weight turns hidden states
    # into router logits, so the router's own code routes our logits.
    config = Qwen3MoeConfig(
        hidden_size=NUM_EXPERTS, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=normalize
    )
    router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(NUM_EXPERTS))
        logits = _logits(seed=3)
        _, torch_weights, torch_index = router(torch.from_numpy(logits))
    weights, index = softmax_top_k(jnp.asarray(logits), TOP_K, normalize)
    np.testing.assert_array_equal(np.asarray(index), torch_index.numpy())
    np.testing.assert_allclose(np.asarray(weights), torch_weights.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.reference
def test_mixtral_top_k_matches_mixtral_router():
    torch = _torch()
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = MixtralConfig(hidden_size=NUM_EXPERTS, num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    router = MixtralTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(NUM_EXPERTS))
        logits = _logits(seed=4)
        _, torch_weights, torch_index = router(torch.from_numpy(logits))
    weights, index = mixtral_top_k(jnp.asarray(logits), TOP_K)
    assert torch_weights.dtype == torch.float32
    np.testing.assert_array_equal(np.asarray(index), torch_index.numpy())
    np.testing.assert_allclose(np.asarray(weights), torch_weights.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.reference
@pytest.mark.parametrize("with_mask", [False, True])
def test_load_balancing_loss_and_gradient_match_transformers(with_mask):
    torch = _torch()
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    batch, sequence, layers = 3, 8, 4
    logits = _logits(seed=5, shape=(layers, batch * sequence, NUM_EXPERTS))
    mask = np.ones((batch, sequence), np.int64)
    mask[0, :3] = 0  # left padding
    mask[2, 6:] = 0  # right padding

    torch_layers = tuple(torch.tensor(layer, requires_grad=True) for layer in logits)
    torch_mask = torch.from_numpy(mask) if with_mask else None
    torch_loss = load_balancing_loss_func(torch_layers, NUM_EXPERTS, TOP_K, torch_mask)
    torch_loss.backward()

    jax_mask = jnp.asarray(mask) if with_mask else None

    def loss_of(stacked):
        return load_balancing_loss(stacked, NUM_EXPERTS, TOP_K, attention_mask=jax_mask)

    loss, grad = jax.value_and_grad(loss_of)(jnp.asarray(logits))
    np.testing.assert_allclose(float(loss), torch_loss.item(), rtol=1e-6)
    torch_grad = np.stack([layer.grad.numpy() for layer in torch_layers])
    np.testing.assert_allclose(np.asarray(grad), torch_grad, rtol=1e-5, atol=1e-8)
