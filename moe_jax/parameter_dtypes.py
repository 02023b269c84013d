"""Which dtypes a model's parameters may have, by name or dtype object.

    parameter_dtype("bfloat16")            # dtype(bfloat16)
    parameter_dtype("int8")                # ValueError naming the supported dtypes

One check for every way a dtype arrives (`from_pretrained(dtype=...)`, config.json's `dtype`, `moe-jax convert
--dtype`), so a wrong one fails with the same message before anything is read: an integer dtype would
otherwise load as all-zero weights, and float64 would silently become float32 while JAX runs in 32 bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PARAMETER_DTYPE_NAMES = ("float32", "bfloat16", "float16")
FLOAT64 = "float64"  # allowed only once 64-bit JAX is on


def supported_names() -> tuple[str, ...]:
    return PARAMETER_DTYPE_NAMES + ((FLOAT64,) if jax.config.jax_enable_x64 else ())


def parameter_dtype(dtype, source: str = "dtype") -> np.dtype:
    """`dtype` (a name such as "bfloat16", or a numpy/JAX dtype) as a dtype, or ValueError.

    source: what the value came from, for the message (e.g. "config.json dtype").
    """
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is not None and resolved.name in supported_names():
        return resolved
    names = ", ".join(repr(name) for name in supported_names())
    if resolved is not None and resolved.name == FLOAT64:
        raise ValueError(
            f"{source} 'float64' needs 64-bit JAX: call jax.config.update('jax_enable_x64', True) before loading, "
            f"or use one of {names}."
        )
    shown = resolved.name if resolved is not None else dtype
    raise ValueError(f"{source} {shown!r} is not a supported parameter dtype; use one of {names}.")
