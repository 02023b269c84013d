"""New weights for compiled programs: a trainer's parameters (or LoRA adapter arrays) checked against the ones the
programs were compiled on, and placed like them, so the next step runs them without recompiling.

    params = updated_arrays(engine_params, state.params, "params")   # same names and shapes; cast; resharded

The trainer's layout may differ from the sampler's (another mesh split, fp32 masters): each floating array is cast
to its current dtype and `jax.device_put` into its current sharding, a device-to-device copy (no host round trip
for arrays already on devices).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def updated_arrays(current: Any, new: Any, what: str) -> Any:
    """new: a tree like `current` (jax or numpy arrays) -> it with every leaf cast to its current leaf's dtype (floating
    leaves only; other dtypes must match) and placed in its sharding. ValueError naming the first key whose tree
    position, shape or dtype does not fit (`what` names the tree: "params", "adapter")."""
    if new is current:
        return current
    if current is None:
        raise ValueError(f"new {what} were passed, but the engine holds none to replace (e.g. an adapter on a model "
                         "without one: add_adapter() or load_adapter() before building the engine).")
    now, structure = jax.tree_util.tree_flatten_with_path(current)
    given = dict(jax.tree_util.tree_flatten_with_path(new)[0])
    names = {path: jax.tree_util.keystr(path) for path, _ in now}
    for path, _ in now:
        if path not in given:
            raise ValueError(f"{what}{names[path]} is missing from the new {what} (they must hold every array the "
                             "engine holds, under the same names).")
    extra = sorted(jax.tree_util.keystr(path) for path in set(given) - set(names))
    if extra:
        raise ValueError(f"{what}{extra[0]} is not one of the engine's {what} (the new tree must have the same "
                         "names and nesting).")
    leaves = []
    for path, old in now:
        value = given[path]
        shape, dtype = tuple(getattr(value, "shape", ())), np.dtype(getattr(value, "dtype", np.asarray(value).dtype))
        if shape != tuple(old.shape):
            raise ValueError(f"{what}{names[path]} has shape {shape}; the engine's is {tuple(old.shape)}.")
        if dtype != old.dtype and not (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(old.dtype, jnp.floating)):
            raise ValueError(f"{what}{names[path]} has dtype {dtype}; the engine's is {old.dtype} (only floating "
                             "arrays are cast, e.g. fp32 masters to bfloat16).")
        leaves.append((value, old))
    placed = [jax.device_put(value if value.dtype == old.dtype else value.astype(old.dtype), old.sharding)
              if isinstance(value, jax.Array) else jax.device_put(np.asarray(value, old.dtype), old.sharding)
              for value, old in leaves]
    return jax.tree_util.tree_unflatten(structure, placed)
