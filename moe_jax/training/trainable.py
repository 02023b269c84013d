"""Which parameters a train step trains, and the rest it holds frozen.

    make_train_step(model, optimizer)                                  # with an adapter: the adapter alone; else all
    make_train_step(model, optimizer, trainable="*.self_attn.*")       # glob(s) over HF parameter names
    make_train_step(model, optimizer, trainable=lambda name: ".mlp.gate." not in name)   # a predicate
    make_train_step(model, optimizer, trainable=freezing(model, ["*.mlp.gate.*"]))       # `--freeze`

Names are the per-layer HF names of the model's parameters (`model.layers.3.mlp.gate.weight`) and of its LoRA
adapter's factors (`model.layers.3.self_attn.q_proj.lora_A.weight`, `model.layers.3.mlp.experts.gate_up_proj.lora_A`);
globs are `fnmatch`'s (`*` crosses dots). The train state holds the trained arrays and their optimizer state only;
the frozen ones stay where they are (`model.params`, `model.adapter`), enter each step as an argument the step
neither donates nor writes, and get no gradient: the step differentiates with respect to the trained arrays
alone, so XLA computes no weight gradient of a frozen weight that it can leave out (a frozen projection's weight
gradient is never formed; a custom-VJP kernel's unused one is dead code).

A scanned run of layers stores its layers in one array: a selection must take all of the run's layers or none
(`scan_layers=False` trains single layers). Buffers (DeepSeek-V3's router bias) are never trained.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax

Selection = str | Iterable[str] | Callable[[str], bool] | None


@dataclass(frozen=True)
class TrainableParameters:
    """The storage names trained: `base` of `model.params`, `adapter` of `model.adapter`. `everything`: every
    parameter of a model without an adapter (the state then holds all of `model.params`, buffers with no
    optimizer state, as without a selection)."""

    base: tuple[str, ...]
    adapter: tuple[str, ...]
    everything: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return self.base + self.adapter

    def describe(self) -> str:
        if self.everything:
            return "every parameter"
        parts = ([f"{len(self.adapter)} adapter array(s)"] if self.adapter else []) + (
            [f"{len(self.base)} base array(s)"] if self.base else [])
        return " and ".join(parts)

    # ---- values ----------------------------------------------------------------------------------------------
    def initial(self, model) -> dict[str, Any]:
        """The trained arrays as the model holds them now."""
        adapter = model.adapter or {}
        return {**{name: model.params[name] for name in self.base}, **{name: adapter[name] for name in self.adapter}}

    def frozen(self, model) -> dict[str, dict[str, Any]]:
        """{"params": the model's frozen parameters, "adapter": its adapter's frozen arrays} (what a step reads and
        leaves alone)."""
        base = set(self.base)
        params = {} if self.everything else {name: value for name, value in model.params.items() if name not in base}
        trained = set(self.adapter)
        adapter = {name: value for name, value in (model.adapter or {}).items() if name not in trained}
        return {"params": params, "adapter": adapter}

    def weights(self, model, trained: Mapping[str, Any], frozen: Mapping[str, Mapping[str, Any]]
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(params, adapter or None) for the model's step from the trained and the frozen arrays (no copies)."""
        base = set(self.base)
        params = {**frozen["params"], **{name: value for name, value in trained.items() if name in base}}
        if model.adapter_layout is None:
            return params, None
        adapter = {**frozen["adapter"], **{name: value for name, value in trained.items() if name not in base}}
        return params, adapter

    # ---- layout ------------------------------------------------------------------------------------------------
    def shardings(self, model) -> dict[str, jax.sharding.NamedSharding]:
        base = model.storage_shardings()
        adapter = {} if model.adapter_layout is None else model.adapter_layout.storage_shardings()
        return {**{name: base[name] for name in self.base}, **{name: adapter[name] for name in self.adapter}}

    def shapes(self, model) -> dict[str, tuple[int, ...]]:
        base = model.storage_shapes()
        adapter = {} if model.adapter_layout is None else model.adapter_layout.storage_shapes()
        return {**{name: base[name] for name in self.base}, **{name: adapter[name] for name in self.adapter}}

    def dtypes(self, model) -> dict[str, Any]:
        base = model.storage_dtypes()
        return {**{name: base[name] for name in self.base}, **{name: model.dtype for name in self.adapter}}

    def members(self, model) -> dict[str, tuple[str | None, ...]]:
        """Storage name -> the per-layer names it holds, for each trained array."""
        adapter = {} if model.adapter_layout is None else model.adapter_layout.stack.members
        return {**{name: model.layer_stack.members[name] for name in self.base},
                **{name: adapter[name] for name in self.adapter}}

    def frozen_shardings(self, model) -> dict[str, dict[str, jax.sharding.NamedSharding]]:
        base = model.storage_shardings()
        adapter = {} if model.adapter_layout is None else model.adapter_layout.storage_shardings()
        frozen = self.frozen(model)
        return {"params": {name: base[name] for name in frozen["params"]},
                "adapter": {name: adapter[name] for name in frozen["adapter"]}}


def _predicate(selection: Selection) -> Callable[[str], bool]:
    if callable(selection):
        return selection
    patterns = [selection] if isinstance(selection, str) else list(selection)
    if not patterns or not all(isinstance(pattern, str) and pattern for pattern in patterns):
        raise ValueError(f"trainable={selection!r}: pass a glob, a list of globs or a predicate over parameter names.")
    return lambda name: any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _candidates(model) -> dict[str, tuple[str, tuple[str | None, ...]]]:
    """Storage name -> ("params" or "adapter", the per-layer names it holds), buffers left out."""
    buffers = set(model.module_tree.buffers())
    found = {storage: ("params", members) for storage, members in model.layer_stack.members.items()
             if not any(name in buffers for name in members if name is not None)}
    if model.adapter_layout is not None:
        found.update((storage, ("adapter", members)) for storage, members in model.adapter_layout.stack.members.items())
    return found


def resolve_trainable(model, selection: Selection = None) -> TrainableParameters:
    """The `TrainableParameters` `selection` names on `model` (see the module docstring); ValueError naming the
    pattern and the fix when it selects nothing or part of a scanned run."""
    if selection is None:
        if model.adapter_layout is not None:
            return TrainableParameters((), tuple(model.adapter_layout.stack.members))
        return TrainableParameters(tuple(model.layer_stack.members), (), everything=True)
    chosen = _predicate(selection)
    base, adapter = [], []
    for storage, (kind, members) in _candidates(model).items():
        names = [name for name in members if name is not None]
        picked = [name for name in names if chosen(name)]
        if not picked:
            continue
        if len(picked) != len(names):
            left = next(name for name in names if name not in picked)
            raise ValueError(f"trainable={selection!r} selects {picked[0]} but not {left}, which a scanned run stores "
                             f"in the same array ({storage}); select all of its layers or none, or build the model "
                             "with scan_layers=False.")
        (base if kind == "params" else adapter).append(storage)
    if not base and not adapter:
        example = next(iter(model.module_tree.params))
        raise ValueError(f"trainable={selection!r} selects no parameter (names look like {example!r}"
                         + (", model.layers.0.self_attn.q_proj.lora_A.weight" if model.adapter_layout else "")
                         + "; buffers are never trained).")
    return TrainableParameters(tuple(base), tuple(adapter))


def freezing(model, patterns: Iterable[str]) -> Callable[[str], bool]:
    """The predicate of `moe-jax train --freeze PATTERN,...`: everything the default would train but what the
    globs match. A glob that matches none of those names is refused, naming it."""
    patterns = list(patterns)
    default = resolve_trainable(model)
    names = [name for storage in default.names for name in default.members(model)[storage] if name is not None]
    buffers = set(model.module_tree.buffers())
    names = [name for name in names if name not in buffers]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            what = "the adapter's arrays" if default.adapter else "the model's parameters"
            raise ValueError(f"--freeze {pattern!r} matches none of {what} (names look like {names[0]!r}); "
                             "a glob over them, e.g. '*.mlp.gate.*' for the routers.")
    return lambda name: not any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
