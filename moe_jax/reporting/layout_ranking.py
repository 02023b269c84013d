"""The planner's answer as text: the ranked layouts, what to run, and what was left out (`moe-jax plan --auto`).

    print(ranking_report(plan, model="path/to/checkpoint", top=10))
"""

from __future__ import annotations

from collections import Counter

from ..planning.explain import command_text, distributed_config_text, model_options_text, no_fit_hint
from ..planning.search import LayoutPlan

GIB = 2**30
COLUMNS = ("rank", "layout", "fits", "step s", "params", "grads", "optim", "activ", "temps", "total", "why")
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def memory_unit(plan: LayoutPlan) -> tuple[str, int]:
    """The largest unit in which the biggest row is at least 1 (tiny test models print in KiB)."""
    largest = max((estimate.memory.total for estimate in plan.estimates), default=0)
    return next(((name, size) for name, size in UNITS if largest >= size), UNITS[-1])


def _gib(value: int | None, unit: int = GIB) -> str:
    return "-" if value is None else f"{value / unit:.2f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def ranking_table(plan: LayoutPlan, top: int) -> str:
    name, unit = memory_unit(plan)
    rows = [(*COLUMNS[:-2], f"total {name}", COLUMNS[-1])]
    for estimate in plan.estimates[:top]:
        memory = estimate.memory
        rows.append((str(estimate.rank), estimate.layout.name, "yes" if estimate.fits else "no",
                     _seconds(estimate.step_seconds), *(_gib(value, unit) for value in (
                         memory.parameters, memory.gradients, memory.optimizer, memory.activations,
                         memory.temporaries, memory.total)), estimate.why))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
                     for row in rows)


def excluded_summary(plan: LayoutPlan, count: int = 5) -> str:
    reasons = Counter(item.reason for item in plan.excluded)
    if not reasons:
        return "excluded: none"
    lines = [f"excluded: {len(plan.excluded)} combinations of sizes (the most common reasons):"]
    lines += [f"  {times} x {reason}" for reason, times in reasons.most_common(count)]
    return "\n".join(lines)


def answer_text(plan: LayoutPlan, model: str) -> str:
    best = plan.best
    if best is None:
        found = (f"the smallest device count on which one would: {plan.min_devices_to_fit} ({plan.min_devices_note})"
                 if plan.min_devices_to_fit is not None else f"no device count found ({plan.min_devices_note})")
        return (f"No layout of {plan.devices} devices fits {_gib(plan.estimates[0].usable_bytes)} GiB per device; "
                f"{found}.\n{no_fit_hint(plan.estimates, plan.request)}.")
    options = model_options_text(best.layout)
    name, unit = memory_unit(plan)
    lines = [f"Use rank 1, {best.layout.name}: {best.step_seconds:.4g} s per step, "
             f"{_gib(best.memory.total, unit)} {name} per device.",
             f"  {command_text(best.layout, model, plan.request)}",
             f"  {distributed_config_text(best.layout)}" + (f"  # model options: {options}" if options else "")]
    return "\n".join(lines)


def ranking_report(plan: LayoutPlan, *, model: str, top: int = 10) -> str:
    compiled = sum(estimate.compiled for estimate in plan.estimates)
    header = [
        f"{plan.request.describe()}; {plan.devices} devices of {plan.hardware.name} "
        f"({plan.device_memory / GIB:.1f} GiB each, {plan.margin:.0%} kept free)",
        f"hardware: {plan.hardware.source}",
        f"{len(plan.estimates)} legal layouts, {compiled} compiled; memory per device in {memory_unit(plan)[0]}; step "
        "time predicted from each compiled step (collectives not overlapped with compute)",
    ]
    return "\n\n".join(["\n".join(header), ranking_table(plan, top), answer_text(plan, model),
                        excluded_summary(plan)])
