"""Weights kept in a checkpoint's quantised format, dequantised inside the step: experts one at a time (the tiled
grouped matmul decodes only the expert a visit reads), a linear layer's weight where it is used.

MXFP4 (gpt-oss's hub format; OCP microscaling FP4): each weight row is split into blocks of 32 values stored as
16 bytes of FP4 (e2m1) codes, low nibble first, and one uint8 power-of-two scale per block:

    blocks [E, O, G, 16] uint8, scales [E, O, G] uint8     (O output rows, G = H / 32 blocks a row)
    w[e, o, 32 g + 2 j]     = FP4_VALUES[blocks[e, o, g, j] & 0xF] * 2 ** (scales[e, o, g] - 127)
    w[e, o, 32 g + 2 j + 1] = FP4_VALUES[blocks[e, o, g, j] >> 4]  * 2 ** (scales[e, o, g] - 127)

Every value is a 2-bit-mantissa number times a power of two, so float32 and bfloat16 hold it exactly and the
dequantised product equals the dequantise-at-load model's. `MXFP4Experts` stands in for the dense [E, O, H] weight
in `grouped_matmul`: the tiled backend reads one expert's [O, H] from it per visit (`expert_weight`), so no
dequantised copy of all the experts is ever live; other backends get `dequantized()` (the whole [E, O, H]).

FP8 (DeepSeek-V3's hub format, Transformers' FineGrainedFP8): float8_e4m3fn codes and one float32 multiplier per
bR x bC block, `weight_scale_inv [ceil(O / bR), ceil(H / bC)]`:

    w[o, h] = float32(codes[o, h]) * scale_inv[o // bR, h // bC]

one float32 product, as the loader's dequantisation (converters/fp8.py), so the values are bit-identical. The
block is the smallest power of two that gives the scale grid (DeepSeek's 128; a partial last block allowed).

INT8 (weight-only, quantised on load: `from_pretrained(..., quantize="int8")`): symmetric codes and one float32
scale per output row (amax over the row / 127):

    codes [..., O, H] int8, scale [..., O] float32        w[..., o, h] = float32(codes[..., o, h]) * scale[..., o]
"""

from __future__ import annotations

import dataclasses
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

def fp8_block(size: int, scale_size: int) -> int:
    """The block along a dimension of `size` values with `scale_size` scales: the smallest power of two b with
    ceil(size / b) == scale_size (a ValueError when there is none)."""
    block = 1 << max(-(-size // max(scale_size, 1)) - 1, 0).bit_length()
    if scale_size < 1 or -(-size // block) != scale_size:
        raise ValueError(f"{scale_size} FP8 scales cannot cover {size} values in power-of-two blocks; kept FP8 needs "
                         "a power-of-two weight_block_size (DeepSeek's is [128, 128]).")
    return block


def dequantize_fp8(codes: jax.Array, scale_inv: jax.Array, dtype) -> jax.Array:
    """codes: [..., O, H] float8; scale_inv: [..., ceil(O / bR), ceil(H / bC)] -> [..., O, H] in `dtype`."""
    rows, columns = codes.shape[-2:]
    row_block, column_block = fp8_block(rows, scale_inv.shape[-2]), fp8_block(columns, scale_inv.shape[-1])
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), row_block, axis=-2)[..., :rows, :],
                       column_block, axis=-1)[..., :columns]
    return (codes.astype(jnp.float32) * scale).astype(dtype)


class CodedExperts:
    """What FP8 and int8 experts share: codes [E, O, H] under `codes`, a scale per expert (`_scale()`), decoded
    by `_decode(codes, scale)` into `dtype`."""

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.codes.shape)

    @property
    def ndim(self) -> int:
        return 3

    def astype(self, dtype):
        return dataclasses.replace(self, dtype=jnp.dtype(dtype))

    def expert_weight(self, expert: jax.Array) -> jax.Array:
        """One expert's [O, H] in `dtype` (expert: a traced int scalar)."""
        codes = jax.lax.dynamic_index_in_dim(self.codes, expert, axis=0, keepdims=False)
        scale = jax.lax.dynamic_index_in_dim(self._scale(), expert, axis=0, keepdims=False)
        return self._decode(codes, scale)

    def dequantized(self) -> jax.Array:
        """Every expert's [E, O, H] in `dtype`."""
        return self._decode(self.codes, self._scale())


@dataclass(frozen=True)
class FP8Experts(CodedExperts):
    """Experts' weights [E, O, H] as float8 codes [E, O, H] and block multipliers [E, ceil(O / bR), ceil(H / bC)];
    `dtype`: what they dequantise to."""

    codes: jax.Array
    scale_inv: jax.Array
    dtype: jnp.dtype = jnp.dtype(jnp.float32)

    @classmethod
    def checked(cls, codes: jax.Array, scale_inv: jax.Array, dtype=jnp.float32) -> FP8Experts:
        if codes.ndim != 3 or scale_inv.ndim != 3 or codes.dtype.itemsize != 1 or scale_inv.shape[0] != codes.shape[0]:
            raise ValueError(f"FP8 experts need float8 codes [E, O, H] and scales [E, O / bR, H / bC]; got "
                             f"{codes.dtype}{list(codes.shape)} and {scale_inv.dtype}{list(scale_inv.shape)}.")
        fp8_block(codes.shape[1], scale_inv.shape[1])
        fp8_block(codes.shape[2], scale_inv.shape[2])
        return cls(codes, scale_inv, jnp.dtype(dtype))

    def _decode(self, codes: jax.Array, scale: jax.Array) -> jax.Array:
        return dequantize_fp8(codes, scale, self.dtype)

    def _scale(self) -> jax.Array:
        return self.scale_inv


jax.tree_util.register_dataclass(FP8Experts, data_fields=["codes", "scale_inv"], meta_fields=["dtype"])

INT8_MAX = 127


def dequantize_int8(codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """codes: [..., O, H] int8; scale: [..., O] float32 -> [..., O, H] in `dtype`."""
    return (codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)


@dataclass(frozen=True)
class Int8Experts(CodedExperts):
    """Experts' weights [E, O, H] as int8 codes [E, O, H] and per-row scales [E, O]; `dtype`: what they
    dequantise to."""

    codes: jax.Array
    scale: jax.Array
    dtype: jnp.dtype = jnp.dtype(jnp.float32)

    @classmethod
    def checked(cls, codes: jax.Array, scale: jax.Array, dtype=jnp.float32) -> Int8Experts:
        if codes.ndim != 3 or codes.dtype != jnp.int8 or tuple(scale.shape) != tuple(codes.shape[:2]):
            raise ValueError(f"int8 experts need int8 codes [E, O, H] and scales [E, O]; got "
                             f"{codes.dtype}{list(codes.shape)} and {scale.dtype}{list(scale.shape)}.")
        return cls(codes, scale, jnp.dtype(dtype))

    def _decode(self, codes: jax.Array, scale: jax.Array) -> jax.Array:
        return dequantize_int8(codes, scale, self.dtype)

    def _scale(self) -> jax.Array:
        return self.scale


jax.tree_util.register_dataclass(Int8Experts, data_fields=["codes", "scale"], meta_fields=["dtype"])

QUANTIZED_EXPERTS = (MXFP4Experts, FP8Experts, Int8Experts)


def is_quantized(weight) -> bool:
    return isinstance(weight, QUANTIZED_EXPERTS)


def expert_weight(w, expert: jax.Array) -> jax.Array:
    """w: [E, O, H] (an array or a quantised stand-in) -> expert `expert`'s [O, H]."""
    if is_quantized(w):
        return w.expert_weight(expert)
    return jax.lax.dynamic_index_in_dim(w, expert, axis=0, keepdims=False)


def linear_weight(params, dtype) -> jax.Array:
    """A linear layer's weight [O, I] as it is applied: `params["weight"]`, or its codes decoded in `dtype` by
    `params["weight_scale_inv"]` (FP8 blocks) or `params["weight_scale"]` (int8 rows)."""
    if (scale_inv := params.get("weight_scale_inv")) is not None:
        return dequantize_fp8(params["weight"], scale_inv, dtype)
    if (scale := params.get("weight_scale")) is not None:
        return dequantize_int8(params["weight"], scale, dtype)
    return params["weight"]
