"""The fewest devices on which some layout fits, when none fits on the devices asked about.

    count = state_bound(config_values, request, start=8, usable_bytes=...)           # no devices needed
    count, note = smallest_fitting(config_values, request, start=8, usable_bytes=..., cpu_devices=...)

First from the train state alone: the smallest count above `start` with a legal layout whose parameters,
float32 gradients and optimizer state fit (tried count by count from the bound of a perfectly sharded state,
over the sizes that change the state: EP implementations, microbatches and the ep size do not, and HSDP
replicas only add to it). Then the few layouts with the least state at that count are compiled to check activations and
temporaries too, count after count, while compiles remain and the devices exist.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from .compiled_step import compile_layout_step
from .layouts import Candidate, enumerate_layouts, layout_space, quiet_model_building
from .request import PlanRequest
from .state_bytes import train_state_bytes

SEARCH_LIMIT = 1 << 16     # device counts tried at most
VERIFY_LAYOUTS = 2         # layouts compiled per device count
VERIFY_COMPILES = 4        # compiles at most, in all
FIRST_COMPILE_SECONDS = 30.0   # what a real-size compile may take, before one was timed


def state_of(candidate: Candidate, request: PlanRequest, optimizer) -> int:
    """Bytes of the state one device holds: parameters, and in training float32 gradients and optimizer state."""
    state = train_state_bytes(candidate.model, optimizer)
    return state.total if request.mode == "train" else state.parameters


def _state_candidates(config_values: dict, request: PlanRequest, count: int) -> list[Candidate]:
    """Legal layouts of `count` devices, one per set of sizes that matters to the state."""
    candidates, _ = enumerate_layouts(config_values, devices=count, batch_size=request.batch_size,
                                      seq_len=request.seq_len, mode=request.mode, grad_accum=request.grad_accum,
                                      model_options=request.model_options(), space=_state_space)
    return candidates


def _state_space(devices: int, mode: str):
    """One layout per (tp, fsdp, pp) and ep in {1, fsdp x tp}: experts are split over ep x efsdp = fsdp x tp
    devices whatever ep is, so the other ep sizes hold the same state (and HSDP replicas hold more)."""
    kept, seen = [], set()
    for layout in layout_space(devices, mode):
        sizes = (layout.tp, layout.ep, layout.fsdp, layout.pp)
        if layout.dp_replicate > 1 or layout.ep not in (1, layout.tp * layout.fsdp) or sizes in seen:
            continue
        seen.add(sizes)
        kept.append(layout)
    return kept


def state_bound(config_values: dict, request: PlanRequest, *, start: int, usable_bytes: float, optimizer,
                one_device_state: int) -> tuple[int | None, list[Candidate]]:
    """(the smallest count above `start` where some layout's state fits, its layouts by state), or (None, [])."""
    count = max(start + 1, math.ceil(one_device_state / usable_bytes))
    with quiet_model_building():
        while count <= SEARCH_LIMIT:
            candidates = _state_candidates(config_values, request, count)
            states = sorted(((state_of(c, request, optimizer), c) for c in candidates), key=lambda pair: pair[0])
            fitting = [candidate for state, candidate in states if state <= usable_bytes]
            if fitting:
                return count, fitting
            count += 1
    return None, []


def _unchecked_note(count: int, tried: list[str], too_small: list[str]) -> str:
    note = f"{count} devices hold the parameters, gradients and optimizer state"
    if tried:
        note += f"; compiled there, {', '.join(tried)} did not fit, the other layouts were not compiled"
    else:
        note += "; activations and temporaries there were not compiled"
    return note + (f" (compiled at {', '.join(too_small)} devices, the step did not fit)" if too_small else "")


def smallest_fitting(config_values: dict, request: PlanRequest, *, start: int, usable_bytes: float, optimizer,
                     one_device_state: int, cpu_devices: Callable[[int], list] | None,
                     first: tuple | None = None, deadline: float | None = None,
                     compile_seconds: float = FIRST_COMPILE_SECONDS) -> tuple[int | None, str]:
    """(device count, how it was established): checked by compiling where the devices (`cpu_devices(count)`
    gives up to `count`), compiles and time allow: a compile starts only when `compile_seconds` (the longest
    seen so far) remain before `deadline` (a `time.perf_counter()` value). first: `state_bound`'s answer for
    `start` when known."""
    count, fitting = first or state_bound(config_values, request, start=start, usable_bytes=usable_bytes,
                                          optimizer=optimizer, one_device_state=one_device_state)
    compiles, too_small, timed = 0, [], None
    while count is not None:
        tried = []
        for candidate in fitting[:VERIFY_LAYOUTS]:
            out_of_time = deadline is not None and time.perf_counter() + (timed or compile_seconds) > deadline
            devices = [] if cpu_devices is None or compiles >= VERIFY_COMPILES or out_of_time else cpu_devices(count)
            if len(devices) < count:
                return count, _unchecked_note(count, tried, too_small)
            step = compile_layout_step(config_values, candidate.layout, request, devices)
            timed = max(timed or 0.0, step.compile_seconds)
            compiles += 1
            if step.memory.total <= usable_bytes:
                return count, f"{candidate.layout.name} on {count} devices compiled: {step.memory.total / 2**30:.1f} GiB"
            tried.append(candidate.layout.name)
        too_small.append(str(count))
        count, fitting = state_bound(config_values, request, start=count, usable_bytes=usable_bytes,
                                     optimizer=optimizer, one_device_state=one_device_state)
    return None, f"no count up to {SEARCH_LIMIT} devices holds the state"
