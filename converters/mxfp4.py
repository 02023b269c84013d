"""gpt-oss's MXFP4 hub tensors -> dequantised expert weights, read lazily expert by expert (load only).

The hub stores each expert projection as two tensors (OpenAI's release; Transformers' `integrations/mxfp4.py`):

    {proj}_blocks  [E, R, G, 16] uint8   two FP4 (e2m1) codes per byte: low nibble first, then high
    {proj}_scales  [E, R, G]     uint8   one power-of-two scale per block of 32 values: 2 ** (scale - 127)

    value[e, r, 32 g + 2 j]     = FP4_VALUES[blocks[e, r, g, j] & 0xF]  * 2 ** (scales[e, r, g] - 127)
    value[e, r, 32 g + 2 j + 1] = FP4_VALUES[blocks[e, r, g, j] >> 4]   * 2 ** (scales[e, r, g] - 127)

and the parameter is `value.transpose(1, 2)`: `gate_up_proj [E, H, 2I]` from R = 2I rows of H = 32 G values,
`down_proj [E, I, H]` from R = H rows of I values. Every value is a 3-bit-mantissa number times a power of
two, so float32 (and bfloat16) hold it exactly. A device's block reads only its experts' bytes. The step
is one-way: an export writes the dequantised weights in the bf16/fp32 layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .lazy_tensors import LayoutError, LazyTensor
from .transforms import OneWayTransform

FP4_VALUES = np.asarray([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                         -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
VALUES_PER_BLOCK = 32


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks: [..., G, 16] uint8, scales: [..., G] uint8 -> float32 [..., 32 G] (see the module doc)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != VALUES_PER_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} must be [..., G, 16] and [..., G].")
    values = np.empty((*blocks.shape[:-1], VALUES_PER_BLOCK), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


class MXFP4Tensor(LazyTensor):
    """`[E, 32 G, R]` float32, the transposed dequantisation of blocks `[E, R, G, 16]` and scales `[E, R, G]`."""

    dtype = np.dtype(np.float32)

    def __init__(self, blocks: LazyTensor, scales: LazyTensor):
        if (len(blocks.shape) != 4 or blocks.shape[-1] != VALUES_PER_BLOCK // 2
                or tuple(scales.shape) != tuple(blocks.shape[:-1])):
            raise LayoutError("shape", f"MXFP4 needs blocks [E, R, G, 16] and scales [E, R, G]; got "
                                       f"{blocks.describe()} and {scales.describe()}")
        if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
            raise LayoutError("dtype", f"MXFP4 blocks and scales are uint8; got {blocks.describe()} and "
                                       f"{scales.describe()}")
        self.blocks, self.scales = blocks, scales
        experts, rows, groups, _ = blocks.shape
        self.shape = (experts, groups * VALUES_PER_BLOCK, rows)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        experts, columns, rows = index
        # A block of 32 values shares one scale: read whole groups covering the wanted columns.
        first, last = columns.start // VALUES_PER_BLOCK, -(-columns.stop // VALUES_PER_BLOCK)
        groups = slice(first, last)
        blocks = self.blocks.read((experts, rows, groups, slice(0, VALUES_PER_BLOCK // 2)))
        scales = self.scales.read((experts, rows, groups))
        values = dequantize_mxfp4(blocks, scales)                         # [e, r, 32 g]
        offset = first * VALUES_PER_BLOCK
        return values[:, :, columns.start - offset:columns.stop - offset].transpose(0, 2, 1)

    def describe(self) -> str:
        return f"mxfp4({self.blocks.describe()}, {self.scales.describe()})"


@dataclass(frozen=True)
class DequantizeMXFP4(OneWayTransform):
    """`[blocks, scales]` -> the dequantised, transposed expert weight (gpt-oss's hub MXFP4 layout)."""

    def load(self, values: list) -> list:
        if len(values) != 2 or any(isinstance(value, list) for value in values):
            raise LayoutError("shape", "DequantizeMXFP4 needs exactly two tensors, blocks then scales")
        return [MXFP4Tensor(*values)]
