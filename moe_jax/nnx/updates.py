"""Helpers for NNX training loops: optimizer state placed on the mesh, dropless updates below the largest
dispatch capacity."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .module import MoeCausalLM


def update_unless_dropped(optimizer: nnx.Optimizer, model: MoeCausalLM, grads) -> jax.Array:
    """`optimizer.update(model, grads)` inside a jitted step, undone (an elementwise select, no host read)
    when the model's last call dropped (token, expert) pairs: those gradients are not the model's. Returns
    whether the update was applied (bool scalar). The loop then calls `model.update_capacity()`, which
    raises the capacity and says to run the step again::

        applied = train_step(model, optimizer, batch)      # nnx.jit; uses update_unless_dropped
        while model.update_capacity():                     # the step dropped pairs: replay it
            applied = train_step(model, optimizer, batch)

    At the largest capacity (the module's default) nothing is ever dropped and this equals `optimizer.update`.
    """
    keep = model.dispatch_statistics.get_value().dropped == 0
    params_before = nnx.as_pure(nnx.state(model, optimizer.wrt))
    optimizer_before = nnx.as_pure(nnx.state(optimizer))
    optimizer.update(model, grads)
    select = lambda new, old: jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)  # noqa: E731
    nnx.update(model, select(nnx.as_pure(nnx.state(model, optimizer.wrt)), params_before))
    nnx.update(optimizer, select(nnx.as_pure(nnx.state(optimizer)), optimizer_before))
    return keep


def commit_to_mesh(node, model: MoeCausalLM):
    """Place every uncommitted array of `node`'s state (an `nnx.Optimizer`'s step and optax's counts, made
    by `jnp.array` on one device) replicated on the model's mesh, where a jitted step returns them; the
    step's second call would otherwise see new input shardings and compile the whole step again. Sharded
    arrays (parameters, Adam's moments, created like their parameters) are left as they are. Returns
    `node`.

        optimizer = commit_to_mesh(nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param), model)
    """
    replicated = NamedSharding(model.engine.mesh, P())
    arrays = nnx.as_pure(nnx.state(node))
    placed = jax.tree.map(lambda x: x if getattr(x, "committed", True) else jax.device_put(x, replicated), arrays)
    nnx.update(node, placed)
    return node
