"""Safetensors dtype names <-> numpy dtypes.

numpy has no bfloat16 or float8; `ml_dtypes` (a JAX dependency) provides them as numpy dtypes, and importing
it here also lets safetensors' numpy backend build `bfloat16` arrays (it looks the dtype up by name).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

SAFETENSORS_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
NUMPY_TO_SAFETENSORS: dict[np.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_TO_NUMPY.items()}


def numpy_dtype(safetensors_name: str) -> np.dtype:
    """`"BF16"` -> `dtype(bfloat16)`; unknown names raise naming the supported ones."""
    try:
        return SAFETENSORS_TO_NUMPY[safetensors_name]
    except KeyError:
        raise ValueError(
            f"Unsupported safetensors dtype {safetensors_name!r}; supported: {', '.join(SAFETENSORS_TO_NUMPY)}."
        ) from None


def safetensors_dtype(dtype) -> str:
    """`float32` / `jnp.bfloat16` / `np.dtype(...)` -> `"F32"` / `"BF16"`."""
    dtype = np.dtype(dtype)
    try:
        return NUMPY_TO_SAFETENSORS[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot be stored in safetensors; use one of "
            f"{', '.join(str(d) for d in NUMPY_TO_SAFETENSORS)}."
        ) from None
