"""`AdapterLayout`: where a LoRA adapter's factors live on a built model and how a step finds them.

An adapter is a flat dict of arrays, stored like the model's parameters (a scanned run of layers stacks its
layers' factors on a leading axis, pipeline stages by the same groups), under names that say what they adapt:

    model.layers.1.self_attn.q_proj.lora_A.weight     [r, H]          a Linear's A, as PEFT names it
    model.layers.1.self_attn.q_proj.lora_B.weight     [N*D, r]
    model.layers.1.mlp.experts.gate_up_proj.lora_A    [E, r, H]       a fused expert weight's, one per expert
    model.layers.1.mlp.experts.gate_up_proj.lora_B    [E, 2I, r]

Shardings follow the adapted weight's tensor / expert parallel split, FSDP left out (an adapter is small):
a Linear's A is split like the weight's input dim and its B like its output dim (colwise q_proj: B split;
rowwise o_proj: A split), an expert weight's factors go with their experts over ep. So a step gathers no base
weight it would not gather anyway, and the factors meet the activations where those already are.

A step nests the base parameters by module and `attach` puts each weight's `LoraFactors` beside it, under the
module's "lora" entry (`{"weight": W, "lora": {"weight": factors}}`; the experts' `{"gate_up_proj": W, ...,
"lora": {"gate_up_proj": factors}}`): `nn.linear` and the experts module apply them. No base array is copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.mesh import PP, spec_entry
from ..distributed.sharding import parallel_dims
from ..models.layer_stack import LayerStack
from ..module_tree import ModuleTree, ParamSpec
from ..ops.lora import LoraFactors, merged_weight
from .config import LoraConfig
from .targets import Target, find_targets


def factor_names(target: Target) -> tuple[str, str]:
    """The per-layer names of a target's A and B (see the module docstring)."""
    if target.experts is None:
        return f"{target.module}.lora_A.weight", f"{target.module}.lora_B.weight"
    return f"{target.parameter}.lora_A", f"{target.parameter}.lora_B"


@dataclass(frozen=True)
class Attachment:
    """One stored weight's factors: the module path in the nested parameters, the weight's key in it, and the
    storage names of A and B."""

    module_path: tuple[str, ...]
    weight: str
    a: str
    b: str


def _factor_specs(target: Target, dims: list[tuple[str, ...]]) -> tuple[P, P]:
    """The PartitionSpecs of A and B from the adapted weight's tensor / expert parallel dims (`parallel_dims`)."""
    entry = spec_entry
    if target.experts is None:
        out_dim, in_dim = dims
        return P(None, entry(in_dim)), P(entry(out_dim), None)
    experts, first, second = dims
    in_dim, out_dim = (first, second) if target.transposed else (second, first)
    return P(entry(experts), None, entry(in_dim)), P(entry(experts), entry(out_dim), None)


class AdapterLayout:
    """The adapter of one `LoraConfig` on one built model: its targets, names, shapes, shardings and storage."""

    def __init__(self, model, config: LoraConfig):
        self.config = config
        self.scaling = config.scaling
        self.targets: list[Target] = find_targets(config, model.module_tree, model.family)
        self.dtype = model.dtype
        tree = ModuleTree()
        self.specs: dict[str, P] = {}            # per-layer name -> PartitionSpec (one layer's)
        self.target_of: dict[str, Target] = {}   # per-layer factor name -> its target
        for target in self.targets:
            shape = model.module_tree.params[target.parameter].shape
            dims, _ = parallel_dims(target.parameter, shape, model.resolved_plans, model.layout)
            specs = _factor_specs(target, dims)
            for name, factor_shape, spec in zip(factor_names(target), target.factor_shapes(config.r), specs):
                tree.params[name] = ParamSpec(factor_shape)
                self.specs[name] = spec
                self.target_of[name] = target
        self.tree = tree
        base_stack = model.layer_stack
        self.stack = LayerStack(base_stack.runs, tree, base_stack.pipeline)
        self.mesh = model.mesh
        self.attachments = self._attachments(base_stack)

    def _attachments(self, base_stack: LayerStack) -> tuple[Attachment, ...]:
        attachments = {}
        for target in self.targets:
            storage = base_stack.storage_of(target.parameter)
            if storage in attachments:
                continue
            a, b = (self.stack.storage_of(name) for name in factor_names(target))
            attachments[storage] = Attachment(tuple(storage.split(".")[:-1]), target.name, a, b)
        return tuple(attachments.values())

    # ---- storage --------------------------------------------------------------------------------------
    @property
    def storage_names(self) -> list[str]:
        return list(self.stack.members)

    def storage_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for storage, names in self.stack.members.items():
            shape = self.tree.params[self.stack.first_member(storage)].shape
            shapes[storage] = ((len(names),) if self.stack.is_stacked(storage) else ()) + shape
        return shapes

    def storage_shardings(self) -> dict[str, NamedSharding]:
        """Storage name -> NamedSharding (a stacked entry: its layers' spec behind the layer axis, which the
        pipeline stages split as the model's parameters')."""
        stage_axis = PP if self.stack.pipeline is not None else None
        shardings = {}
        for storage in self.stack.members:
            spec = self.specs[self.stack.first_member(storage)]
            shardings[storage] = NamedSharding(self.mesh, P(stage_axis, *spec) if self.stack.is_stacked(storage)
                                               else spec)
        return shardings

    def abstract(self) -> dict[str, jax.ShapeDtypeStruct]:
        shardings = self.storage_shardings()
        return {name: jax.ShapeDtypeStruct(shape, self.dtype, sharding=shardings[name])
                for name, shape in self.storage_shapes().items()}

    def check(self, adapter: Mapping[str, Any]) -> None:
        """`adapter` holds this layout's storage names and shapes (ValueError naming what differs)."""
        expected = self.storage_shapes()
        missing, unexpected = sorted(expected.keys() - adapter.keys()), sorted(adapter.keys() - expected.keys())
        wrong = [f"{name}: {tuple(adapter[name].shape)} != {expected[name]}" for name in expected.keys() & adapter.keys()
                 if tuple(adapter[name].shape) != expected[name]]
        if missing or unexpected or wrong:
            raise ValueError(f"the adapter does not fit the model's adapter layout: missing {missing[:4]}, unexpected "
                             f"{unexpected[:4]}, wrong shapes {wrong[:4]}.")

    # ---- values ----------------------------------------------------------------------------------------
    def init(self, seed: int = 0) -> dict[str, jax.Array]:
        """PEFT's initialisation, each array made in its sharding: A kaiming-uniform (a = sqrt(5), so
        U(-1/sqrt(I), 1/sqrt(I)) with I = in features, per expert), B zeros, so the adapted model starts as the
        base. The draws are JAX's (not torch's), from `seed`."""
        names = list(self.tree.params)

        def create(key):
            values = {}
            for index, name in enumerate(names):
                spec = self.tree.params[name]
                if ".lora_B" in name:
                    values[name] = jnp.zeros(spec.shape, self.dtype)
                    continue
                bound = 1.0 / math.sqrt(spec.shape[-1])
                values[name] = jax.random.uniform(jax.random.fold_in(key, index), spec.shape, jnp.float32,
                                                  -bound, bound).astype(self.dtype)
            return self.stack.stack(values)

        return jax.jit(create, out_shardings=self.storage_shardings())(jax.random.key(seed))

    def place(self, per_layer: Mapping[str, Any]) -> dict[str, jax.Array]:
        """Per-layer arrays (numpy or jax, the names of `self.tree`) -> the adapter in its storage and shardings."""
        shardings = {name: NamedSharding(self.mesh, spec) for name, spec in self.specs.items()}
        placed = {name: jax.device_put(jnp.asarray(per_layer[name], self.dtype), shardings[name])
                  for name in self.tree.params}
        return jax.jit(self.stack.stack, out_shardings=self.storage_shardings())(placed)

    def per_layer(self, adapter: Mapping[str, Any]) -> Mapping[str, Any]:
        """The adapter under per-layer names (stacked layers sliced lazily)."""
        return self.stack.unstack(adapter)

    # ---- the step ---------------------------------------------------------------------------------------
    def attach(self, nested: dict, adapter: Mapping[str, Any]) -> dict:
        """The nested base parameters with each adapted weight's `LoraFactors` under its module's "lora" entry."""
        for attachment in self.attachments:
            factors = LoraFactors(adapter[attachment.a], adapter[attachment.b], self.scaling)
            nested = _with_factors(nested, attachment.module_path, attachment.weight, factors)
        return nested

    def merged(self, params: Mapping[str, Any], adapter: Mapping[str, Any], base_stack: LayerStack,
               shardings: Mapping[str, NamedSharding]) -> dict[str, Any]:
        """`params` (storage layout) with every adapted weight replaced by W + scaling * B A (PEFT's merge); the
        others are the same arrays."""
        by_storage = {}
        for target in self.targets:
            storage = base_stack.storage_of(target.parameter)
            a, b = (self.stack.storage_of(name) for name in factor_names(target))
            by_storage[storage] = (a, b, target.transposed, base_stack.is_stacked(storage))

        def merge(weights, factors):
            merged = {}
            for storage, (a, b, transposed, stacked) in by_storage.items():
                one = partial(merged_weight, transposed=transposed)
                apply = jax.vmap(one) if stacked else one
                merged[storage] = apply(weights[storage], LoraFactors(factors[a], factors[b], self.scaling))
            return merged

        merged = jax.jit(merge, out_shardings={name: shardings[name] for name in by_storage})(
            {name: params[name] for name in by_storage}, dict(adapter))
        return {name: merged.get(name, value) for name, value in params.items()}


def _with_factors(nested: dict, path: tuple[str, ...], weight: str, factors: LoraFactors) -> dict:
    """A copy of `nested` along `path` (dicts only; arrays shared) with factors at path + ("lora", weight)."""
    if not path:
        return {**nested, "lora": {**nested.get("lora", {}), weight: factors}}
    head, *rest = path
    return {**nested, head: _with_factors(nested[head], tuple(rest), weight, factors)}
