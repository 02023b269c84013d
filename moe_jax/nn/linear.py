"""Affine projection with Hugging Face / PyTorch `nn.Linear` parameters.

The weight keeps PyTorch's `[out_features, in_features]` layout so checkpoints load without transposes;
the contraction is written against the input axis of that layout, which XLA folds into the matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from ..ops.accumulation import accumulating_einsum
from .precision import add_with_master, is_master, project_with_master

# (output, projection name) -> the output laid out as the model's plans say for that projection.
Constrain = Callable[[jax.Array, str], jax.Array]


def no_constraint(x: jax.Array, projection: str) -> jax.Array:
    """The default `Constrain`: leave the layout to XLA (one device, or a caller without plans)."""
    return x


def linear(params: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    """`y = x @ W.T + b`, as `torch.nn.Linear`.

    params: `{"weight": [O, I], "bias"?: [O]}` (no `"bias"` key, or `None`, means no bias).
    x: [..., I]  ->  [..., O]

    A weight wider than x (float32 masters under mixed precision) is applied in x's dtype and gets its
    gradient in its own dtype (`moe_jax.nn.precision`).

    bf16/fp16 products are summed in fp32 and rounded once, at the end. On one device that is what the
    matmul does anyway; under a plan that splits I over devices (a `rowwise` projection) it makes the
    cross-device sum of the partial products fp32 too, where a bf16 sum rounds each partial first: Llama 4's
    `rowwise` o_proj doubled the largest logit error of every tp layout (1.37e-2 against one device's and
    PyTorch's own tp=2 run's 6.4e-3). The price is that all-reduce in fp32, twice a bf16 one's bytes.
    """
    weight = params["weight"]
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: input feature size {x.shape[-1]} does not match weight shape {tuple(weight.shape)} "
            "(expected [out_features, in_features], PyTorch layout; transpose weights stored as [in, out])"
        )
    bias = params.get("bias")
    if is_master(weight, x):
        y = project_with_master(x, weight)
        return y if bias is None else add_with_master(y, bias)
    y = accumulating_einsum("...i,oi->...o", x, weight).astype(jnp.result_type(x, weight))
    if bias is not None:
        y = y + bias
    return y
