"""Affine projection with Hugging Face / PyTorch `nn.Linear` parameters.

The weight keeps PyTorch's `[out_features, in_features]` layout so checkpoints load without transposes;
the contraction is written against the input axis of that layout, which XLA folds into the matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

# (output, projection name) -> the output laid out as the model's plans say for that projection.
Constrain = Callable[[jax.Array, str], jax.Array]


def no_constraint(x: jax.Array, projection: str) -> jax.Array:
    """The default `Constrain`: leave the layout to XLA (one device, or a caller without plans)."""
    return x


def linear(params: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    """`y = x @ W.T + b`, as `torch.nn.Linear`.

    params: `{"weight": [O, I], "bias"?: [O]}` (no `"bias"` key, or `None`, means no bias).
    x: [..., I]  ->  [..., O]
    """
    weight = params["weight"]
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: input feature size {x.shape[-1]} does not match weight shape {tuple(weight.shape)} "
            "(expected [out_features, in_features], PyTorch layout; transpose weights stored as [in, out])"
        )
    y = jnp.einsum("...i,oi->...o", x, weight)
    bias = params.get("bias")
    if bias is not None:
        y = y + bias
    return y
