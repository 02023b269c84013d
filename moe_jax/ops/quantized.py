"""Expert weights kept in a checkpoint's quantised format, dequantised one expert at a time inside the step.

MXFP4 (gpt-oss's hub format; OCP microscaling FP4): each weight row is split into blocks of 32 values stored as
16 bytes of FP4 (e2m1) codes, low nibble first, and one uint8 power-of-two scale per block:

    blocks [E, O, G, 16] uint8, scales [E, O, G] uint8     (O output rows, G = H / 32 blocks a row)
    w[e, o, 32 g + 2 j]     = FP4_VALUES[blocks[e, o, g, j] & 0xF] * 2 ** (scales[e, o, g] - 127)
    w[e, o, 32 g + 2 j + 1] = FP4_VALUES[blocks[e, o, g, j] >> 4]  * 2 ** (scales[e, o, g] - 127)

Every value is a 2-bit-mantissa number times a power of two, so float32 and bfloat16 hold it exactly and the
dequantised product equals the dequantise-at-load model's. `MXFP4Experts` stands in for the dense [E, O, H] weight
in `grouped_matmul`: the tiled backend reads one expert's [O, H] from it per visit (`expert_weight`), so no
dequantised copy of all the experts is ever live; other backends get `dequantized()` (the whole [E, O, H]).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

FP4_VALUES = np.asarray([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
VALUES_PER_BLOCK = 32
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """blocks: [..., G, 16] uint8; scales: [..., G] uint8 -> [..., 32 G] in `dtype` (exact: see the module doc)."""
    codes = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], VALUES_PER_BLOCK)
    values = jnp.asarray(FP4_VALUES)[codes.astype(jnp.int32)]                        # [..., G, 32] float32
    values = jnp.ldexp(values, scales.astype(jnp.int32)[..., None] - SCALE_BIAS)
    return values.reshape(*blocks.shape[:-2], -1).astype(dtype)


@dataclass(frozen=True)
class MXFP4Experts:
    """Experts' weights [E, O, H] (grouped_matmul's layout) as MXFP4 blocks [E, O, H / 32, 16] and scales
    [E, O, H / 32]; `dtype`: what they dequantise to (the step's compute dtype)."""

    blocks: jax.Array
    scales: jax.Array
    dtype: jnp.dtype = jnp.dtype(jnp.float32)

    @classmethod
    def checked(cls, blocks: jax.Array, scales: jax.Array, dtype=jnp.float32) -> MXFP4Experts:
        """The stand-in for blocks and scales of the right shapes and dtypes, or a ValueError naming them."""
        if (blocks.ndim != 4 or blocks.shape[-1] != VALUES_PER_BLOCK // 2 or tuple(scales.shape) !=
                tuple(blocks.shape[:-1]) or blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8):
            raise ValueError(f"MXFP4 experts need uint8 blocks [E, O, G, 16] and uint8 scales [E, O, G]; got "
                             f"{blocks.dtype}{list(blocks.shape)} and {scales.dtype}{list(scales.shape)}.")
        return cls(blocks, scales, jnp.dtype(dtype))

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, groups, _ = self.blocks.shape
        return experts, rows, groups * VALUES_PER_BLOCK

    @property
    def ndim(self) -> int:
        return 3

    def astype(self, dtype) -> MXFP4Experts:
        return MXFP4Experts(self.blocks, self.scales, jnp.dtype(dtype))

    def expert_weight(self, expert: jax.Array) -> jax.Array:
        """One expert's [O, H] in `dtype` (expert: a traced int scalar)."""
        blocks = jax.lax.dynamic_index_in_dim(self.blocks, expert, axis=0, keepdims=False)
        scales = jax.lax.dynamic_index_in_dim(self.scales, expert, axis=0, keepdims=False)
        return dequantize_mxfp4(blocks, scales, self.dtype)

    def dequantized(self) -> jax.Array:
        """Every expert's [E, O, H] in `dtype` (for backends that take a dense weight)."""
        return dequantize_mxfp4(self.blocks, self.scales, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.size * self.blocks.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize


jax.tree_util.register_dataclass(MXFP4Experts, data_fields=["blocks", "scales"], meta_fields=["dtype"])

QUANTIZED_EXPERTS = (MXFP4Experts,)


def is_quantized(weight) -> bool:
    return isinstance(weight, QUANTIZED_EXPERTS)


def expert_weight(w, expert: jax.Array) -> jax.Array:
    """w: [E, O, H] (an array or a quantised stand-in) -> expert `expert`'s [O, H]."""
    if is_quantized(w):
        return w.expert_weight(expert)
    return jax.lax.dynamic_index_in_dim(w, expert, axis=0, keepdims=False)
