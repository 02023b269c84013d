"""Routers and the load-balancing loss, against NumPy and transformers' PyTorch code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.routing import (
    group_limited_sigmoid_top_k,
    load_balancing_loss,
    mixtral_top_k,
    softmax_top_k,
    top_k_softmax,
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


def test_top_k_softmax_normalises_over_the_kept_logits_only():
    logits = _logits(seed=5)
    weights, index = top_k_softmax(jnp.asarray(logits), TOP_K)
    kept = np.take_along_axis(logits, np.asarray(index), axis=1)
    np.testing.assert_array_equal(np.asarray(index), np.argsort(-logits, axis=1)[:, :TOP_K])
    np.testing.assert_allclose(np.asarray(weights), np.exp(kept) / np.exp(kept).sum(1, keepdims=True), rtol=1e-6)


def test_group_limited_routing_picks_only_from_the_best_groups():
    # 8 experts in 4 groups of 2; the bias makes group 3 (experts 6, 7) win the choice, while the weights
    # stay the unbiased sigmoid scores, renormalised and scaled.
    logits = np.asarray([[3.0, 2.9, 0.0, 0.0, -1.0, -1.0, -2.0, -2.0]], np.float32)
    bias = np.asarray([0, 0, 0, 0, 0, 0, 5.0, 5.0], np.float32)
    weights, index = group_limited_sigmoid_top_k(jnp.asarray(logits), jnp.asarray(bias), 2, num_groups=4,
                                                 top_k_groups=1, normalize=True, scaling=2.5)
    assert sorted(np.asarray(index)[0].tolist()) == [6, 7]
    np.testing.assert_allclose(np.asarray(weights), [[1.25, 1.25]], rtol=1e-6)
    with pytest.raises(ValueError, match="n_group=3 must split the 8 experts"):
        group_limited_sigmoid_top_k(jnp.asarray(logits), jnp.asarray(bias), 2, num_groups=3, top_k_groups=1,
                                    normalize=True, scaling=1.0)


@pytest.mark.reference
@pytest.mark.parametrize("normalize", [False, True])
def test_group_limited_routing_matches_deepseek_v3_router(normalize):
    torch = _torch()
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    experts = 16
    config = DeepseekV3Config(hidden_size=experts, n_routed_experts=experts, num_experts_per_tok=4, n_group=4,
                              topk_group=2, norm_topk_prob=normalize, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    bias = np.random.default_rng(7).normal(scale=0.3, size=experts).astype(np.float32)
    logits = _logits(seed=6, shape=(NUM_TOKENS, experts))
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, torch_weights, torch_index = router(torch.from_numpy(logits))
    weights, index = group_limited_sigmoid_top_k(jnp.asarray(logits), jnp.asarray(bias), 4, num_groups=4,
                                                 top_k_groups=2, normalize=normalize, scaling=2.5)
    # torch.topk(sorted=False) leaves the order of the K choices open: compare (expert, weight) sets per token.
    for ours_i, ours_w, theirs_i, theirs_w in zip(np.asarray(index), np.asarray(weights), torch_index.numpy(),
                                                  torch_weights.numpy()):
        order, theirs_order = np.argsort(ours_i), np.argsort(theirs_i)
        np.testing.assert_array_equal(ours_i[order], theirs_i[theirs_order])
        np.testing.assert_allclose(ours_w[order], theirs_w[theirs_order], rtol=1e-6)
