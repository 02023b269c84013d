"""RMSNorm as Hugging Face's Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral implement it.

All four (`Qwen3MoeRMSNorm`, `Qwen2MoeRMSNorm`, `OlmoeRMSNorm`, `MixtralRMSNorm`) do the same thing:
normalise in float32, cast the normalised value back to the input dtype, *then* multiply by the weight.
The cast-before-multiply order matters in bf16: the product is rounded once more than "multiply in fp32,
cast once" would be. A float32 weight on bfloat16 input is a mixed-precision master copy here: applied in
bfloat16, as the reference's FSDP2 `param_dtype` casts it (where plain torch would promote to float32).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from .precision import is_master, scale_with_master


def rms_norm(params: Mapping[str, jax.Array], x: jax.Array, eps: float) -> jax.Array:
    """`weight * (x / sqrt(mean(x**2) + eps))`, normalised over the last axis.

    params: `{"weight": [H]}`
    x: [..., H]  ->  [..., H] in x's dtype when the weight is a wider master copy (mixed precision: applied
    in x's dtype, gradient in its own, `moe_jax.nn.precision`); otherwise `promote(weight.dtype, x.dtype)`.
    """
    weight = params["weight"]
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"rms_norm: last axis of x has size {x.shape[-1]} but weight has shape {tuple(weight.shape)}; "
            "pass the norm's own parameters (e.g. q_norm over head_dim for Qwen3, over the full projection for OLMoE)"
        )
    input_dtype = x.dtype
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normalized = x32 * jax.lax.rsqrt(variance + eps)
    if is_master(weight, x):
        return scale_with_master(weight, normalized.astype(input_dtype))
    return weight * normalized.astype(input_dtype)


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """Llama 4's parameter-free q/k norm (`Llama4TextL2Norm`): x * rsqrt(mean(x^2) + eps) over the last axis,
    in float32, cast back to x's dtype. x: [..., D]"""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
