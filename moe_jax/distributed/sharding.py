"""Resolved plans + device layout -> one `PartitionSpec` per parameter.

How a parameter is split combines three sources, as in the reference:

    EP rule (grouped_gemm)   expert dim 0 over the ep group, then FSDP of experts over efsdp
    TP rule (colwise, ...)   the style's dim over the tp group
    FSDP (dp_size > 1)       every parameter (the reference's root `fully_shard` covers them all)
                             is split over the fsdp group on dim 0, after TP on that dim

    Qwen3-MoE, tp=2 fsdp=4 ep=4 (mesh pp, dp_replicate, efsdp, ep_fsdp, tp):
    model.layers.1.self_attn.q_proj.weight     [32, 32]     P(('tp', 'efsdp', 'ep_fsdp'), None)
    model.layers.1.self_attn.o_proj.weight     [32, 32]     P(('efsdp', 'ep_fsdp'), 'tp')
    model.layers.1.mlp.experts.gate_up_proj    [8, 32, 32]  P(('ep_fsdp', 'tp', 'efsdp'), None, None)

A jax.Array must split evenly. FSDP moves to the next dimension that divides when dim 0 does not (the
reference's torch.chunk would split unevenly); TP and EP dims that do not divide raise, naming the
parameter and the sizes that work.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.sharding import PartitionSpec

from ..module_tree import ModuleTree
from .config import DistributedConfig
from .mesh import DeviceLayout, check_experts_divisible, spec_entry
from .plans import ResolvedPlans
from .styles import ALL_PARALLEL_STYLES


@dataclass(frozen=True)
class ParamSharding:
    """How one parameter is laid out: its style, its spec and the shape each device stores."""

    name: str
    shape: tuple[int, ...]
    style: str | None
    fsdp: bool
    spec: PartitionSpec
    local_shape: tuple[int, ...]


def _divisors_text(size: int) -> str:
    return ", ".join(str(d) for d in range(1, size + 1) if size % d == 0)


def parallel_dims(name: str, shape: tuple[int, ...], plans: ResolvedPlans, layout: DeviceLayout
                  ) -> tuple[list[tuple[str, ...]], bool]:
    """(the mesh axes of each dim by the parameter's TP or EP rule, FSDP left out; whether an EP rule splits it):
    how tensor and expert parallelism split one parameter. A LoRA adapter's factors follow these
    (`moe_jax.lora.layout`)."""
    style_name = plans.ep.get(name) or plans.tp.get(name)
    dims: list[tuple[str, ...]] = [() for _ in shape]
    is_expert = False
    if style_name is not None:
        style = ALL_PARALLEL_STYLES[style_name]
        for dim, group in style.param_dims(shape).items():
            axes = layout.axes(group)
            size = layout.group_size(group)
            if group == "ep":
                is_expert = True
                check_experts_divisible(shape[dim], size)
            elif shape[dim] % size:
                raise ValueError(
                    f"Cannot split `{name}` {list(shape)} on dim {dim} ({shape[dim]}) over {group}_size={size} "
                    f"with style `{style_name}`; use a {group}_size among {_divisors_text(shape[dim])}."
                    + _scale_block_hint(name)
                )
            dims[dim] = dims[dim] + axes
    return dims, is_expert


def _scale_block_hint(name: str) -> str:
    """What to do when the split falls inside a quantised weight's scale blocks."""
    if not name.endswith(("_scale_inv", "_scales", "_scale")):
        return ""
    return (" These are a quantised weight's block scales: that split would cut a scale block; keep the weight "
            "unquantised (quantize_modules without it) or load it dequantised (dequantize=True, no quantize=).")


def parameter_sharding(
    name: str, shape: tuple[int, ...], plans: ResolvedPlans, layout: DeviceLayout
) -> ParamSharding:
    """The `PartitionSpec` of one parameter under resolved plans."""
    style_name = plans.ep.get(name) or plans.tp.get(name)
    dims, is_expert = parallel_dims(name, shape, plans, layout)
    fsdp_axes = layout.efsdp_axes if is_expert else layout.fsdp_axes
    fsdp_size = layout.efsdp_size if is_expert else layout.fsdp_size
    apply_fsdp = layout.fsdp_size * layout.dp_replicate_size > 1 and fsdp_size > 1
    if apply_fsdp:
        for dim in range(len(shape)):
            already = _size_of(dims[dim], layout)
            if shape[dim] % (already * fsdp_size) == 0:
                dims[dim] = dims[dim] + fsdp_axes
                break
        else:
            apply_fsdp = False  # no dimension splits evenly: the parameter stays whole on each fsdp device

    spec = PartitionSpec(*(spec_entry(axes) for axes in dims))
    local_shape = tuple(size // _size_of(axes, layout) for size, axes in zip(shape, dims))
    return ParamSharding(name, tuple(shape), style_name, apply_fsdp, spec, local_shape)


def _size_of(axes: tuple[str, ...], layout: DeviceLayout) -> int:
    sizes = layout.axis_sizes
    total = 1
    for axis in axes:
        total *= sizes[axis]
    return total


def parameter_shardings(tree: ModuleTree, plans: ResolvedPlans, config: DistributedConfig) -> dict[str, ParamSharding]:
    """Every parameter's sharding, in declaration order."""
    layout = DeviceLayout.from_config(config)
    return {name: (_replicated(name, spec.shape) if spec.buffer else parameter_sharding(name, spec.shape, plans, layout))
            for name, spec in tree.named_parameters()}


def _replicated(name: str, shape: tuple[int, ...]) -> ParamSharding:
    """A buffer: whole on every device (the reference's FSDP and TP shard parameters, not buffers)."""
    return ParamSharding(name, tuple(shape), None, False, PartitionSpec(*(None for _ in shape)), tuple(shape))
