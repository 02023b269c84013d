"""The steps between hub tensors and a parameter, each written once with both directions.

A key rule lists its transforms in the load direction (hub -> parameter). Loading runs `load` on lazy
tensors (nothing is read until a device asks for its block); exporting runs the same list backwards with
`export` on host arrays. So the export layout is derived from the load table, never written twice.

The values passed between steps are a list with one entry per hub pattern of the rule; an entry is a
tensor, or, for a pattern with an `{expert}` placeholder, a list of tensors indexed by expert id.

    qwen3_moe gate_up_proj, load:
        [[gate_0 .. gate_7] [I,H], [up_0 .. up_7] [I,H]]
        -- StackExperts -->  [gate [8,I,H], up [8,I,H]]
        -- ConcatGateUp -->  [gate_up [8,2I,H]]
    export runs ConcatGateUp.export then StackExperts.export, ending with the per-expert lists again.

A transform that cannot be undone (dequantisation, say) subclasses `OneWayTransform`: checkpoints in that
layout load, and exporting a parameter through such a rule raises instead of writing a wrong layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .lazy_tensors import ConcatenatedTensor, LayoutError, LazyTensor, StackedTensor


class Transform(ABC):
    """One invertible step; `load` acts on `LazyTensor`s, `export` on numpy arrays (its inverse)."""

    invertible: ClassVar[bool] = True
    # True when the step consumes per-expert lists (its rule's hub patterns may hold `{expert}`).
    stacks_experts: ClassVar[bool] = False

    @abstractmethod
    def load(self, values: list) -> list:
        """Hub direction -> parameter direction, lazily."""

    @abstractmethod
    def export(self, values: list) -> list:
        """Parameter direction -> hub direction, on host arrays; undoes `load` exactly (bit for bit)."""


class OneWayTransform(Transform):
    """A step that only loads (e.g. dequantisation): rules using it cannot be exported."""

    invertible: ClassVar[bool] = False

    def export(self, values: list) -> list:
        raise TypeError(
            f"{type(self).__name__} is one-way: a checkpoint in this layout can be loaded but not written. "
            "Export with a key map whose rules only use invertible transforms."
        )


@dataclass(frozen=True)
class StackExperts(Transform):
    """Per-expert tensors `E x [*S]` -> one `[E, *S]` tensor; export unstacks along dim 0."""

    stacks_experts: ClassVar[bool] = True

    def load(self, values: list) -> list:
        stacked = []
        for value in values:
            if not isinstance(value, list):
                raise LayoutError("shape", "StackExperts needs per-expert tensors (a hub pattern with {expert})")
            stacked.append(StackedTensor(value))
        return stacked

    def export(self, values: list) -> list:
        return [[array[expert] for expert in range(array.shape[0])] for array in values]


@dataclass(frozen=True)
class ConcatGateUp(Transform):
    """`[gate, up]`, each `[..., I, H]` -> `gate_up [..., 2I, H]` (gate rows first, as HF's Concatenate);
    export splits the fused dim back into two halves (HF's Chunk)."""

    dim: int = -2

    def load(self, values: list) -> list:
        if len(values) != 2 or any(isinstance(value, list) for value in values):
            raise LayoutError("shape", "ConcatGateUp needs exactly two stacked tensors, gate then up")
        gate, up = values
        if gate.shape != up.shape:
            raise LayoutError("shape", f"gate and up differ in shape: {gate.describe()} vs {up.describe()}")
        return [ConcatenatedTensor([gate, up], dim=self.dim)]

    def export(self, values: list) -> list:
        (gate_up,) = values
        fused = gate_up.shape[self.dim]
        if fused % 2:
            raise ValueError(
                f"Cannot split gate_up {list(gate_up.shape)} into gate and up: dim {self.dim} ({fused}) is odd."
            )
        gate, up = np.split(gate_up, 2, axis=self.dim)
        return [gate, up]


def is_tensor_value(value) -> bool:
    """True for one tensor, False for a per-expert list."""
    return isinstance(value, (LazyTensor, np.ndarray))
