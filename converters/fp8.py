"""Block-quantised FP8 hub weights (DeepSeek-V3's release) -> float32, read lazily block by block (load only).

The hub stores a quantised `nn.Linear` weight as two tensors (Transformers' `FineGrainedFP8`):

    {module}.weight            [R, C]                          float8_e4m3fn
    {module}.weight_scale_inv  [ceil(R / bR), ceil(C / bC)]    float32, one scale per bR x bC block

    value[r, c] = float32(weight[r, c]) * weight_scale_inv[r // bR, c // bC]

with the block `[bR, bC]` of config.json's `quantization_config.weight_block_size` ([128, 128]). The product
is one float32 multiplication, as Transformers' `Fp8Dequantize` computes it, so the values are bit-identical
before the loader's cast to the model's dtype. Scales stored as uint8 exponents (E8M0) mean `2 ** (s - 127)`.

Divergence: Transformers derives the block from the grid (`rows // scale_rows`) and refuses a weight whose
rows are not a multiple of it (DeepSeek-V3's `kv_a_proj_with_mqa`, 576 rows in 5 blocks of 128); the block
here is the configured one, so the last, partial block is read with its scale as the quantiser wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .lazy_tensors import LayoutError, LazyTensor
from .transforms import OneWayTransform

FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.uint8))
DEFAULT_BLOCK = (128, 128)


def scales_as_float32(scales: np.ndarray) -> np.ndarray:
    """weight_scale_inv as float32 multipliers (uint8 holds E8M0 exponents: `2 ** (s - 127)`)."""
    if scales.dtype == np.uint8:
        return np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    return scales.astype(np.float32)


def dequantize_fp8(weight: np.ndarray, scales: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK) -> np.ndarray:
    """weight: [R, C] float8, scales: [ceil(R / bR), ceil(C / bC)] -> float32 [R, C] (the module doc)."""
    rows, columns = weight.shape
    multipliers = scales_as_float32(scales)
    expanded = np.repeat(np.repeat(multipliers, block[0], axis=0), block[1], axis=1)[:rows, :columns]
    return weight.astype(np.float32) * expanded


class FP8BlockTensor(LazyTensor):
    """`[R, C]` float32: a float8 weight `[R, C]` times its per-block scales (`dequantize_fp8`)."""

    dtype = np.dtype(np.float32)

    def __init__(self, weight: LazyTensor, scales: LazyTensor, block: tuple[int, int]):
        if len(weight.shape) != 2:
            raise LayoutError("shape", f"an FP8 weight is [out, in]; got {weight.describe()}")
        grid = tuple(-(-size // b) for size, b in zip(weight.shape, block))
        if tuple(scales.shape) != grid:
            raise LayoutError("shape", f"{scales.describe()} is not the {list(grid)} scale grid of {weight.describe()} "
                                       f"in blocks of {list(block)} (quantization_config.weight_block_size)")
        if weight.dtype not in FP8_DTYPES:
            raise LayoutError("dtype", f"an FP8 weight is float8_e4m3fn or float8_e5m2; got {weight.describe()}")
        if scales.dtype not in SCALE_DTYPES:
            raise LayoutError("dtype", f"weight_scale_inv is float32, bfloat16, float16 or uint8 (E8M0); got "
                                       f"{scales.describe()}")
        self.weight, self.scales, self.block = weight, scales, tuple(block)
        self.shape = tuple(weight.shape)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        rows, columns = index
        (block_rows, block_columns) = self.block
        # The scales of the blocks the wanted rows and columns fall in, expanded back to those rows/columns.
        scale_rows = slice(rows.start // block_rows, -(-rows.stop // block_rows))
        scale_columns = slice(columns.start // block_columns, -(-columns.stop // block_columns))
        multipliers = scales_as_float32(self.scales.read((scale_rows, scale_columns)))
        row_block = np.arange(rows.start, rows.stop) // block_rows - scale_rows.start
        column_block = np.arange(columns.start, columns.stop) // block_columns - scale_columns.start
        weight = self.weight.read(index).astype(np.float32)
        return weight * multipliers[row_block[:, None], column_block[None, :]]

    def describe(self) -> str:
        return f"fp8({self.weight.describe()}, {self.scales.describe()}, block {list(self.block)})"


@dataclass(frozen=True)
class DequantizeFP8(OneWayTransform):
    """`[weight, weight_scale_inv, weight, weight_scale_inv, ...]` -> `[dequantised, ...]`, pair by pair; a
    per-expert pair (lists indexed by expert) gives a per-expert list, for a later `StackExperts`."""

    block: tuple[int, int] = DEFAULT_BLOCK

    def load(self, values: list) -> list:
        if len(values) % 2:
            raise LayoutError("shape", "DequantizeFP8 needs (weight, weight_scale_inv) pairs")
        result = []
        for weight, scales in zip(values[0::2], values[1::2]):
            if isinstance(weight, list) != isinstance(scales, list) or (
                    isinstance(weight, list) and len(weight) != len(scales)):
                raise LayoutError("shape", "DequantizeFP8 pairs one weight_scale_inv with each weight")
            if isinstance(weight, list):
                result.append([FP8BlockTensor(w, s, self.block) for w, s in zip(weight, scales)])
            else:
                result.append(FP8BlockTensor(weight, scales, self.block))
        return result
