"""One layout's planned memory and time: a row of the planner's answer.

    estimate.layout, estimate.memory.total, estimate.fits, estimate.step_seconds, estimate.step_parts, estimate.why
    estimate.row()        # the --json row: rank, distributed_config, pipeline, memory_bytes, fits, step_seconds, ...

Memory is per device, in bytes: parameters and optimizer state from the layout's shardings (`state_bytes`, as
`moe-jax plan --train` counts them); activations (the forward pass's buffers still live at the step's peak, or
the KV cache when serving), gradients (the backward pass's buffers live at the peak) and temporaries (the rest)
from the compiled program, whose total they add up to; host: what offloaded state (`PlanRequest.offload`) keeps in
pinned host memory, apart from the device's total. A layout that was not compiled has None activations
and temporaries and its state as the total: `fits` is False when that state alone exceeds the device, None
(not known) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .layouts import Layout

MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "temporaries")


@dataclass(frozen=True)
class MemoryBreakdown:
    parameters: int
    gradients: int
    optimizer: int
    activations: int | None
    temporaries: int | None
    total: int
    host: int = 0      # pinned host memory per device (offloaded state), apart from the device's total

    def as_dict(self) -> dict:
        return {part: getattr(self, part) for part in (*MEMORY_PARTS, "total", "host")}


@dataclass
class LayoutEstimate:
    """layout: the sizes, EP implementation and pipeline choice; memory: per-device bytes; usable_bytes: the
    device memory less the margin; step_seconds / step_parts: None when not compiled; notes: how the row was
    computed (scanned layers, loops counted at their bound, XLA:CPU copies left out); guess_seconds: the
    analytic guess that ordered the compiles (`analytic`), not a prediction to rank by; activation_guess_bytes:
    the analytic guess of the activations one device keeps for the backward pass (`analytic.activation_bytes_guess`:
    divided by cp, all_gather's gathered keys and values added; None when serving), known for every layout,
    compiled or not; cached: the compiled step was read from the compile cache."""

    layout: Layout
    memory: MemoryBreakdown
    usable_bytes: int
    step_seconds: float | None = None
    step_parts: dict[str, float] = field(default_factory=dict)
    flops: float | None = None
    collective_bytes: dict[str, float] = field(default_factory=dict)
    padding_fraction: float = 0.0
    compiled: bool = False
    compile_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    why: str = ""
    rank: int = 0
    guess_seconds: float | None = None
    cached: bool = False
    activation_guess_bytes: float | None = None

    @property
    def fits(self) -> bool | None:
        """True or False from the compiled step; False when not compiled but the state alone exceeds the
        device; None (not known) for the other layouts not compiled."""
        if self.compiled or self.memory.total > self.usable_bytes:
            return self.memory.total <= self.usable_bytes
        return None

    @property
    def headroom_bytes(self) -> int:
        return self.usable_bytes - self.memory.total

    @property
    def bubble_fraction(self) -> float:
        return self.layout.bubble_fraction

    def sort_key(self) -> tuple:
        """Fitting layouts by step time, less memory breaking ties; then compiled ones that do not fit, by their
        memory; then those not compiled, by the analytic guess; last those whose state alone does not fit."""
        if self.fits:
            return (0, self.step_seconds, self.memory.total)
        if self.compiled:
            return (1, self.memory.total, self.step_seconds)
        if self.fits is None:
            return (2, self.guess_seconds or 0.0, self.memory.total)
        return (3, self.memory.total, 0.0)

    def row(self) -> dict:
        layout = self.layout
        pipeline = None if layout.pipeline is None else {
            "microbatches": layout.pipeline.microbatches, "schedule": layout.pipeline.schedule,
            "repeats": layout.pipeline.repeats}
        return {
            "rank": self.rank,
            "layout": layout.name,
            "distributed_config": layout.config_sizes(),
            "pipeline": pipeline,
            "memory_bytes": self.memory.as_dict(),
            "usable_memory_bytes": self.usable_bytes,
            "fits": self.fits,
            "compiled": self.compiled,
            "compiled_step_cached": self.cached,
            "analytic_guess_seconds": self.guess_seconds,
            "analytic_activation_bytes": self.activation_guess_bytes,
            "step_seconds": self.step_seconds,
            "step_parts": dict(self.step_parts),
            "flops_per_device": self.flops,
            "collective_bytes": dict(self.collective_bytes),
            "pipeline_bubble_fraction": self.bubble_fraction,
            "dispatch_padding_fraction": self.padding_fraction,
            "notes": list(self.notes),
            "why": self.why,
            "command_flags": layout.flags(),
        }
