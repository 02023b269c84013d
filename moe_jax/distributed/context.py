"""Context parallelism: each sequence of a batch split over `cp_size` devices (the `cp` and `ep_cp` mesh axes).

Every op but attention is token-wise, so it runs on each device's slice of the sequence as it is. Attention
needs the other slices' keys and values: `nn.context_attention` gathers them ("all_gather") or passes them
around the ring ("ring"). Under a causal mask the last slice of a sequence sees every key and the first almost
none, so the sequence is laid out zig-zag before it is split (`ContextLayout.order`): with the sequence cut into
2 * cp chunks, rank r holds chunks r and 2 * cp - 1 - r, and every rank does the same attention work.

The model runs on the tokens in that order; every mask compares each token's original index, carried beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .mesh import PP, DeviceLayout, spec_entry


def zigzag_order(length: int, cp: int) -> np.ndarray:
    """[length] the original index of each slot when rank r holds chunks r and 2 cp - 1 - r of 2 cp chunks."""
    if length % (2 * cp):
        raise ValueError(
            f"sequence length {length} cannot be split over cp_size={cp}: context parallelism cuts each sequence "
            f"into 2 * cp_size = {2 * cp} equal chunks (zig-zag, for an even causal load); pad or pack the batch "
            f"to a multiple of {2 * cp} tokens.")
    chunk = length // (2 * cp)
    chunks = np.arange(length).reshape(2 * cp, chunk)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


@dataclass(frozen=True)
class ContextLayout:
    """One model's context parallelism on its mesh: `cp` devices over mesh `axes`, attention by `strategy`."""

    mesh: jax.sharding.Mesh
    axes: tuple[str, ...]
    size: int
    strategy: str

    @classmethod
    def of(cls, mesh, layout: DeviceLayout, strategy: str) -> ContextLayout | None:
        """The context layout of a model, or None without context parallelism (or without a mesh)."""
        if layout.cp_size == 1 or mesh is None:
            return None
        return cls(mesh, layout.cp_axes, layout.cp_size, strategy)

    def order(self, length: int) -> np.ndarray:
        """[length] original index of each slot of the context order (`zigzag_order`)."""
        return zigzag_order(length, self.size)

    def to_context_order(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """x with its sequence `axis` (natural order) laid out in the context order."""
        return jnp.take(x, jnp.asarray(self.order(x.shape[axis])), axis=axis)

    def to_natural_order(self, x: jax.Array, axis: int = 1) -> jax.Array:
        """The inverse of `to_context_order`."""
        return jnp.take(x, jnp.asarray(np.argsort(self.order(x.shape[axis]))), axis=axis)

    def rank(self) -> jax.Array:
        """Inside `shard_sequence`: this device's position along cp (0 .. size - 1)."""
        return jax.lax.axis_index(self.axes)

    def sequence_spec(self, *entries) -> P:
        """The PartitionSpec of an array [B, S, ...] whose S is split over cp: `entries` for B, then the rest."""
        batch, *rest = entries
        return P(batch, spec_entry(self.axes), *rest)

    def shard_sequence(self, fn, arguments: tuple, in_specs: tuple, out_spec: P):
        """fn(*local arguments) on each device's slice, manual over every mesh axis (`in_specs` say how each
        argument splits; those of sequences split S over cp, `sequence_spec`) -> one array laid out `out_spec`."""
        # Under a pipeline's vmap over stages JAX's mesh-variance types lose track of `pp` (as in
        # `distributed.experts`); the pipeline's parity with pp 1 checks this body without them.
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_spec,
                             check_vma=self.mesh.shape.get(PP, 1) == 1)(*arguments)
