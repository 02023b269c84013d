"""The train state: everything a step reads and writes, as one donated pytree.

    state = init_train_state(model, optimizer, seed=0)         # params: model.params (copied)
    state.step, state.params, state.opt_state, state.rng, state.data_position, state.skipping
    state.capacity                                             # static: the dispatch capacity in force
    state.expert_placement, state.expert_load_window           # with redundant expert slots (else None)

`capacity` is a static field (part of the pytree structure, not an array): it sets the step's dispatch
buffer sizes, so each capacity is its own compilation and the loop switches capacity without reading the
device. `skipping` is the sticky overflow flag: once a step's dispatch overflowed, that step and every
later one return their input state unchanged until the loop, which reads the metrics one step late,
clears it and replays from the overflowed step at a larger capacity (`moe_jax.training.loop`).

With redundant expert slots (`num_redundant_experts`) the state also holds the `ExpertPlacement` the step runs
(an input: the loop re-places between steps without recompiling) and `expert_load_window`, the `expert_load`
added up since the last re-placement, each step counting `step.LOAD_WINDOW_DECAY` of the next one
(`TrainLoop(rebalance_every=)`), so a checkpoint resumes both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.eplb import ExpertPlacement
from .trainable import resolve_trainable


@dataclass(frozen=True)
class TrainState:
    """step: optimizer steps applied (int32); params: `model.params` layout; opt_state: the optimizer's
    state, laid out like its parameters; rng: uint32[2] base key (step keys are `fold_in(rng, step)`);
    data_position: batches consumed (int32; a replayed batch counts once); skipping: the sticky overflow
    flag (bool); capacity: the dispatch capacity in force (static; None without dispatch buffers);
    expert_placement: the `ExpertPlacement` the step runs, and expert_load_window: float32 [sparse layers, E], the
    real tokens per expert since the last re-placement, the latest step weighing most (both None without redundant
    expert slots)."""

    step: jax.Array
    params: dict[str, jax.Array]
    opt_state: Any
    rng: jax.Array
    data_position: jax.Array
    skipping: jax.Array
    capacity: float | None = None
    expert_placement: ExpertPlacement | None = None
    expert_load_window: jax.Array | None = None

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)

    def arrays(self) -> dict[str, Any]:
        """The checkpointed arrays (everything but the static capacity; the placement's as a dict)."""
        arrays = {field: getattr(self, field) for field in ARRAY_FIELDS}
        if self.expert_placement is not None:
            arrays["expert_placement"] = {name: getattr(self.expert_placement, name) for name in PLACEMENT_FIELDS}
            arrays["expert_load_window"] = self.expert_load_window
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any], capacity: float | None) -> TrainState:
        """The state of `arrays()`'s dict (as restored from a checkpoint)."""
        placement = arrays.get("expert_placement")
        return cls(**{field: arrays[field] for field in ARRAY_FIELDS}, capacity=capacity,
                   expert_placement=None if placement is None else ExpertPlacement(**placement),
                   expert_load_window=arrays.get("expert_load_window"))


ARRAY_FIELDS = ("step", "params", "opt_state", "rng", "data_position", "skipping")
PLACEMENT_FIELDS = ("physical_to_logical", "logical_to_physical", "replica_count")

jax.tree_util.register_dataclass(TrainState, data_fields=[*ARRAY_FIELDS, "expert_placement", "expert_load_window"],
                                 meta_fields=["capacity"])


def parameter_sharding_of(path, leaf, parameters: dict[str, NamedSharding], shapes: dict[str, tuple],
                        replicated: NamedSharding) -> NamedSharding:
    """The sharding of an optimizer-state leaf: that of the parameter it belongs to (the innermost dict key
    naming a parameter of the same shape: adam's mu / nu, momentum, ...), else replicated (counts)."""
    for entry in reversed(path):
        name = getattr(entry, "key", None)
        if isinstance(name, str) and name in parameters and tuple(leaf.shape) == tuple(shapes[name]):
            return parameters[name]
    return replicated


def train_state_shardings(model, optimizer: optax.GradientTransformation, capacity: float | None = None,
                          *, memory_kind: str | None = None, trainable=None) -> TrainState:
    """A `TrainState` of `NamedSharding` values: parameters as the plans lay them out, optimizer state like its
    parameters, scalars replicated. memory_kind: where parameters and optimizer state live ("pinned_host"
    for CPU offload; None: the device), or a (parameters', optimizer state's) pair to place them apart.
    trainable: the `TrainableParameters` the state holds (default: what `resolve_trainable` trains on this
    model)."""
    trainable = resolve_trainable(model) if trainable is None else trainable
    params_kind, opt_kind = memory_kinds(memory_kind)
    laid_out = trainable.shardings(model)

    def placed(kind):
        return laid_out if kind is None else {name: s.with_memory_kind(kind) for name, s in laid_out.items()}

    parameters, opt_parameters = placed(params_kind), placed(opt_kind)
    replicated = NamedSharding(model.mesh, P())
    abstract_params = abstract_parameters(model, trainable)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    shapes = trainable.shapes(model)
    opt_state = jax.tree_util.tree_map_with_path(
        lambda path, leaf: parameter_sharding_of(path, leaf, opt_parameters, shapes, replicated), abstract_opt_state
    )
    slots = model.num_redundant_experts > 0
    return TrainState(step=replicated, params=parameters, opt_state=opt_state, rng=replicated,
                      data_position=replicated, skipping=replicated, capacity=capacity,
                      expert_placement=ExpertPlacement(replicated, replicated, replicated) if slots else None,
                      expert_load_window=replicated if slots else None)


def memory_kinds(memory_kind) -> tuple[str | None, str | None]:
    """(the parameters', the optimizer state's) memory kind, of one kind for both or a pair."""
    return tuple(memory_kind) if isinstance(memory_kind, (tuple, list)) else (memory_kind, memory_kind)


def abstract_parameters(model, trainable=None) -> dict[str, jax.ShapeDtypeStruct]:
    """The trained arrays' shapes, dtypes and shardings (default: what `resolve_trainable` trains)."""
    trainable = resolve_trainable(model) if trainable is None else trainable
    shardings, dtypes = trainable.shardings(model), trainable.dtypes(model)
    return {name: jax.ShapeDtypeStruct(shape, dtypes[name], sharding=shardings[name])
            for name, shape in trainable.shapes(model).items()}


def abstract_train_state(model, optimizer: optax.GradientTransformation, capacity: float | None = None,
                         *, memory_kind: str | None = None, trainable=None) -> TrainState:
    """The state's shapes, dtypes and shardings without allocating it (restore targets, planning)."""
    trainable = resolve_trainable(model) if trainable is None else trainable
    shardings = train_state_shardings(model, optimizer, capacity, memory_kind=memory_kind, trainable=trainable)
    params = {name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=shardings.params[name])
              for name, leaf in abstract_parameters(model, trainable).items()}
    opt_state = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        jax.eval_shape(optimizer.init, params), shardings.opt_state,
    )
    scalar = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=shardings.step)  # noqa: E731
    placement = window = None
    if model.num_redundant_experts:
        placement = jax.tree.map(lambda leaf: scalar(jnp.int32, leaf.shape), model.identity_expert_placement())
        window = scalar(jnp.float32, (len(model.sparse_layers()), model.config.num_experts))
    return TrainState(step=scalar(jnp.int32), params=params, opt_state=opt_state, rng=scalar(jnp.uint32, (2,)),
                      data_position=scalar(jnp.int32), skipping=scalar(jnp.bool_), capacity=capacity,
                      expert_placement=placement, expert_load_window=window)


def init_train_state(model, optimizer: optax.GradientTransformation, *, seed: int = 0, params=None,
                     capacity: float | None = None, memory_kind: str | None = None, trainable=None) -> TrainState:
    """A fresh state: `params` (default: the trained arrays as the model holds them, `model.params` without an
    adapter; copied: the state is donated to the step), the optimizer's initial state created in its shardings,
    step and data position 0.

    capacity: the dispatch capacity to start at (default the first rung of `model.capacity_schedule`;
    None when the model has no dispatch buffers). trainable: the `TrainableParameters` the state holds. With
    redundant expert slots the state starts at the model's placement (`model.expert_placement`), window zero."""
    trainable = resolve_trainable(model) if trainable is None else trainable
    if params is None:
        if model.params is None:
            raise ValueError("The model has no parameters: call init_params(), set_params() or from_pretrained() "
                             "first.")
        params = trainable.initial(model)
    if capacity is None and model.layout.ep_size > 1:
        capacity = model.capacity_schedule.start().capacity
    elif capacity is not None:
        capacity = model.capacity_schedule.check(capacity)
    shardings = train_state_shardings(model, optimizer, capacity, memory_kind=memory_kind, trainable=trainable)

    def create(params, placement):
        params = jax.tree.map(jnp.copy, params)
        zero = jnp.zeros((), jnp.int32)
        window = None if placement is None else jnp.zeros((len(model.sparse_layers()), model.config.num_experts))
        return TrainState(step=zero, params=params, opt_state=optimizer.init(params),
                          rng=jax.random.PRNGKey(seed), data_position=zero, skipping=jnp.zeros((), jnp.bool_),
                          capacity=capacity, expert_placement=jax.tree.map(jnp.copy, placement),
                          expert_load_window=window)

    return jax.jit(create, out_shardings=shardings)(params, model.expert_placement)
