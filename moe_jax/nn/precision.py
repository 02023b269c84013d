"""Parameters wider than the activations they meet: master weights under mixed precision.

With mixed precision (float32 parameters, bfloat16 activations) a parameter is applied in the activations'
dtype, and its gradient is accumulated — and reduced across devices — in its own dtype. That is the
reference's FSDP2 policy (`param_dtype=bfloat16`, `reduce_dtype=float32`, SPEC §6).

Why a custom VJP: a weight gradient is a sum over tokens, and with the batch split over devices the
partitioner reduces the per-device partial sums right where the contraction produces them, in the
contraction's output dtype. Casting the parameter to bfloat16 before use makes that contraction bfloat16,
so the cross-device sum would be too; here the contraction that produces the weight gradient accumulates
and returns float32, so every reduction after it is float32. Forward and input-gradient matmuls stay
bfloat16 x bfloat16 with float32 accumulation (what the hardware does anyway).

Same-dtype parameters take the plain path, so full-precision and pure-bfloat16 runs are unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# In ops so the experts runner (moe_jax.distributed, a layer below nn) asks the same question.
from ..ops.accumulation import is_master  # noqa: F401

WIDE = jnp.float32


def _marker(parameter: jax.Array) -> jax.Array:
    """A scalar carrying the parameter's dtype into the backward pass (residuals hold arrays only)."""
    return jnp.zeros((), parameter.dtype)


@jax.custom_vjp
def project_with_master(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x: [..., I], weight: [O, I] (wider than x) -> [..., O] in x's dtype."""
    return jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype), preferred_element_type=WIDE).astype(x.dtype)


def _project_forward(x, weight):
    cast = weight.astype(x.dtype)
    y = jnp.einsum("...i,oi->...o", x, cast, preferred_element_type=WIDE).astype(x.dtype)
    return y, (x, cast, _marker(weight))


def _project_backward(residuals, g):
    x, cast, marker = residuals
    dx = jnp.einsum("...o,oi->...i", g, cast, preferred_element_type=WIDE).astype(x.dtype)
    tokens_g = g.reshape(-1, g.shape[-1])
    tokens_x = x.reshape(-1, x.shape[-1])
    dw = jnp.einsum("no,ni->oi", tokens_g, tokens_x, preferred_element_type=WIDE).astype(marker.dtype)
    return dx, dw


project_with_master.defvjp(_project_forward, _project_backward)


@jax.custom_vjp
def scale_with_master(weight: jax.Array, x: jax.Array) -> jax.Array:
    """weight: [H] (wider than x), x: [..., H] -> `weight * x` in x's dtype (a norm's scale)."""
    return weight.astype(x.dtype) * x


def _scale_forward(weight, x):
    return weight.astype(x.dtype) * x, (weight.astype(x.dtype), x, _marker(weight))


def _scale_backward(residuals, g):
    cast, x, marker = residuals
    leading = tuple(range(x.ndim - 1))
    dw = jnp.sum(g.astype(WIDE) * x.astype(WIDE), axis=leading).astype(marker.dtype)
    return dw, (g * cast).astype(x.dtype)


scale_with_master.defvjp(_scale_forward, _scale_backward)


@jax.custom_vjp
def add_with_master(x: jax.Array, bias: jax.Array) -> jax.Array:
    """x: [..., O], bias: [O] (wider than x) -> `x + bias` in x's dtype."""
    return x + bias.astype(x.dtype)


def _add_forward(x, bias):
    return x + bias.astype(x.dtype), _marker(bias)


def _add_backward(marker, g):
    leading = tuple(range(g.ndim - 1))
    return g, jnp.sum(g.astype(WIDE), axis=leading).astype(marker.dtype)


add_with_master.defvjp(_add_forward, _add_backward)
