"""Parallel styles: what a plan's style name means for a parameter's sharding and a module's output.

The registry holds the reference's style names in its registration order (the order shows in the
"Unsupported styles" error). A style says two things:

- `param_dims(shape)`: which dimension of a parameter is split, and over which logical device group
  ("tp" or "ep"); a `PartitionSpec` is built from it by `moe_jax.distributed.sharding.parameter_sharding` with the mesh axes of
  `moe_jax.distributed.mesh.DeviceLayout`.
- `output`: the layout of the module's output activation ("replicated", "sharded_last_dim", ...), used to
  constrain activations and documented in `moe-jax plan`.

PyTorch placements in JAX terms (`Shard(d)` = mesh axes at position d of the PartitionSpec):

    colwise          Linear [out, in]   P(tp, None)      output [.., out] sharded on last dim
    rowwise          Linear [out, in]   P(None, tp)      partial sums -> psum -> replicated
    embedding_rowwise Embedding [V, H]  P(tp, None)      masked lookup -> psum -> replicated
    packed_colwise   experts [E, 2I, H] P(None, tp, None) device t holds rows chunk t of [gate; up]
    grouped_gemm     experts [E, ...]   P(ep, ...)        whole experts per device (EP)

`packed_colwise`/`packed_rowwise`: the reference keeps `[gate_t ; up_t]` on device t (a strided shard);
a `jax.Array` cannot describe a strided shard, so we split the fused dimension contiguously and let XLA
bring matching gate/up rows together (see docs/design.md, "Parameter shardings").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

REPLICATED = "replicated"
SHARDED_LAST_DIM = "sharded_last_dim"
UNCHANGED = "unchanged"
EXPERT_DISPATCH = "expert_dispatch"


@dataclass(frozen=True)
class ParallelStyle:
    """How one style shards parameters and lays out its module's output.

    `weight_dim`: dim split for parameters with ndim >= 2, counted from the end (-2 = `Shard(ndim - 2)`),
    or None. `vector_dim`: same for 1-D parameters (biases, norm weights). `group`: the logical device
    group the dim is split over.
    """

    name: str
    weight_dim: int | None = None
    vector_dim: int | None = None
    group: str = "tp"
    output: str = UNCHANGED
    description: str = ""

    def param_dims(self, shape: tuple[int, ...]) -> dict[int, str]:
        """{dimension index: logical group} for a parameter of `shape` under this style."""
        dim = self.weight_dim if len(shape) >= 2 else self.vector_dim
        if dim is None or not shape:
            return {}
        return {dim % len(shape): self.group}


class ParallelStyleRegistry:
    """Name -> `ParallelStyle`. Users register their own names with `register`."""

    def __init__(self):
        self._styles: dict[str, ParallelStyle] = {}

    def register(self, style: ParallelStyle) -> None:
        self._styles[style.name] = style

    def __contains__(self, name: object) -> bool:
        return name in self._styles

    def __iter__(self) -> Iterator[str]:
        return iter(self._styles)

    def __getitem__(self, name: str) -> ParallelStyle:
        return self._styles[name]

    def __len__(self) -> int:
        return len(self._styles)


ALL_PARALLEL_STYLES = ParallelStyleRegistry()
for _style in (
    ParallelStyle("embedding_rowwise", weight_dim=-2, vector_dim=0, output=REPLICATED,
                  description="vocab-sharded lookup, partial rows summed over tp"),
    ParallelStyle("embedding_colwise", weight_dim=-1, vector_dim=0, output=REPLICATED,
                  description="hidden-sharded lookup, gathered on the last dim"),
    ParallelStyle("colwise_gather_output", weight_dim=-2, vector_dim=0, output=REPLICATED,
                  description="out features sharded, output gathered"),
    ParallelStyle("colwise_rep", weight_dim=-2, vector_dim=0, output=REPLICATED,
                  description="alias of colwise_gather_output"),
    ParallelStyle("colwise", weight_dim=-2, vector_dim=0, output=SHARDED_LAST_DIM,
                  description="out features sharded, output stays sharded on its last dim"),
    ParallelStyle("rowwise", weight_dim=-1, output=REPLICATED,
                  description="in features sharded, partial sums reduced over tp, bias added once"),
    ParallelStyle("rowwise_split_input", weight_dim=-1, output=REPLICATED,
                  description="rowwise on a replicated input (sliced locally)"),
    ParallelStyle("rowwise_rep", weight_dim=-1, output=REPLICATED,
                  description="alias of rowwise_split_input"),
    ParallelStyle("packed_colwise", weight_dim=-2, vector_dim=-1, output=SHARDED_LAST_DIM,
                  description="fused gate/up rows split over tp"),
    ParallelStyle("packed_rowwise", weight_dim=-1, output=UNCHANGED,
                  description="fused gate/up on the last dim split over tp (parameter only)"),
    ParallelStyle("sequence_parallel", output=UNCHANGED,
                  description="parameters replicated; sequence-sharded input (not used by these models)"),
    ParallelStyle("replicated_with_grad_allreduce", output=UNCHANGED,
                  description="replicated; gradients are summed over tp"),
    ParallelStyle("mla_kv_a_proj", output=UNCHANGED, description="MLA kv_a projection (rope part replicated)"),
    ParallelStyle("all_reduce", output=REPLICATED, description="module output summed over tp"),
    ParallelStyle("moe_tp_experts", output=REPLICATED,
                  description="every device runs its intermediate slice of every expert; outputs summed over tp"),
    ParallelStyle("moe_identity_expert", output=UNCHANGED, description="input divided by the tp size"),
    ParallelStyle("local_params", output=UNCHANGED, description="forward with local parameters"),
    ParallelStyle("replicate", output=UNCHANGED, description="parameter stays whole on every device"),
    ParallelStyle("grouped_gemm", weight_dim=0, vector_dim=0, group="ep", output=UNCHANGED,
                  description="expert dim split over ep: whole experts per device"),
    ParallelStyle("ep_dispatch_experts", output=EXPERT_DISPATCH,
                  description="tokens reach their experts through the ep_implementation"),
):
    ALL_PARALLEL_STYLES.register(_style)

# FSDP styles differ in PyTorch only in when gathered weights are freed; under XLA both shard the
# parameters over the fsdp group and the compiler schedules the gathers.
ALL_FSDP_STYLES = ("free_full_weight", "keep_full_weight")


def unsupported_styles_error(plan: dict[str, str], supported, plan_name: str) -> ValueError | None:
    """The reference's error for styles not in `supported`, or None when all are known."""
    unsupported = {style for style in plan.values() if style not in supported}
    if not unsupported:
        return None
    return ValueError(
        f"Unsupported `{plan_name}` styles: {unsupported}. Supported styles are {list(supported)}"
    )
