"""Hugging Face `hidden_act` names -> JAX functions with the same numerics as `transformers.activations.ACT2FN`.

Only parameter-free activations are listed: `prelu` and `xielu` own learnable parameters and are not used by
the MoE models this library reproduces.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

Activation = Callable[[jax.Array], jax.Array]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`."""
    return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def gelu_fast(x: jax.Array) -> jax.Array:
    """HF `FastGELUActivation`: the tanh approximation with the constant rounded to 0.7978845608."""
    return 0.5 * x * (1.0 + jnp.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def quick_gelu(x: jax.Array) -> jax.Array:
    """HF `QuickGELUActivation`: `x * sigmoid(1.702 x)`."""
    return x * jax.nn.sigmoid(1.702 * x)


def gelu_exact(x: jax.Array) -> jax.Array:
    """GELU with the exact erf form, as `torch.nn.functional.gelu`."""
    return jax.nn.gelu(x, approximate=False)


def relu_squared(x: jax.Array) -> jax.Array:
    """HF `ReLUSquaredActivation`: `relu(x) ** 2`."""
    return jnp.square(jax.nn.relu(x))


def laplace(x: jax.Array, mu: float = 0.707107, sigma: float = 0.282095) -> jax.Array:
    """HF `LaplaceActivation` (MEGA): `0.5 (1 + erf((x - mu) / (sigma sqrt 2)))`."""
    return 0.5 * (1.0 + jax.scipy.special.erf((x - mu) / (sigma * math.sqrt(2.0))))


def mish(x: jax.Array) -> jax.Array:
    """`x * tanh(softplus(x))`, as `torch.nn.functional.mish`."""
    return x * jnp.tanh(jax.nn.softplus(x))


def leaky_relu(x: jax.Array) -> jax.Array:
    """`torch.nn.LeakyReLU()` with its default slope 0.01."""
    return jax.nn.leaky_relu(x, negative_slope=0.01)


def hardswish(x: jax.Array) -> jax.Array:
    """`x * relu6(x + 3) / 6`, as `torch.nn.Hardswish`."""
    return x * jax.nn.relu6(x + 3.0) / 6.0


def gelu_clipped(x: jax.Array) -> jax.Array:
    """HF `gelu_10`: exact GELU clipped to [-10, 10]."""
    return jnp.clip(gelu_exact(x), -10.0, 10.0)


def sqrt_softplus(x: jax.Array) -> jax.Array:
    """HF `SqrtSoftplusActivation`: `sqrt(softplus(x))`."""
    return jnp.sqrt(jax.nn.softplus(x))


def identity(x: jax.Array) -> jax.Array:
    """HF `LinearActivation`."""
    return x


ACTIVATIONS: dict[str, Activation] = {
    "gelu": gelu_exact,
    "gelu_10": gelu_clipped,
    "gelu_accurate": gelu_tanh,
    "gelu_fast": gelu_fast,
    "gelu_new": gelu_tanh,
    "gelu_python": gelu_exact,
    "gelu_python_tanh": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "hardswish": hardswish,
    "laplace": laplace,
    "leaky_relu": leaky_relu,
    "linear": identity,
    "mish": mish,
    "quick_gelu": quick_gelu,
    "relu": jax.nn.relu,
    "relu2": relu_squared,
    "relu6": jax.nn.relu6,
    "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu,
    "sqrtsoftplus": sqrt_softplus,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


def get_activation(act: str | Activation) -> Activation:
    """The function for an HF `hidden_act` name; a callable is returned unchanged."""
    if callable(act):
        return act
    try:
        return ACTIVATIONS[act]
    except KeyError:
        raise ValueError(
            f"unknown activation {act!r} (config.hidden_act); known names: {sorted(ACTIVATIONS)}. "
            "Pass a callable instead for anything else."
        ) from None
