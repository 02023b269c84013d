"""The bytes one device holds of a model's train state, from its shardings alone (no devices, nothing allocated).

    state = train_state_bytes(abstract_model, build_optimizer("adamw", 1e-3))
    state.parameters, state.optimizer, state.gradients        # per device

Each stored parameter's shard is its sharding's local shape (a stacked run: its rows, split over the pipeline
stages when there are stages); each optimizer leaf is laid out like the parameter it belongs to (the innermost
path key naming a parameter of the same shape, as `train_state_shardings` does) or whole. The optimizer is the
train step's: buffers get no state (`freeze_buffers`). Gradients are the step's float32 sums, one per
parameter shard. Every device of a layout holds shards of the same shapes, so these are every device's bytes:
what `moe-jax plan --train` reports for the busiest one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np
import optax

from ..training.optimizers import freeze_buffers


@dataclass(frozen=True)
class StateBytes:
    parameters: int
    optimizer: int
    gradients: int

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer + self.gradients


def local_storage_shapes(model) -> dict[str, tuple[int, ...]]:
    """Storage name -> the shape one device stores of it (`model.params`' layout)."""
    stack = model.layer_stack
    stages = model.layout.pp_size if stack.pipeline is not None else 1
    shapes = {}
    for storage, members in stack.members.items():
        local = model.param_layouts[stack.first_member(storage)].local_shape
        shapes[storage] = ((len(members) // stages,) if stack.is_stacked(storage) else ()) + tuple(local)
    return shapes


_STATE_SHAPES: dict = {}


def _optimizer_state_shapes(optimizer, model, storage: tuple):
    """The optimizer state's shapes for parameters of `storage` ((name, shape, dtype), ...), traced once per
    storage layout and optimizer: layouts without pipeline stages store the same shapes, only sharded apart."""
    key = (id(optimizer), storage, frozenset(model.module_tree.buffers()))
    if key not in _STATE_SHAPES:
        abstract = {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape, dtype in storage}
        _STATE_SHAPES[key] = (optimizer, jax.eval_shape(freeze_buffers(optimizer, model).init, abstract))
    return _STATE_SHAPES[key][1]


def train_state_bytes(model, optimizer: optax.GradientTransformation) -> StateBytes:
    """model: built with `abstract=True` or on a mesh; optimizer: as given to `make_train_step`."""
    local = local_storage_shapes(model)
    dtypes = model.storage_dtypes()
    global_shapes = model.storage_shapes()
    parameters = sum(math.prod(shape) * np.dtype(dtypes[name]).itemsize for name, shape in local.items())
    gradients = sum(math.prod(shape) * np.dtype(np.float32).itemsize for shape in local.values())
    opt_state = _optimizer_state_shapes(optimizer, model, tuple((name, tuple(shape), np.dtype(dtypes[name]).name)
                                                                 for name, shape in global_shapes.items()))

    def leaf_bytes(path, leaf) -> int:
        for entry in reversed(path):
            name = getattr(entry, "key", None)
            if isinstance(name, str) and name in local and tuple(leaf.shape) == tuple(global_shapes[name]):
                return math.prod(local[name]) * np.dtype(leaf.dtype).itemsize
        return math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize

    optimizer_bytes = sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(leaf_bytes, opt_state)))
    return StateBytes(parameters, int(optimizer_bytes), gradients)
