"""The dtype sums run in: the operands' promoted dtype, never narrower than float32.

bf16 and fp16 have 8 and 11 bits of mantissa, so a sum of several of their values rounds after every add; summing
in float32 and rounding once at the end keeps the result as close to the fp32 model as the inputs allow. Used by
the grouped matmul's accumulators and by every expert combine (the weighted sum of a token's top-k outputs, on one
device and under each EP implementation), so bf16 layouts agree with each other and with one device.

`is_master` says when a parameter is stored wider than the activations it meets (mixed precision), so its
gradient sums run in its own dtype (`moe_jax.nn.precision`, the experts runner in `moe_jax.distributed`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accumulation_dtype(*dtypes) -> jnp.dtype:
    """result_type(*dtypes) widened to at least float32 (float64 stays float64)."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)


def accumulating_einsum(subscripts: str, *operands: jax.Array) -> jax.Array:
    """`jnp.einsum` that accumulates in, and returns, `accumulation_dtype` of its operands.

    On CPU, fp16 operands are widened to fp32 first: XLA:CPU has no fp16 x fp16 -> fp32 dot, and the widening
    changes nothing (fp16 -> fp32 is exact and a product of two fp16 values is exact in fp32). Elsewhere, and
    for bf16 everywhere, the operands stay as they are (the accelerators' low-precision matmuls accumulate in
    fp32)."""
    accumulate = accumulation_dtype(*(operand.dtype for operand in operands))
    if widens_fp16():
        operands = [operand.astype(jnp.float32) if operand.dtype == jnp.float16 else operand
                    for operand in operands]
    return jnp.einsum(subscripts, *operands, preferred_element_type=accumulate)


def is_master(parameter: jax.Array, activations: jax.Array) -> bool:
    """True when `parameter` is stored wider than `activations` (it is cast at use, its gradient is not). Integer
    parameters (quantised codes, `ops.quantized`) never are: they are decoded, not cast."""
    if not jnp.issubdtype(parameter.dtype, jnp.floating):
        return False
    return jnp.finfo(parameter.dtype).bits > jnp.finfo(activations.dtype).bits


def widens_fp16() -> bool:
    """Whether fp16 operands of an fp32-accumulating dot must be widened first: XLA:CPU has no fp16 x fp16 ->
    fp32 dot (the accelerators do)."""
    return jax.default_backend() == "cpu"
