"""Routing replay's layouts and host checks: the public routing array [B, L, S, K] (L: the sparse layers, K:
top_k; logical expert ids, -1 where a token routes itself) against the step's per-layer rows.

A forward with `return_routing=True` records what each sparse layer ran (`ModelOutput.routing`); a later
forward or train step given that array (`routing=`) runs the same experts, weighted by its own router
(`ops.routing`): the train step then computes what the sampler computed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def layer_rows(routing, sparse_layers: list[int], num_layers: int) -> jax.Array:
    """routing: [B, L, S, K] -> [num_layers, B, S, K] int32, each sparse layer's ids at its layer's row, -1 in
    the dense layers' rows (which never read them): a scanned run or a pipeline stage slices it by layer number."""
    routing = jnp.asarray(routing, jnp.int32)
    batch, _, sequence, top_k = routing.shape
    rows = jnp.full((num_layers, batch, sequence, top_k), -1, jnp.int32)
    return rows.at[np.asarray(sparse_layers)].set(routing.swapaxes(0, 1))


def recorded(per_layer: list[jax.Array], batch: int) -> jax.Array:
    """per_layer: each sparse layer's ids [B*S, K] -> [B, L, S, K] (the public layout)."""
    stacked = jnp.stack(per_layer)                                         # [L, B*S, K]
    return stacked.reshape(stacked.shape[0], batch, -1, stacked.shape[-1]).swapaxes(0, 1)


def check_routing(routing, shape: tuple[int, ...], num_sparse: int, top_k: int, num_experts: int,
                  model_name: str) -> None:
    """`routing` fits input_ids of `shape` [B, S] on a model with `num_sparse` sparse layers (ValueError naming
    the bad value and the fix). Its ids are checked only when it is a host array: a device array is never read."""
    if num_sparse == 0:
        raise ValueError(f"routing was passed, but this {model_name} has no sparse (MoE) layers, so there is no "
                         "routing to replay: drop routing= (and routing_replay=True).")
    expected = (shape[0], num_sparse, shape[1], top_k)
    got = tuple(np.shape(routing))
    if got != expected:
        raise ValueError(f"routing must be [batch, sparse_layers, seq, top_k] = {expected} for input_ids of shape "
                         f"{tuple(shape)}, got {got}; record it with return_routing=True on the same input_ids "
                         "(`ModelOutput.routing`).")
    if isinstance(routing, jax.Array):
        if not jnp.issubdtype(routing.dtype, jnp.integer):
            raise ValueError(f"routing must hold integer expert ids, got dtype {routing.dtype}.")
        return
    ids = np.asarray(routing)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"routing must hold integer expert ids, got dtype {ids.dtype}.")
    bad = ids[(ids < -1) | (ids >= num_experts)]
    if bad.size:
        raise ValueError(f"routing holds expert id {int(bad.flat[0])}, outside [0, {num_experts}) (-1 marks a token "
                         "that routes itself); pass logical expert ids recorded from a model of this config.")
