"""Inside `shard_map`, values carry the set of mesh axes they vary over, and both branches of a `cond`
(or the carry of a `scan`) must agree on it. Outside `shard_map` every set is empty and this is a no-op."""

from __future__ import annotations

import jax


def varying_axes(*arrays) -> frozenset[str]:
    axes: frozenset[str] = frozenset()
    for array in jax.tree.leaves(arrays):
        axes |= jax.typeof(array).manual_axis_type.varying
    return axes


def vary_like(array: jax.Array, *like) -> jax.Array:
    """`array` marked as varying over every mesh axis any of `like` varies over."""
    missing = tuple(sorted(varying_axes(*like) - varying_axes(array)))
    return jax.lax.pcast(array, missing, to="varying") if missing else array


def vary_over(array: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`array` marked as varying over the mesh `axes` (before a collective over them)."""
    missing = tuple(axis for axis in axes if axis not in varying_axes(array))
    return jax.lax.pcast(array, missing, to="varying") if missing else array
