"""Routing replay in every router of `ops.routing`: recorded ids replace the top-k, the weights are each family's
rule at them (against NumPy), rows of -1 route as without replay, and gradients reach the logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.routing import (
    group_limited_sigmoid_top_k,
    mixtral_top_k,
    replayed_choice,
    softmax_top_k,
    top_k_sigmoid,
    top_k_softmax,
)

TOKENS, EXPERTS, TOP_K = 12, 8, 2
BIAS = np.linspace(-0.3, 0.3, EXPERTS).astype(np.float32)


def _softmax(x):
    shifted = np.exp(x - x.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _renormalised(w):
    return w / w.sum(-1, keepdims=True)


# name -> (router(logits, replay), each family's weights at given ids in NumPy: (logits [T, E], ids [T, K]) -> [T, K])
ROUTERS = {
    "softmax_norm": (lambda x, r: softmax_top_k(x, TOP_K, True, replay=r),
                     lambda x, i: _renormalised(np.take_along_axis(_softmax(x), i, -1))),
    "softmax": (lambda x, r: softmax_top_k(x, TOP_K, False, replay=r),
                lambda x, i: np.take_along_axis(_softmax(x), i, -1)),
    "mixtral": (lambda x, r: mixtral_top_k(x, TOP_K, replay=r),
                lambda x, i: _renormalised(np.take_along_axis(_softmax(x), i, -1))),
    "gpt_oss": (lambda x, r: top_k_softmax(x, TOP_K, replay=r), lambda x, i: _softmax(np.take_along_axis(x, i, -1))),
    "llama4": (lambda x, r: top_k_sigmoid(x, TOP_K, replay=r), lambda x, i: _sigmoid(np.take_along_axis(x, i, -1))),
    "deepseek_v3": (lambda x, r: group_limited_sigmoid_top_k(x, jnp.asarray(BIAS), TOP_K, num_groups=4, top_k_groups=2,
                                                              normalize=True, scaling=2.5, replay=r),
                    lambda x, i: 2.5 * _renormalised(np.take_along_axis(_sigmoid(x), i, -1))),
}


def _logits(seed=0):
    return np.random.default_rng(seed).standard_normal((TOKENS, EXPERTS)).astype(np.float32)


def _other_experts(index, seed=1):
    """Distinct ids per row, none of them the router's own first choice."""
    rng = np.random.default_rng(seed)
    rows = []
    for own in np.asarray(index):
        choices = [e for e in range(EXPERTS) if e != own[0]]
        rows.append(rng.choice(choices, TOP_K, replace=False))
    return np.asarray(rows, np.int32)


@pytest.mark.parametrize("name", ROUTERS)
def test_replaying_the_routers_own_choice_changes_nothing(name):
    route, _ = ROUTERS[name]
    logits = jnp.asarray(_logits())
    weights, index = route(logits, None)
    replayed_weights, replayed_index = route(logits, index)
    np.testing.assert_array_equal(np.asarray(replayed_index), np.asarray(index))
    np.testing.assert_array_equal(np.asarray(replayed_weights), np.asarray(weights))


@pytest.mark.parametrize("name", ROUTERS)
def test_replayed_ids_are_weighted_by_the_family_rule_and_unrecorded_rows_route(name):
    route, numpy_weights = ROUTERS[name]
    logits = _logits()
    own_weights, own_index = route(jnp.asarray(logits), None)
    replay = _other_experts(own_index)
    replay[::3] = -1                                          # every third token has no record
    weights, index = route(jnp.asarray(logits), jnp.asarray(replay))
    recorded = replay[:, 0] >= 0
    np.testing.assert_array_equal(np.asarray(index)[recorded], replay[recorded])
    np.testing.assert_array_equal(np.asarray(index)[~recorded], np.asarray(own_index)[~recorded])
    np.testing.assert_allclose(np.asarray(weights)[recorded], numpy_weights(logits, replay)[recorded], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(weights)[~recorded], np.asarray(own_weights)[~recorded])


@pytest.mark.parametrize("name", ["softmax_norm", "gpt_oss", "deepseek_v3"])
def test_gradients_reach_the_logits_through_the_replayed_weights(name):
    route, _ = ROUTERS[name]
    logits = jnp.asarray(_logits())
    replay = jnp.asarray(_other_experts(route(logits, None)[1]))
    probe = jnp.asarray(np.random.default_rng(2).standard_normal((TOKENS, TOP_K)), jnp.float32)
    loss = lambda x: jnp.sum(route(x, replay)[0] * probe)  # noqa: E731
    grad = np.asarray(jax.grad(loss)(logits))
    assert np.abs(grad).max() > 1e-3
    # Central differences on a few logits (float32: a loose tolerance).
    for token, expert in [(0, int(replay[0, 0])), (5, int(replay[5, 1])), (7, 3)]:
        step = jnp.zeros_like(logits).at[token, expert].set(1e-2)
        numeric = (loss(logits + step) - loss(logits - step)) / 2e-2
        np.testing.assert_allclose(grad[token, expert], float(numeric), atol=2e-3)


def test_replay_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"must be \[T, K\] = \(12, 2\) per layer, got \(12, 3\)"):
        replayed_choice(jnp.zeros((TOKENS, TOP_K), jnp.int32), jnp.zeros((TOKENS, 3), jnp.int32))
