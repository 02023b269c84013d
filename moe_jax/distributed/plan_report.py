"""A readable report of how a model is sharded: merged plans, one line per parameter kind, layout picture."""

from __future__ import annotations

from collections import OrderedDict

from .picture import layout_picture
from .plans import replace_layer_number_by_wildcard


def _layers_text(layers: list[str]) -> str:
    numbers = sorted({int(n) for n in layers if n.isdigit()})
    if not numbers:
        return ""
    if numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 1:
        return f"layers {numbers[0]}-{numbers[-1]}"
    return "layers " + ",".join(str(n) for n in numbers)


def _layer_runs_text(model) -> str:
    """How the layers run: scanned runs store their parameters stacked on an unsharded leading layer axis."""
    stack = getattr(model, "layer_stack", None)
    if stack is None or not stack.scanned:
        return "layers: unrolled (one compiled copy per layer)"
    parts = [f"{run.start}-{run.stop - 1} scanned" if run.scanned else f"{run.start}" for run in stack.runs]
    return ("layers: " + ", ".join(parts) + " (a scanned run stores each parameter as [layers, ...]; the "
            "layer axis is never sharded, so every PartitionSpec above gets a leading None)")


def plan_report(model, num_experts: int | None = None) -> str:
    """model: a `MoeForCausalLM` (abstract is enough). Parameters that differ only in their layer number
    share a line."""
    config = model.distributed_config
    lines = [f"{type(model).__name__} with {config!r}".rstrip()]
    for kind, plan, active in (
        ("tp_plan", model.tp_plan, config.tp_size > 1),
        ("ep_plan", model.ep_plan, config.ep_size > 1),
        ("fsdp_plan", model.fsdp_plan, config.dp_size > 1),
    ):
        state = "applied" if active else "not applied (size 1)"
        lines.append(f"{kind} ({state}):")
        lines += [f"  {key}: {style}" for key, style in plan.items()] or ["  (empty)"]

    groups: OrderedDict[tuple, list[str]] = OrderedDict()
    buffers = set(model.module_tree.buffers())
    for name, layout in model.param_layouts.items():
        generic = replace_layer_number_by_wildcard(name)
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        style = "(buffer)" if name in buffers else layout.style or "-"  # frozen, float32, replicated
        key = (generic, layout.shape, style, str(layout.spec), layout.local_shape)
        groups.setdefault(key, []).append(layer)
    rows = [("parameter", "shape", "style", "PartitionSpec", "per-device", "where")]
    for (generic, shape, style, spec, local_shape), layers in groups.items():
        rows.append((generic, str(list(shape)), style, spec, str(list(local_shape)), _layers_text(layers)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append("")
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    lines.append(_layer_runs_text(model))
    lines.append("")
    lines.append(layout_picture(config, num_experts or model.config.num_experts))
    return "\n".join(lines)
