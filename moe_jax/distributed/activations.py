"""Activation layouts: dims named by logical axes, mapped to mesh axes by one rules table from the plans.

Layer code names what each dim of an activation is, `constrain(q, ("batch", "length", "heads"))`, and never a
module or a mesh axis (MaxText's `logical_axis_rules`, in this library's terms). One `LogicalAxisRules` per
model, built once from its `DeviceLayout` and resolved TP plan (`logical_axis_rules`), maps each name:

    batch               the batch axes: FSDP gathers weights, never the batch
    length              the cp axes (context parallelism, `distributed.context`), else whole
    sequence            the residual stream's sequence: the cp axes, then tp's under sequence parallelism
                        (`enable_sequence_parallel`: tp's all-reduce of a rowwise output becomes a
                        reduce-scatter, and the next colwise input an all-gather, Megatron's SP)
    tokens              the batch axes, then the cp axes: [B*S] rows flattened batch-major (router logits)
    embed               never split: the residual stream is whole over tp, as every HF TP block ends with a
                        reduced (rowwise) or gathered output
    heads, kv_heads, mlp, experts, vocab, q_lora, kv_lora
                        output features of projections: the tp axes when the plan rule of every module that
                        outputs the axis (the model's `output_axes`) keeps its output split on its last dim
                        (colwise, packed_colwise), otherwise None (no rule, rowwise, gathered, replicated,
                        or rules that disagree)
    head_rows           the tp axes the LM head's weight splits its vocab rows over: the logits' layout, left
                        where the head's dot computes them (a gathered head's too: a global array is whole to
                        its readers, and gathering [B, S, V] onto every device costs more than the model's dot)

so a TP block is colwise [B, S, out] P(batch, None, tp) -> rowwise [B, S, H] P(batch, None, None) with one
reduction over tp, and a user's `tp_plan` override of a projection (verbatim HF names) moves the axis its
output carries. A dim the mapped axes do not divide stays whole (an unsplittable batch, a width tp does not
divide). Without a mesh every constraint is the identity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .mesh import PP, DeviceLayout, spec_entry
from .plans import replace_layer_number_by_wildcard
from .styles import ALL_PARALLEL_STYLES, SHARDED_LAST_DIM

# Logical axes whose mesh axes do not depend on plan rules, and those a projection's rule decides.
BATCH_AXES = ("batch", "tokens", "length", "sequence")
WHOLE_AXES = ("embed",)
PLANNED_AXES = ("heads", "kv_heads", "mlp", "experts", "vocab", "q_lora", "kv_lora")
WEIGHT_AXES = ("head_rows",)
# A dim laid out as the compiler chooses (e.g. the loss's vocab: split over tp where the head's weight is).
UNCONSTRAINED = "unconstrained"
LOGICAL_AXES = BATCH_AXES + WHOLE_AXES + PLANNED_AXES + WEIGHT_AXES

MeshAxes = tuple[str, ...] | None


@dataclass(frozen=True)
class LogicalAxisRules:
    """The rules table: `rules` maps every name of `LOGICAL_AXES` to mesh axes (None: the dim is whole);
    `axis_sizes` holds the mesh axes' sizes, to leave whole a dim they do not divide."""

    rules: tuple[tuple[str, MeshAxes], ...]
    axis_sizes: tuple[tuple[str, int], ...]

    @cached_property
    def _table(self) -> dict[str, MeshAxes]:
        return dict(self.rules)

    def mesh_axes(self, name: str) -> tuple[str, ...]:
        """The mesh axes logical axis `name` is split over (() when whole)."""
        if name not in self._table:
            raise KeyError(f"Unknown logical axis {name!r}; use one of {', '.join(self._table)}.")
        return self._table[name] or ()

    def size(self, name: str) -> int:
        """How many ways logical axis `name` is split."""
        sizes = dict(self.axis_sizes)
        return math.prod(sizes[axis] for axis in self.mesh_axes(name))

    def spec(self, logical_axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None) -> P:
        """One logical name (or None: whole; UNCONSTRAINED: the compiler's choice) per dim -> PartitionSpec;
        with `shape`, a dim the mapped mesh axes do not divide stays whole."""
        if shape is not None and len(shape) != len(logical_axes):
            raise ValueError(f"logical axes {logical_axes} name {len(logical_axes)} dims; the array has "
                             f"shape {tuple(shape)}")
        entries = []
        for dim, name in enumerate(logical_axes):
            if name == UNCONSTRAINED:
                entries.append(P.UNCONSTRAINED)
                continue
            axes = () if name is None else self.mesh_axes(name)
            if shape is not None and axes and shape[dim] % self.size(name):
                axes = ()
            entries.append(spec_entry(axes))
        return P(*entries)


def _keeps_output_split(style: str | None) -> bool:
    return style is not None and ALL_PARALLEL_STYLES[style].output == SHARDED_LAST_DIM


def logical_axis_rules(layout: DeviceLayout, tp_plan: Mapping[str, str],
                       output_axes: Mapping[str, str], head_rows: tuple[str, ...] = ()) -> LogicalAxisRules:
    """The rules table of one model on one layout.

    tp_plan: the resolved TP plan (concrete or `*` names: HF module -> style). output_axes: HF module name
    (`*` for the layer) -> the logical axis of its output's last dim, for every module of the model whose
    output is constrained with a name of `PLANNED_AXES`. Such an axis maps to the tp axes when every module
    that outputs it has a rule keeping its output split (`SHARDED_LAST_DIM`), else to None. head_rows: the
    tp axes the LM head's weight splits its vocab rows over (`head_rows`).
    """
    if unknown := sorted(set(output_axes.values()) - set(PLANNED_AXES)):
        raise ValueError(f"output_axes names {unknown}; outputs are one of {', '.join(PLANNED_AXES)}.")
    styles = {replace_layer_number_by_wildcard(name): style for name, style in tp_plan.items()}
    rules: list[tuple[str, MeshAxes]] = [("batch", layout.batch_axes or None), ("tokens", layout.token_axes or None),
                                         ("length", layout.cp_axes or None),
                                         ("sequence", layout.sequence_axes or None)]
    rules += [(name, None) for name in WHOLE_AXES]
    for axis in PLANNED_AXES:
        modules = [module for module, name in output_axes.items() if name == axis]
        split = bool(modules) and all(_keeps_output_split(styles.get(module)) for module in modules)
        rules.append((axis, layout.tp_axes if split and layout.tp_axes else None))
    rules.append(("head_rows", tuple(head_rows) or None))
    return LogicalAxisRules(tuple(rules), tuple(layout.axis_sizes.items()))


class ActivationLayouts:
    """`constrain(x, logical_axes)` / `batch(x)` / `token_local(fn)` for one model on one mesh."""

    def __init__(self, mesh: jax.sharding.Mesh | None, rules: LogicalAxisRules):
        self.mesh = mesh
        self.rules = rules

    @property
    def _active(self) -> bool:
        return self.mesh is not None and self.mesh.size > 1

    def constrain(self, x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
        """x laid out as its dims' logical axes say (one name, or None for whole, per dim of x)."""
        if not self._active:
            return x
        spec = self.rules.spec(logical_axes, x.shape)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def constrain_staged(self, x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
        """x: [stages, ...] with the stage axis over `pp` (a pipeline's per-stage state) and the other dims
        laid out as `logical_axes` say."""
        if not self._active:
            return x
        spec = self.rules.spec(logical_axes, x.shape[1:])
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(PP, *spec)))

    def batch(self, x: jax.Array) -> jax.Array:
        """x: [B, ...] with B on the batch axes and every other dim whole (inputs, masks)."""
        return self.constrain(x, ("batch",) + (None,) * (x.ndim - 1))

    def token_local(self, fn):
        """`fn` over rows [N, ...] -> pytree of [N, ...], run on each device's own rows (in `shard_map`).

        For per-token ops XLA's partitioner does not keep local (`top_k` on a batch-sharded operand is
        gathered whole first): routing stays on the devices that hold the tokens."""
        if not self._active:
            return fn
        rows_split = self.rules.size("tokens")

        def run(*rows):
            if any(row.shape[0] % rows_split for row in rows):
                return fn(*rows)
            spec = P(spec_entry(self.rules.mesh_axes("tokens")))
            return jax.shard_map(fn, mesh=self.mesh, in_specs=spec, out_specs=spec,
                                 check_vma=self.mesh.shape.get(PP, 1) == 1)(*rows)  # see experts.py

        return run
