"""Activation layouts from the plans: sharding constraints at module boundaries.

Parameter shardings alone leave XLA free to move activations instead of weights. Each module's output is
pinned to what its style declares (`ParallelStyle.output`), with the batch dim always on the batch axes:

    colwise            [B, S, out]  P(batch, None, tp)     stays split: no collective before the rowwise
    rowwise            [B, S, H]    P(batch, None, None)   one reduction over tp per block
    no rule / others   [B, S, ...]  P(batch, None, ...)    weights are gathered under FSDP, never activations

so a TP block is colwise -> rowwise with one all-reduce, and FSDP gathers weights while the batch stays
where it is. Model code calls `layouts.output(x, "model.layers.*.self_attn.q_proj")` (or `batch(x)`);
without a mesh every call is the identity.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .mesh import DeviceLayout, spec_entry
from .plans import replace_layer_number_by_wildcard
from .styles import ALL_PARALLEL_STYLES, EXPERT_DISPATCH, REPLICATED, SHARDED_LAST_DIM


class ActivationLayouts:
    """`output(x, module)` / `batch(x)` constraints for one model on one mesh."""

    def __init__(self, mesh: jax.sharding.Mesh | None, layout: DeviceLayout, tp_plan: dict[str, str]):
        self.mesh = mesh
        self.layout = layout
        # Plans arrive expanded per layer; the model asks with wildcards ("model.layers.*.mlp.down_proj").
        self.styles = {replace_layer_number_by_wildcard(name): style for name, style in tp_plan.items()}

    def _constrain(self, x: jax.Array, last_dim_axes: tuple[str, ...] = ()) -> jax.Array:
        if self.mesh is None or self.mesh.size == 1:
            return x
        batch_axes = self.layout.batch_axes
        if x.shape[0] % self.layout.group_size("batch"):
            batch_axes = ()  # an unsplittable batch (checked by the model's entry points) stays whole
        last = spec_entry(last_dim_axes) if x.ndim > 1 else None
        spec = P(spec_entry(batch_axes), *([None] * (x.ndim - 2)), last) if x.ndim > 1 else P(spec_entry(batch_axes))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def batch(self, x: jax.Array) -> jax.Array:
        """x: [B, ...] with B on the batch axes and every other dim whole."""
        return self._constrain(x)

    def token_local(self, fn):
        """`fn` over rows [N, ...] -> pytree of [N, ...], run on each device's own rows (in `shard_map`).

        For per-token ops XLA's partitioner does not keep local (`top_k` on a batch-sharded operand is
        gathered whole first): routing stays on the devices that hold the tokens."""
        if self.mesh is None or self.mesh.size == 1:
            return fn

        def run(*rows):
            if any(row.shape[0] % self.layout.group_size("batch") for row in rows):
                return fn(*rows)
            spec = P(spec_entry(self.layout.batch_axes))
            return jax.shard_map(fn, mesh=self.mesh, in_specs=spec, out_specs=spec)(*rows)

        return run

    def output(self, x: jax.Array, module: str) -> jax.Array:
        """x: [B, ..., F], the output of `module` (HF name, `*` for the layer), laid out as its style says."""
        style_name = self.styles.get(module)
        if style_name is None:
            return self.batch(x)
        kind = ALL_PARALLEL_STYLES[style_name].output
        if kind == SHARDED_LAST_DIM and x.shape[-1] % self.layout.tp_size == 0:
            return self._constrain(x, self.layout.tp_axes)
        if kind in (REPLICATED, SHARDED_LAST_DIM, EXPERT_DISPATCH):
            return self.batch(x)
        return x  # "unchanged": the style leaves its input's layout as it is
