"""The declared structure of a model: its modules and parameters, named as in Hugging Face.

A model declares its tree once, abstractly (shapes and dtypes, no memory), in the order PyTorch's
`named_modules()` would list it. Plans are resolved against these names, shardings are derived from them
before anything is allocated, and converters map checkpoint keys onto them.

    tree = ModuleTree()
    with tree.module("model"):
        with tree.module("embed_tokens"):
            tree.param("weight", (vocab, hidden))
        tree.module_without_params("rotary_emb")

Parameters travel as flat dicts keyed by these dotted names; code that walks the tree by module (the
model's step, the loss's lm_head) sees them nested by a `NestedView`, whose names were split once, when the
model was built; `unflatten` nests any flat dict (the NNX module's attributes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import traverse_util


@dataclass(frozen=True)
class ParamSpec:
    """An abstract parameter: `shape` in HF's layout (`Linear` weight `[out, in]`, experts `[E, 2I, H]`)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    init: str = "normal"  # an initializer name: "normal", "zeros" or "ones" (causal_lm.model.INITIALIZERS)
    # A persistent torch buffer (in the state dict, not a Parameter): never trained, never sharded, kept in
    # float32 whatever the model's dtype (DeepSeek-V3's `e_score_correction_bias`).
    buffer: bool = False
    # Held in `dtype` whatever the model's: a kept-quantised checkpoint's codes and scales, stored as the hub stores
    # them (`from_pretrained(..., dequantize=False)`).
    keep_dtype: bool = False


@dataclass
class ModuleTree:
    """Ordered module names (root is "") and parameters (dotted name -> ParamSpec)."""

    modules: list[str] = field(default_factory=lambda: [""])
    params: dict[str, ParamSpec] = field(default_factory=dict)
    _prefix: list[str] = field(default_factory=list, repr=False)

    def _qualify(self, name: str) -> str:
        return ".".join([*self._prefix, name])

    @contextlib.contextmanager
    def module(self, name: str | int) -> Iterator[None]:
        """Declare a submodule; parameters and modules declared inside belong to it."""
        full_name = self._qualify(str(name))
        if full_name in self.modules:
            raise ValueError(f"Module {full_name!r} is declared twice.")
        self.modules.append(full_name)
        self._prefix.append(str(name))
        try:
            yield
        finally:
            self._prefix.pop()

    def module_without_params(self, name: str) -> None:
        """A module PyTorch lists although it holds no parameter (activations, rotary embeddings)."""
        with self.module(name):
            pass

    def param(self, name: str, shape: tuple[int, ...], dtype: str = "float32", init: str = "normal", *,
              keep_dtype: bool = False) -> None:
        self._add(name, ParamSpec(tuple(int(d) for d in shape), dtype, init, keep_dtype=keep_dtype))

    def buffer(self, name: str, shape: tuple[int, ...], init: str = "zeros") -> None:
        """A persistent buffer: checkpointed like a parameter, but frozen, replicated and float32."""
        self._add(name, ParamSpec(tuple(int(d) for d in shape), "float32", init, buffer=True))

    def _add(self, name: str, spec: ParamSpec) -> None:
        full_name = self._qualify(name)
        if full_name in self.params:
            raise ValueError(f"Parameter {full_name!r} is declared twice.")
        self.params[full_name] = spec

    def buffers(self) -> list[str]:
        """Names of the declared buffers."""
        return [name for name, spec in self.params.items() if spec.buffer]

    def linear(self, name: str, out_features: int, in_features: int, bias: bool = False) -> None:
        """An `nn.Linear` module: `weight [out, in]` (HF layout) and optionally `bias [out]`."""
        with self.module(name):
            self.param("weight", (out_features, in_features))
            if bias:
                self.param("bias", (out_features,), init="zeros")

    def norm(self, name: str, size: int) -> None:
        """An RMSNorm module: `weight [size]`, initialised to ones."""
        with self.module(name):
            self.param("weight", (size,), init="ones")

    def named_modules(self) -> list[str]:
        return list(self.modules)

    def named_parameters(self) -> list[tuple[str, ParamSpec]]:
        return list(self.params.items())


def unflatten(flat: Mapping[str, Any]) -> dict:
    """{"a.b.c": x} -> {"a": {"b": {"c": x}}} (layer numbers stay string keys)."""
    return traverse_util.unflatten_dict(dict(flat), sep=".")


class NestedView:
    """`unflatten` for one fixed set of names, their dots split once: `view(flat)` places the values of
    `flat` into the nested structure computed at construction (a pytree unflatten, no string parsing), so a
    traced step nests its parameters without reading their names. `flat` must hold exactly these names."""

    def __init__(self, names):
        leaves, self._treedef = jax.tree.flatten(unflatten({name: name for name in names}))
        self._names = tuple(leaves)

    def __call__(self, flat: Mapping[str, Any]) -> dict:
        return jax.tree.unflatten(self._treedef, [flat[name] for name in self._names])
