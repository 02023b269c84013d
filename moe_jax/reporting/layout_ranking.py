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


# LayoutEstimate.fits -> the fits column: compiled and fits, does not fit, not known (not compiled)
FITS_TEXT = {True: "yes", False: "no", None: "not compiled"}


def _total(estimate, unit: int) -> str:
    """A compiled row's total; an uncompiled one's state, marked as the estimate it is."""
    if estimate.compiled:
        return _gib(estimate.memory.total, unit)
    return f"~{_gib(estimate.memory.total, unit)} (estimate)"


def ranking_table(plan: LayoutPlan, top: int) -> str:
    """One row per layout; with offloaded state (`PlanRequest.offload`), its pinned host bytes after the device's
    total."""
    name, unit = memory_unit(plan)
    offloaded = plan.request.offload is not None
    rows = [(*COLUMNS[:-2], f"total {name}", *((f"host {name}",) if offloaded else ()), COLUMNS[-1])]
    for estimate in plan.estimates[:top]:
        memory = estimate.memory
        rows.append((str(estimate.rank), estimate.layout.name, FITS_TEXT[estimate.fits],
                     _seconds(estimate.step_seconds), *(_gib(value, unit) for value in (
                         memory.parameters, memory.gradients, memory.optimizer, memory.activations,
                         memory.temporaries)), _total(estimate, unit),
                     *((_gib(memory.host, unit),) if offloaded else ()), estimate.why))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
                     for row in rows)


def excluded_summary(plan: LayoutPlan, count: int = 5) -> str:
    reasons = Counter(item.reason for item in plan.excluded)
    lines = [f"left out: {times} layouts with ep_implementation={name!r}, which runs only on {needs}"
             for name, (needs, times) in plan.unreachable.items()]
    if not reasons:
        return "\n".join(lines + ["excluded: none"])
    lines += [f"excluded: {len(plan.excluded)} combinations of sizes (the most common reasons):"]
    lines += [f"  {times} x {reason}" for reason, times in reasons.most_common(count)]
    return "\n".join(lines)


def evidence_line(plan: LayoutPlan) -> str:
    """The report's first line: how many layouts the answer rests on, and what the budget left out."""
    line = f"compiled {plan.compiled} of {len(plan.estimates)} legal layouts"
    missed = plan.floor_missed
    if missed:
        line += (f"; the budget stopped before {len(missed)} of the {len(plan.floor)} layouts an answer should "
                 "rest on (the best guesses and one of every ep size, pp size, cp size, tp and HSDP): raise --time-budget "
                 "or --max-compiles, or leave both at their defaults")
    return line


def answer_text(plan: LayoutPlan, model: str) -> str:
    best = plan.best
    if best is None:
        unknown = sum(estimate.fits is None for estimate in plan.estimates)
        if unknown:
            return (f"No compiled layout of {plan.devices} devices fits {_gib(plan.estimates[0].usable_bytes)} GiB "
                    f"per device, and {unknown} that may were not compiled: raise --max-compiles or --time-budget.")
        found = (f"the smallest device count on which one would: {plan.min_devices_to_fit} ({plan.min_devices_note})"
                 if plan.min_devices_to_fit is not None else f"no device count found ({plan.min_devices_note})")
        return (f"No layout of {plan.devices} devices fits {_gib(plan.estimates[0].usable_bytes)} GiB per device; "
                f"{found}.\n{no_fit_hint(plan.estimates, plan.request)}.")
    options = model_options_text(best.layout)
    name, unit = memory_unit(plan)
    lines = [f"Use rank 1, {best.layout.name}: {best.step_seconds:.4g} s per step, "
             f"{_gib(best.memory.total, unit)} {name} per device (best of the {plan.compiled} compiled).",
             f"  {command_text(best.layout, model, plan.request)}",
             f"  {distributed_config_text(best.layout)}" + (f"  # model options: {options}" if options else "")]
    return "\n".join(lines)


def ranking_report(plan: LayoutPlan, *, model: str, top: int = 10) -> str:
    header = [
        evidence_line(plan),
        f"{plan.request.describe()}; {plan.devices} devices of {plan.hardware.name} "
        f"({plan.device_memory / GIB:.1f} GiB each, {plan.margin:.0%} kept free)",
        f"hardware: {plan.hardware.source}; compiled by {plan.compiler}",
        f"memory per device in {memory_unit(plan)[0]}; step time predicted from each compiled step (collectives "
        "not overlapped with compute); layouts compiled in the order of an analytic guess, likely winners first",
    ]
    return "\n\n".join(["\n".join(header), ranking_table(plan, top), answer_text(plan, model),
                        excluded_summary(plan)])
