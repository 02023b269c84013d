"""Master parameters under mixed precision: applied in the activations' dtype, gradients in their own."""

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.nn.linear import linear
from moe_jax.nn.precision import is_master

KEY = jax.random.key(0)


def _bf16(shape, seed):
    return jax.random.normal(jax.random.fold_in(KEY, seed), shape, jnp.float32).astype(jnp.bfloat16)


def test_only_a_wider_parameter_is_a_master():
    assert is_master(jnp.zeros(2, jnp.float32), jnp.zeros(2, jnp.bfloat16))
    assert not is_master(jnp.zeros(2, jnp.bfloat16), jnp.zeros(2, jnp.bfloat16))
    assert not is_master(jnp.zeros(2, jnp.float16), jnp.zeros(2, jnp.bfloat16))


def test_linear_applies_a_master_in_the_input_dtype_and_returns_float32_gradients():
    x = _bf16((4, 6, 8), 1)                                     # [B, S, I]
    weight = jax.random.normal(jax.random.fold_in(KEY, 2), (5, 8), jnp.float32)
    bias = jax.random.normal(jax.random.fold_in(KEY, 3), (5,), jnp.float32)
    out = linear({"weight": weight, "bias": bias}, x)
    expected = linear({"weight": weight.astype(jnp.bfloat16), "bias": bias.astype(jnp.bfloat16)}, x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), expected.astype(jnp.float32), atol=3e-2)

    cotangent = _bf16((4, 6, 5), 4)

    def loss(params, x):
        return jnp.sum(linear(params, x).astype(jnp.float32) * cotangent.astype(jnp.float32))

    grads, x_grad = jax.grad(loss, argnums=(0, 1))({"weight": weight, "bias": bias}, x)
    assert grads["weight"].dtype == grads["bias"].dtype == jnp.float32 and x_grad.dtype == jnp.bfloat16
    g = cotangent.astype(jnp.float32).reshape(-1, 5)
    # The weight gradient is the float32 sum over all 24 tokens of bf16 x bf16 products: no bf16 rounding.
    np.testing.assert_allclose(grads["weight"], g.T @ x.astype(jnp.float32).reshape(-1, 8), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grads["bias"], g.sum(0), rtol=1e-6)
    np.testing.assert_allclose(x_grad.astype(jnp.float32),
                               (g @ weight.astype(jnp.bfloat16).astype(jnp.float32)).reshape(4, 6, 8), atol=3e-2)
