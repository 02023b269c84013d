"""Affine projection with Hugging Face / PyTorch `nn.Linear` parameters.

The weight keeps PyTorch's `[out_features, in_features]` layout so checkpoints load without transposes;
the contraction is written against the input axis of that layout, which XLA folds into the matmul.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from ..ops.accumulation import accumulating_einsum
from ..ops.lora import AdapterRows, LoraFactors, per_token_low_rank
from ..ops.quantized import linear_weight
from .precision import add_with_master, is_master, project_with_master

# (activation, one logical axis name per dim, e.g. ("batch", "length", "heads")) -> the activation laid out as
# the model's rules map those names (`moe_jax.distributed.activations`).
Constrain = Callable[[jax.Array, tuple[str | None, ...]], jax.Array]


def no_constraint(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """The default `Constrain`: leave the layout to XLA (one device, or a caller without plans)."""
    return x


def linear(params: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    """`y = x @ W.T + b`, as `torch.nn.Linear`; plus a LoRA adapter's update where the params carry one.

    params: `{"weight": [O, I], "bias"?: [O], "lora"?: {"weight": LoraFactors}}` (no `"bias"` key, or `None`,
    means no bias; `"lora"`: an adapter attached to the weight, `moe_jax.ops.lora`).
    x: [..., I]  ->  [..., O]

    A weight wider than x (float32 masters under mixed precision) is applied in x's dtype and gets its
    gradient in its own dtype (`moe_jax.nn.precision`).

    A bf16/fp16 projection sums in fp32 and rounds once (`_project_summing_wide`).
    """
    weight = linear_weight(params, x.dtype)   # kept FP8 codes are decoded here, where they are used
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: input feature size {x.shape[-1]} does not match weight shape {tuple(weight.shape)} "
            "(expected [out_features, in_features], PyTorch layout; transpose weights stored as [in, out])"
        )
    bias = params.get("bias")
    if is_master(weight, x):
        y = project_with_master(x, weight)
        y = y if bias is None else add_with_master(y, bias)
    else:
        low_precision = _is_low_precision(x, weight)
        y = _project_summing_wide(x, weight) if low_precision else jnp.einsum("...i,oi->...o", x, weight)
        if bias is not None:
            y = y + bias
    factors = params.get("lora", {}).get("weight")
    if isinstance(factors, AdapterRows):
        update = per_token_low_rank(factors, x)
        return y if update is None else y + update
    return y if factors is None else y + low_rank_update(factors, x)


def low_rank_update(factors: LoraFactors, x: jax.Array) -> jax.Array:
    """PEFT's `lora.Linear` update, scaling * (x A^T) B^T: x [..., I], A [r, I], B [O, r] -> [..., O], each
    factor applied as a projection (float32 masters under mixed precision keep float32 gradients)."""
    rank_features = linear({"weight": factors.a}, x)
    return linear({"weight": factors.b}, rank_features) * jnp.asarray(factors.scaling, x.dtype)


def _is_low_precision(x: jax.Array, weight: jax.Array) -> bool:
    return jnp.finfo(jnp.result_type(x, weight)).bits < 32


@jax.custom_vjp
def _project_summing_wide(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x: [..., I], weight: [O, I], both bf16 (or fp16) -> [..., O]: the products summed in fp32, rounded once.

    On one device that is what the matmul does anyway. Under a plan that splits I over devices (a `rowwise`
    projection) it makes the cross-device sum of the partial products fp32 too, where a bf16 sum rounds each
    partial first: Llama 4's rowwise o_proj doubled the largest logit error of every tp layout (1.37e-2
    against one device's and PyTorch's own tp=2 run's 6.4e-3). The price is that all-reduce in fp32, twice a
    bf16 one's bytes. The backward pass is the plain one (bf16 matmuls, gradients summed as before), which a
    VJP of the widened einsum would not be: its fp32 cotangent would make both gradient matmuls fp32.
    """
    return accumulating_einsum("...i,oi->...o", x, weight).astype(x.dtype)


def _project_forward(x, weight):
    return _project_summing_wide(x, weight), (x, weight)


def _project_backward(residuals, g):
    x, weight = residuals
    dx = jnp.einsum("...o,oi->...i", g, weight)
    dw = jnp.einsum("...o,...i->oi", g, x)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_project_summing_wide.defvjp(_project_forward, _project_backward)
