"""Tensors that know their shape and read any block of themselves on demand.

The loader never materialises a whole checkpoint parameter: it builds one of these per parameter (a stack of
per-expert checkpoint tensors, a concatenation of gate and up, ...) and asks it for each device's block.
Each composite reads only the parts of its children that overlap the block:

    StackedTensor([e0, ..., e7])[2:3, :, :]        reads e2 only
    ConcatenatedTensor([gate, up], dim=-2)[:, 0:I]  reads gate only (rows 0..I), never up

`read(index)` takes one `slice(start, stop)` per dimension (normalised, step 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import numpy as np


class LayoutError(ValueError):
    """Parts that cannot be combined; `kind` is "shape" or "dtype" so the loader can group the reports."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(message)


class SliceReader(Protocol):
    def read(self, key: str, index: tuple[slice, ...]) -> np.ndarray: ...


class LazyTensor(ABC):
    shape: tuple[int, ...]
    dtype: np.dtype

    @abstractmethod
    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` of this tensor, shape `[stop - start for each dim]`."""

    @abstractmethod
    def describe(self) -> str:
        """Where the values come from, for error messages."""


class ZerosTensor(LazyTensor):
    """Zeros of a shape and dtype, read from no file (a pipeline group's rows for a stage without the layer)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        return np.zeros(tuple(s.stop - s.start for s in index), self.dtype)

    def describe(self) -> str:
        return f"zeros {list(self.shape)} {self.dtype}"


class CheckpointTensor(LazyTensor):
    """One tensor of a checkpoint file."""

    def __init__(self, reader: SliceReader, key: str, shape: tuple[int, ...], dtype: np.dtype):
        self.reader, self.key, self.shape, self.dtype = reader, key, tuple(shape), np.dtype(dtype)

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        return self.reader.read(self.key, index)

    def describe(self) -> str:
        return f"{self.key} {list(self.shape)} {self.dtype}"


class StackedTensor(LazyTensor):
    """`[E, *S]` from E tensors of shape `S` (the experts of one layer, each `[out, in]`)."""

    def __init__(self, parts: list[LazyTensor]):
        if not parts:
            raise LayoutError("shape", "cannot stack zero tensors")
        _check_same_dtype(parts)
        shapes = {part.shape for part in parts}
        if len(shapes) > 1:
            raise LayoutError("shape", "stacked tensors differ in shape: " + _describe_all(parts))
        self.parts = parts
        self.shape = (len(parts), *parts[0].shape)
        self.dtype = parts[0].dtype

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        experts, rest = index[0], index[1:]
        blocks = [self.parts[expert].read(rest) for expert in range(experts.start, experts.stop)]
        if not blocks:
            return np.empty((0, *(s.stop - s.start for s in rest)), self.dtype)
        return np.stack(blocks, axis=0)

    def describe(self) -> str:
        return f"stack of {len(self.parts)} x ({self.parts[0].describe()}, ...)"


class ConcatenatedTensor(LazyTensor):
    """Parts joined along `dim` (gate `[..., I, H]` + up `[..., I, H]` -> `[..., 2I, H]` with dim=-2)."""

    def __init__(self, parts: list[LazyTensor], dim: int):
        _check_same_dtype(parts)
        ranks = {len(part.shape) for part in parts}
        if len(ranks) > 1 or not -len(parts[0].shape) <= dim < len(parts[0].shape):
            raise LayoutError("shape", f"cannot concatenate along dim {dim}: " + _describe_all(parts))
        self.dim = dim % len(parts[0].shape)
        others = {part.shape[: self.dim] + part.shape[self.dim + 1 :] for part in parts}
        if len(others) > 1:
            raise LayoutError("shape", f"concatenated tensors differ outside dim {dim}: " + _describe_all(parts))
        self.parts = parts
        shape = list(parts[0].shape)
        shape[self.dim] = sum(part.shape[self.dim] for part in parts)
        self.shape, self.dtype = tuple(shape), parts[0].dtype

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        wanted = index[self.dim]
        blocks, offset = [], 0
        for part in self.parts:
            size = part.shape[self.dim]
            start, stop = max(wanted.start, offset), min(wanted.stop, offset + size)
            if start < stop:  # skip parts outside the block: their bytes are never read
                part_index = list(index)
                part_index[self.dim] = slice(start - offset, stop - offset)
                blocks.append(part.read(tuple(part_index)))
            offset += size
        if not blocks:
            return np.empty(tuple(s.stop - s.start for s in index), self.dtype)
        return np.concatenate(blocks, axis=self.dim)

    def describe(self) -> str:
        return "concat(" + ", ".join(part.describe() for part in self.parts) + f"; dim {self.dim})"


def _check_same_dtype(parts: list[LazyTensor]) -> None:
    if len({part.dtype for part in parts}) > 1:
        raise LayoutError("dtype", "combined tensors differ in dtype: " + _describe_all(parts))


def _describe_all(parts: list[LazyTensor]) -> str:
    return ", ".join(part.describe() for part in parts)
