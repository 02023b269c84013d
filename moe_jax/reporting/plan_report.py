"""A readable report of how a model is sharded: merged plans, one line per parameter kind, layout picture."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from ..distributed.plans import replace_layer_number_by_wildcard
from .picture import layout_picture


def _layers_text(layers: list[str]) -> str:
    numbers = sorted({int(n) for n in layers if n.isdigit()})
    if not numbers:
        return ""
    if numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 1:
        return f"layers {numbers[0]}-{numbers[-1]}"
    return "layers " + ",".join(str(n) for n in numbers)


def pipeline_stages_text(model) -> str:
    """Per pipeline stage: its layers, its devices and the parameter bytes one of its devices holds."""
    stack = model.layer_stack
    layout = stack.pipeline
    ranks = np.arange(model.layout.num_devices).reshape(model.layout.mesh_shape)
    shared = sum(_local_bytes(model, name) for name in model.param_layouts
                 if not name.startswith("model.layers."))   # embeddings, final norm, head: on every stage
    lines = [f"pipeline: {layout.stages} stages, {layout.schedule}"
             + (f" x {layout.repeats} repeats" if layout.repeats > 1 else "")
             + f", {model.pipeline_microbatches} microbatches per batch (bubble fraction "
             f"{(layout.stages - 1) / (model.pipeline_microbatches * layout.repeats + layout.stages - 1):.0%}); "
             "layer parameters are stored by group, each stage's rows on its devices (the PartitionSpecs above "
             "behind a leading 'pp')"]
    rows = [("stage", "layers", "devices", "parameter bytes per device")]
    for stage in range(layout.stages):
        stage_bytes = shared
        for storage, members in stack.members.items():
            if stack.is_stacked(storage):
                rows_per_stage = len(members) // layout.stages
                stage_bytes += rows_per_stage * _local_bytes(model, stack.first_member(storage))
        layers = layout.stage_layers(stage)
        rows.append((str(stage), _layers_text([str(layer) for layer in layers]).removeprefix("layers "),
                     ",".join(str(rank) for rank in ranks[stage].flat), _bytes_text(stage_bytes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    zero_rows = sum(name is None for members in stack.members.values() for name in members)
    if zero_rows:
        lines.append(f"  ({zero_rows} parameter rows are zeros: slots where a stage's layer differs in structure "
                     "or an uneven split leaves a stage short; one program runs every stage)")
    return "\n".join(lines)


def _local_bytes(model, name: str) -> int:
    """Bytes of parameter `name` on one device: its shard in the dtype it is held in (quantised codes: theirs)."""
    return math.prod(model.param_layouts[name].local_shape) * np.dtype(model.param_dtype(name)).itemsize


def parameter_bytes_text(model) -> str:
    """One device's parameter bytes (the busiest device's: every shard is the same size), with the part held
    quantised when the model keeps quantised weights."""
    total = sum(_local_bytes(model, name) for name in model.param_layouts)
    text = f"parameter bytes per device: {_bytes_text(total)}"
    kept = getattr(model, "kept_quantization", None)
    quantized = getattr(model, "weight_quantization", None)
    if kept is not None or quantized is not None:
        codes = sum(_local_bytes(model, name) for name, spec in model.module_tree.params.items() if spec.keep_dtype)
        how = f"{kept} codes and scales, kept quantised" if kept is not None else (
            f"{quantized.scheme} codes and scales, quantised on load")
        text += f" ({_bytes_text(codes)} of them {how})"
    return text


def _bytes_text(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


def _layer_runs_text(model) -> str:
    """How the layers run: scanned runs store their parameters stacked on an unsharded leading layer axis."""
    stack = getattr(model, "layer_stack", None)
    if stack is not None and stack.pipeline is not None:
        return pipeline_stages_text(model)
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
    if getattr(model, "layer_stack", None) is None or model.layer_stack.pipeline is None:
        lines.append(parameter_bytes_text(model))
    lines.append(_layer_runs_text(model))
    if (note := head_split_note(model)) is not None:
        lines.append(f"note: {note}")
    lines.append("")
    lines.append(layout_picture(config, num_experts or model.config.num_experts))
    return "\n".join(lines)


def head_split_note(model) -> str | None:
    """What becomes of the attention heads when tp_size does not divide the KV heads; None when it does,
    without TP, or without k/v projections (DeepSeek-V3's latent attention).

    The colwise k/v projections are still split evenly by rows, so a device's slice cuts through heads; the
    partitioner then moves data to give attention whole heads (measured on a one-layer Qwen3-MoE with 2 KV
    heads: 27 collectives per forward at tp=8, all-to-alls and collective-permutes among them, against 4 at
    tp=2), and the KV cache, whose heads cannot be split over tp, holds every KV head on each TP
    device (kv_cache/contiguous.py)."""
    tp_size = model.distributed_config.tp_size
    kv_heads = getattr(model.config, "num_key_value_heads", None)
    k_proj = next((layout for name, layout in model.param_layouts.items()
                   if name.endswith("self_attn.k_proj.weight")), None)
    if tp_size == 1 or not kv_heads or k_proj is None or kv_heads % tp_size == 0 or k_proj.style != "colwise":
        return None
    rows = k_proj.shape[0]
    return (f"tp_size={tp_size} does not divide the {kv_heads} KV heads: each TP device holds "
            f"{rows // tp_size} of the {rows} rows of every k/v projection (a head is {rows // kv_heads} "
            "rows), so XLA regroups whole heads for attention with extra collectives in every layer, and the "
            f"KV cache keeps all {kv_heads} KV heads on every TP device; a tp_size that divides {kv_heads} "
            "keeps whole heads per device.")
