"""Why each layout wins or loses, in words, and how to run the one that wins.

    explain(estimates)                     # fills each estimate's `why`, against the best
    distributed_config_text(layout)        # "DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4, ...)"
    command_text(layout, model, request)   # "moe-jax train --model ... --tp 2 --fsdp 4 --ep 4 ..."
"""

from __future__ import annotations

from .estimate import LayoutEstimate
from .layouts import Layout
from .request import PlanRequest

GIB = 2**30


def gib(count: float) -> str:
    return f"{count / GIB:.1f} GiB"


def _parts_text(parts: dict[str, float], count: int = 3) -> str:
    largest = sorted(parts.items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{name} {seconds:.3g} s" for name, seconds in largest if seconds > 0)


def _largest_memory_part(estimate: LayoutEstimate) -> str:
    parts = {name: value for name, value in estimate.memory.as_dict().items() if name != "total" and value}
    name = max(parts, key=parts.get)
    return f"{name} {gib(parts[name])}"


def why_text(estimate: LayoutEstimate, best: LayoutEstimate | None) -> str:
    if not estimate.compiled:
        return estimate.why or (f"does not fit: parameters, float32 gradients and optimizer state alone need "
                                f"{gib(estimate.memory.total)} of the {gib(estimate.usable_bytes)} usable")
    if not estimate.fits:
        return (f"does not fit: needs {gib(estimate.memory.total)} of the {gib(estimate.usable_bytes)} usable "
                f"(largest: {_largest_memory_part(estimate)})")
    if best is None or estimate is best:
        return f"fastest that fits: {estimate.step_seconds:.3g} s per step ({_parts_text(estimate.step_parts)})"
    slower = estimate.step_seconds / best.step_seconds - 1
    differences = {name: estimate.step_parts.get(name, 0.0) - best.step_parts.get(name, 0.0)
                   for name in set(estimate.step_parts) | set(best.step_parts)}
    worse = sorted(((name, delta) for name, delta in differences.items() if delta > 0), key=lambda item: -item[1])
    reasons = ", ".join(f"{name} +{delta:.3g} s" for name, delta in worse[:2]) or "the same parts, summed"
    return f"{slower:+.0%} against rank 1: {reasons}"


def explain(estimates: list[LayoutEstimate]) -> None:
    """Set each estimate's `why` (estimates ranked, best first)."""
    best = estimates[0] if estimates and estimates[0].fits else None
    for estimate in estimates:
        estimate.why = why_text(estimate, best)


def no_fit_hint(estimates: list[LayoutEstimate], request: PlanRequest) -> str:
    """What to change when no layout fits: fewer activations when they are the largest part of the compiled
    rows, else more devices or less state."""
    compiled = [estimate for estimate in estimates if estimate.compiled]
    if compiled and request.mode == "train":
        smallest = min(compiled, key=lambda estimate: estimate.memory.total)
        memory = smallest.memory
        if memory.activations + memory.temporaries > memory.parameters + memory.optimizer + memory.gradients:
            options = ["--remat full (each layer keeps only its input for the backward pass)"] if (
                request.remat != "full") else []
            return ("the step's activations and temporaries are most of it: try "
                    + ", ".join(options + ["a shorter --seq-len or a smaller --batch-size", "more devices"]))
    precision = "" if request.dtype != "float32" or request.mixed_precision else ", --dtype bfloat16"
    return f"the parameters, gradients and optimizer state are most of it: try more devices{precision}"


def distributed_config_text(layout: Layout) -> str:
    sizes = layout.config_sizes()
    text = ", ".join(f"{name}={value!r}" for name, value in sizes.items()
                     if (name == "ep_implementation" and layout.ep > 1 or name != "ep_implementation")
                     and (name != "cp_size" or layout.cp > 1))
    return f"DistributedConfig({text})"


def model_options_text(layout: Layout) -> str:
    """The model's pipeline keyword arguments as Python text ("" without stages)."""
    return ", ".join(f"{name}={value!r}" for name, value in layout.model_options().items())


def command_text(layout: Layout, model: str, request: PlanRequest) -> str:
    """The `moe-jax` command that runs `request` on `layout`."""
    if request.mode == "serve":
        return (f"moe-jax serve --model {model} {layout.flags()} --max-slots {request.max_slots} "
                f"--max-model-len {request.max_model_len}")
    precision = " --mixed-precision" if request.mixed_precision else f" --dtype {request.dtype}"
    extras = (f" --grad-accum {request.grad_accum}" if request.grad_accum > 1 else "") + (
        f" --remat {request.remat}" if request.remat != "none" else "")
    return (f"moe-jax train --model {model} {layout.flags()} --batch-size {request.batch_size} "
            f"--seq-len {request.seq_len} --optimizer {request.optimizer}{precision}{extras}")
