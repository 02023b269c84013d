"""Which layout to use: every legal layout of N devices, planned from its compiled step, ranked.

    estimates = search_layouts("path/to/config.json", devices=8, batch_size=16, seq_len=4096, hardware="h100",
                               device_memory="80GiB")
    estimates[0].layout.distributed_config(), estimates[0].step_seconds, estimates[0].memory.total

    plan = plan_layouts(...)            # the same, with the excluded layouts and the smallest count that fits
    plan.min_devices_to_fit, plan.excluded, plan.as_json()

Steps: enumerate the legal layouts (`layouts`), leaving out EP implementations the hardware cannot run
(`reachable`); count each one's parameters, gradients and optimizer state from its shardings (`state_bytes`);
guess each step time from its sizes (`analytic`) to order the compiles, likely winners first (`compile_order`);
compile the step of each whose state fits the device (`compiled_step`, through the on-disk `compile_cache`)
until `max_compiles` or `time_budget` runs out (with `compile_floor`, never before the floor: the best guesses
and every layout family); predict each compiled step's time on the hardware (`step_time`); rank the ones that
fit by time, then the rest (`LayoutEstimate.sort_key`); say why (`explain`). The recommendation is only ever a
compiled layout. When none fits, find the fewest devices on which one would (`min_devices`). Compiling needs
as many CPU devices as the layouts (virtual ones: see `moe_jax.host_devices`); `cpu_devices(count)` provides
them, by default the first `count` of `jax.devices("cpu")`.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..checkpoint_files import read_config
from ..distributed.capacity import buffer_rows
from ..training.optimizers import build_optimizer
from ..training.step_options import offload_memory_kinds
from .analytic import activation_bytes_guess, analytic_step_seconds
from .compile_cache import CompileCache
from .compile_pool import CompilePool, DeviceSpec
from .compile_order import TOP_GUESSES, compile_order
from .estimate import LayoutEstimate, MemoryBreakdown
from .explain import explain
from .hardware import HardwareProfile, load_hardware
from .layouts import Candidate, Excluded, Layout, enumerate_layouts, layout_space, quiet_model_building
from .memory_size import parse_memory_size
from .min_devices import FIRST_COMPILE_SECONDS, smallest_fitting, state_bound, state_of
from .reachable import unreachable_implementations
from .request import PlanRequest
from .state_bytes import train_state_bytes
from .step_time import predict_step_time

DEFAULT_MARGIN = 0.1


@dataclass
class LayoutPlan:
    """The planner's answer: `estimates` ranked best first, the `excluded` layouts with their reasons, and,
    when none fits, `min_devices_to_fit` (None when one fits, or none does up to the search's limit)."""

    request: PlanRequest
    devices: int
    hardware: HardwareProfile
    device_memory: int
    margin: float
    estimates: list[LayoutEstimate]
    excluded: list[Excluded]
    min_devices_to_fit: int | None = None
    min_devices_note: str = ""
    notes: list[str] = field(default_factory=list)
    floor: list[Layout] = field(default_factory=list)          # the layouts the answer has to rest on
    compiler: str = "XLA:CPU on virtual CPU devices"           # what compiled the steps
    unreachable: dict[str, tuple[str, int]] = field(default_factory=dict)   # implementation -> (needs, layouts)

    @property
    def compiled(self) -> int:
        return sum(estimate.compiled for estimate in self.estimates)

    @property
    def floor_missed(self) -> list[Layout]:
        """The floor's layouts the budget stopped before compiling."""
        compiled = {estimate.layout for estimate in self.estimates if estimate.compiled}
        return [layout for layout in self.floor if layout not in compiled]

    @property
    def best(self) -> LayoutEstimate | None:
        return self.estimates[0] if self.estimates and self.estimates[0].fits else None

    def as_json(self) -> dict:
        return {
            "layouts": [estimate.row() for estimate in self.estimates],
            "min_devices_to_fit": self.min_devices_to_fit,
            "min_devices_note": self.min_devices_note,
            "devices": self.devices,
            "device_memory_bytes": self.device_memory,
            "memory_margin": self.margin,
            "request": self.request.__dict__,
            "hardware": self.hardware.to_dict(),
            "excluded": [{"layout": item.layout.name, "distributed_config": item.layout.config_sizes(),
                          "reason": item.reason} for item in self.excluded],
            "unreachable_implementations": {name: {"needs": needs, "layouts": count}
                                            for name, (needs, count) in self.unreachable.items()},
            "compiled": self.compiled,
            "compiler": self.compiler,
            "floor": [layout.name for layout in self.floor],
            "floor_not_compiled": [layout.name for layout in self.floor_missed],
            "notes": list(self.notes),
        }


def check_is_moe(config_values: dict) -> None:
    """A clear error for a config moe_jax cannot plan: an unsupported family, or one without routed experts."""
    from ..causal_lm.auto import AutoModelForCausalLM

    with quiet_model_building():
        model = AutoModelForCausalLM.from_config(config_values, abstract=True)
    if not model.sparse_layers():
        raise ValueError(f"{config_values.get('model_type')!r} config has no layer with routed experts (not an MoE "
                         "model): there is no expert layout to plan. Check num_experts / the MoE layer settings of "
                         "its config.json.")


def default_cpu_devices(count: int) -> list:
    """Up to `count` of JAX's CPU devices (fewer when JAX started with fewer)."""
    import jax

    return jax.devices("cpu")[:count]


COMPILERS = ("target", "cpu")


def resolve_compiler(compiler: str | None, hardware: str) -> str:
    """"target" or "cpu" for `hardware`; None picks "target" where it can run (see `plan_layouts`)."""
    from ..distributed.gpu_targets import GPU_TARGETS
    from ..distributed.targets import cuda_plugin_available

    if compiler is None:
        return "target" if hardware in GPU_TARGETS and cuda_plugin_available() else "cpu"
    if compiler not in COMPILERS:
        raise ValueError(f"--compiler {compiler!r}: use target (XLA:GPU for the hardware) or cpu (XLA:CPU).")
    if compiler == "target" and hardware not in GPU_TARGETS:
        raise ValueError(f"--compiler target compiles for a GPU with an XLA target description ({', '.join(GPU_TARGETS)}); "
                         f"--hardware {hardware} has none: use --compiler cpu.")
    return compiler


def _planning_devices(cpu_devices: Callable[[int], list], count: int, devices: int) -> list:
    """`cpu_devices(count)`, checked to hold at least the `devices` every layout compiles on."""
    provided = list(cpu_devices(count))
    if len(provided) < devices:
        raise ValueError(f"planning {devices} devices compiles on {devices} CPU devices but JAX has "
                         f"{len(provided)}: set XLA_FLAGS=--xla_force_host_platform_device_count={devices} before "
                         "JAX starts (the moe-jax plan command does it for you).")
    return provided


def padding_fraction(layout: Layout, model, request: PlanRequest, capacity: float | None) -> float:
    """The share of a dispatch buffer's rows that carry nothing when routing is balanced (0 without buffers)."""
    if capacity is None or layout.ep == 1:
        return 0.0
    rows = request.tokens // layout.data_parallel // max(layout.pipeline.microbatches if layout.pipeline else 1, 1)
    if request.mode == "train":
        rows //= request.grad_accum
    shares_batch = layout.ep == layout.tp
    pairs = rows * model.config.num_experts_per_tok // (1 if shares_batch and layout.ep_implementation == "all_reduce"
                                                        else layout.tp)
    buffer = buffer_rows(capacity, pairs, layout.ep)
    return max(0.0, 1.0 - pairs / layout.ep / buffer)


def _estimate(candidate: Candidate, state, request, usable, step, profile, devices_per_node, as_compiled: bool,
              cached: bool) -> LayoutEstimate:
    """as_compiled: the compiled memory is the planned device's own (XLA:CPU planning for CPU, or the target's
    compiler); otherwise XLA:CPU's float32 copies of bfloat16 buffers are left out."""
    layout = candidate.layout
    widened = 0 if as_compiled else step.peak.widened
    total = step.memory.total - widened
    activations = step.cache_bytes + (step.peak.forward if request.mode == "train" else 0)
    gradients = step.peak.backward if request.mode == "train" else 0
    optimizer = state.optimizer if request.mode == "train" else 0
    temporaries = max(0, total - state.parameters - optimizer - activations - gradients)
    host, notes = _host_bytes(step, state, request)
    memory = MemoryBreakdown(state.parameters, gradients, optimizer, activations, temporaries,
                             state.parameters + optimizer + activations + gradients + temporaries, host)
    padding = padding_fraction(layout, candidate.model, request, step.capacity)
    time_ = predict_step_time(step.costs, profile, compute_dtype=request.compute_dtype,
                              devices_per_node=devices_per_node, bubble_fraction=layout.bubble_fraction,
                              padding_fraction=padding)
    if step.scanned_runs:
        notes.append(f"{step.layers} layers compiled as {step.scanned_runs} scanned layer(s), costs scaled by "
                     "trip count")
    if step.costs.bounded_loops:
        notes.append(f"{step.costs.bounded_loops} data-dependent tile loop(s) counted at their expected visits")
    if widened:
        notes.append(f"{widened / 2**30:.2f} GiB of XLA:CPU float32 copies of bfloat16 buffers left out")
    if cached:
        notes.append("compiled step read from the compile cache")
    return LayoutEstimate(layout, memory, usable, time_.seconds, time_.parts, time_.flops, time_.collective_bytes,
                          padding, True, step.compile_seconds, notes, cached=cached)


def _host_bytes(step, state, request) -> tuple[int, list[str]]:
    """(pinned host bytes per device, notes) of `request.offload`: XLA:GPU's count where the compiler tells host
    memory apart; else the offloaded state's bytes, which XLA:CPU counts in the device's total as well (the step
    moves that state onto the device, so it is there at the peak)."""
    offloaded = _offloaded_state(state, request)
    if not offloaded or step.memory.host_total:
        return step.memory.host_total, []
    return offloaded, [
        "XLA:CPU counts the offloaded state in the device's total, where the step moves it for the step; XLA:GPU "
        "also keeps the update's copies there (--compiler target shows its peak)"]


def _offloaded_state(state, request) -> int:
    """The bytes per device of the state `request.offload` keeps in host memory between steps (0 without)."""
    if request.mode != "train" or request.offload is None:
        return 0
    parameters, optimizer = offload_memory_kinds(request.offload)
    return (state.parameters if parameters else 0) + (state.optimizer if optimizer else 0)


def _uncompiled(candidate: Candidate, state, request, usable, why: str = "",
                guess: float | None = None) -> LayoutEstimate:
    optimizer = state.optimizer if request.mode == "train" else 0
    gradients = state.gradients if request.mode == "train" else 0
    memory = MemoryBreakdown(state.parameters, gradients, optimizer, None, None, state.parameters + optimizer + gradients,
                             _offloaded_state(state, request))
    return LayoutEstimate(candidate.layout, memory, usable, why=why, guess_seconds=guess,
                          activation_guess_bytes=activation_bytes_guess(candidate, request))


def _progress_text(position: int, floor: int, count: int, layout: Layout, best: LayoutEstimate | None) -> str:
    """"layout i of K": K is the floor while compiling it (the layouts the answer rests on), then every layout
    the budget may still reach."""
    so_far = "none fits yet" if best is None else f"{best.layout.name}, {best.step_seconds:.4g} s"
    of = f"{position} of {floor} (the floor)" if position <= floor else f"{position} of at most {count}"
    return f"layout {of}: {layout.name} (best so far: {so_far})"


def plan_layouts(config, *, devices: int, batch_size: int = 8, seq_len: int = 2048, mode: str = "train",
                 hardware: str | HardwareProfile = "h100", device_memory: int | str | None = None,
                 margin: float = DEFAULT_MARGIN, nodes: int | None = None, max_compiles: int | None = None,
                 time_budget: float | None = None, compile_floor: bool = False, floor_guesses: int = TOP_GUESSES,
                 device_search_budget: float | None = None,
                 cache: CompileCache | None = None, cpu_devices: Callable[[int], list] | None = None,
                 progress: Callable[[str], None] | None = None, include: Callable[[Layout], bool] | None = None,
                 compiler: str | None = None, compile_workers: int | None = None, **settings) -> LayoutPlan:
    """Plan `config` (a config.json path, checkpoint directory or dict) on `devices` devices. settings: the
    `PlanRequest` fields (dtype, optimizer, mixed_precision, grad_accum, remat, max_slots, max_model_len, offload).
    compile_floor: compile the floor (`compile_order`: the `floor_guesses` best guesses and one layout of every
    family) even after `time_budget` (`max_compiles` still caps); with `time_budget=0`, the floor alone.
    Layouts an earlier plan compiled are read from `cache` whatever the budget.
    device_search_budget: seconds for the search of the smallest device count that fits, when nothing does
    (default: `time_budget`).
    cache: where compiled steps are kept between plans (default: none, every step compiled).
    include: plan only the legal layouts it accepts (default: all). cpu_devices(count): up to `count` CPU
    devices to compile on (default: JAX's); asked first for the most the plan may use (more than `devices`
    when the state fits nowhere: the smallest count where it does).
    compiler: "target" compiles each step with XLA:GPU for abstract devices of `hardware` (its memory and
    collectives are the GPU compiler's; needs JAX's CUDA plugin), "cpu" with XLA:CPU on `cpu_devices`; None:
    "target" when the plugin is installed and `hardware` is a GPU with a target description, else "cpu".
    compile_workers: layouts compiled at once, each in its own process (`compile_pool`; default 1: in this
    process, on `cpu_devices`); each takes about one core and its own host memory."""
    if devices < 1:
        raise ValueError(f"--devices {devices}: plan at least one device.")
    if not 0 <= margin < 1:
        raise ValueError(f"memory margin {margin} must be in [0, 1): the share of device memory kept free.")
    if compile_workers is not None and compile_workers < 1:
        raise ValueError(f"--compile-workers {compile_workers}: compile at least one layout at a time.")
    if nodes is not None and (nodes < 1 or devices % nodes):
        raise ValueError(f"--nodes {nodes} must divide --devices {devices} (devices per node = devices / nodes).")
    start = time.perf_counter()        # the time budget counts from here: enumeration and searches too
    values = read_config(config)
    check_is_moe(values)
    request = PlanRequest(mode=mode, batch_size=batch_size, seq_len=seq_len, **settings)
    cpu_devices = cpu_devices or default_cpu_devices
    profile = hardware if isinstance(hardware, HardwareProfile) else (
        None if hardware == "cpu" else load_hardware(hardware))
    compiler = resolve_compiler(compiler, profile.name if profile is not None else "cpu")
    if compiler == "target":
        cpu_devices = lambda count: DeviceSpec(profile.name, count).devices()   # noqa: E731  (whole hosts)
    unreachable = unreachable_implementations(profile.name if profile is not None else "cpu")
    left_out = Counter(layout.ep_implementation for layout in layout_space(devices, mode, seq_len)
                       if layout.ep_implementation in unreachable)
    candidates, excluded = enumerate_layouts(values, devices=devices, batch_size=batch_size, seq_len=seq_len,
                                             mode=mode, grad_accum=request.grad_accum,
                                             model_options=request.model_options(),
                                             space=lambda count, mode_: [
                                                 layout for layout in layout_space(count, mode_, seq_len)
                                                 if layout.ep_implementation not in unreachable])
    if not candidates:
        raise ValueError(no_layout_message(devices, batch_size, excluded))
    if include is not None:
        candidates = [candidate for candidate in candidates if include(candidate.layout)]
    if device_memory is not None:
        memory_bytes = parse_memory_size(device_memory)
    elif profile is not None:
        memory_bytes = int(profile.memory_bytes)
    else:                                      # cpu: the host's memory, shared by the devices
        from .cpu_calibration import host_memory_bytes
        memory_bytes = host_memory_bytes() // devices
    usable = int(memory_bytes * (1 - margin))
    optimizer = build_optimizer(request.optimizer, learning_rate=1e-3)
    states = {id(c): train_state_bytes(c.model, optimizer) for c in candidates}
    held = {id(c): states[id(c)].total if mode == "train" else states[id(c)].parameters for c in candidates}
    one_device_state = state_of(_one_device(values, request), request, optimizer)
    bound = None
    if all(state > usable for state in held.values()):   # nothing can fit here: find where it can, first
        bound = state_bound(values, request, start=devices, usable_bytes=usable, optimizer=optimizer,
                            one_device_state=one_device_state)
    provided = _planning_devices(cpu_devices, max(devices, bound[0] or devices) if bound else devices, devices)
    planned_devices = provided[:devices]
    profile = profile or load_hardware("cpu", devices=devices)
    devices_per_node = devices // nodes if nodes else profile.devices_per_node

    cache = cache or CompileCache(None)
    on_cpu = profile.name == "cpu"
    on_target = compiler == "target"
    possible = [c for c in candidates if held[id(c)] <= usable]
    guesses = {id(c): analytic_step_seconds(c, states[id(c)], request, profile, devices_per_node) for c in possible}
    order, floor = compile_order(possible, guesses, held, floor_guesses)
    planned = len(order) if max_compiles is None else min(max_compiles, len(order))
    floor_ids = {id(candidate) for candidate in floor}
    estimates, best = [], None
    in_flight: deque = deque()     # (candidate, cache key, the compile's future), in compile order

    def record(candidate: Candidate, step, cached: bool) -> None:
        nonlocal best
        estimate = _estimate(candidate, states[id(candidate)], request, usable, step, profile, devices_per_node,
                             on_cpu or on_target, cached)
        estimate.guess_seconds = guesses[id(candidate)]
        estimate.activation_guess_bytes = activation_bytes_guess(candidate, request)
        estimates.append(estimate)
        if estimate.fits and (best is None or estimate.sort_key() < best.sort_key()):
            best = estimate

    def collect() -> None:
        candidate, key, future = in_flight.popleft()
        step = future.result()
        cache.store(key, step)
        record(candidate, step, False)

    spec = DeviceSpec(profile.name if on_target else "cpu", devices)
    with CompilePool(compile_workers or 1, spec, local_devices=planned_devices) as pool:
        for position, candidate in enumerate(order, 1):
            key, step = cache.lookup(values, candidate.layout, request, planned_devices, for_cpu=on_cpu)
            if step is not None:          # compiled by an earlier plan: free, whatever the budget
                record(candidate, step, True)
                continue
            out_of_time = time_budget is not None and time.perf_counter() - start >= time_budget and not (
                compile_floor and id(candidate) in floor_ids)
            if position > planned or out_of_time:
                estimates.append(_uncompiled(candidate, states[id(candidate)], request, usable, OUT_OF_BUDGET,
                                             guesses[id(candidate)]))
                continue
            if progress is not None:
                progress(_progress_text(position, min(len(floor), planned), planned, candidate.layout, best))
            in_flight.append((candidate, key, pool.submit(values, candidate.layout, request, for_cpu=on_cpu)))
            while len(in_flight) > pool.workers:   # one waiting beside each worker: none idles between layouts
                collect()
        while in_flight:
            collect()
    estimates += [_uncompiled(c, states[id(c)], request, usable) for c in candidates if held[id(c)] > usable]
    estimates.sort(key=LayoutEstimate.sort_key)
    for rank, estimate in enumerate(estimates, 1):
        estimate.rank = rank
    explain(estimates)
    plan = LayoutPlan(request, devices, profile, memory_bytes, margin, estimates, excluded,
                      floor=[candidate.layout for candidate in floor],
                      compiler=(f"XLA:GPU for abstract {profile.name} devices" if on_target
                                else "XLA:CPU on virtual CPU devices"),
                      unreachable={name: (unreachable[name], count) for name, count in left_out.items()})
    if plan.best is None and any(estimate.why == OUT_OF_BUDGET for estimate in estimates):
        plan.min_devices_note = "not searched: some layouts that may fit were not compiled (compile budget)"
    elif plan.best is None:
        plan.min_devices_to_fit, plan.min_devices_note = smallest_fitting(
            values, request, start=devices, usable_bytes=usable, optimizer=optimizer,
            one_device_state=one_device_state, cpu_devices=cpu_devices, first=bound,
            deadline=(None if (device_search_budget or time_budget) is None
                      else start + (device_search_budget or time_budget)),
            compile_seconds=max((e.compile_seconds or 0.0 for e in estimates), default=0.0) or FIRST_COMPILE_SECONDS)
    return plan


OUT_OF_BUDGET = ("not compiled: the compile budget ran out (raise --max-compiles or --time-budget to plan it); "
                 "its memory is the state alone")


def _one_device(values: dict, request: PlanRequest) -> Candidate:
    from ..causal_lm.auto import AutoModelForCausalLM

    with quiet_model_building():
        model = AutoModelForCausalLM.from_config(values, abstract=True, **request.model_options())
    return Candidate(Layout(1, 1, 1, 1, 1), model)


def no_layout_message(devices: int, batch_size: int, excluded: list[Excluded]) -> str:
    """Why no layout of `devices` devices works, with the most common reasons and what to change."""
    counts: dict[str, int] = {}
    for item in excluded:
        counts[item.reason] = counts.get(item.reason, 0) + 1
    reasons = "; ".join(reason for reason, _ in sorted(counts.items(), key=lambda pair: -pair[1])[:3])
    return (f"no layout of --devices {devices} can run this model with --batch-size {batch_size}: {reasons}. "
            "Try a device count whose factors divide the model's heads, experts and layers (e.g. a power of two), "
            "or a batch size that is a multiple of the data-parallel sizes.")


def search_layouts(config, *, devices: int, batch_size: int = 8, seq_len: int = 2048, mode: str = "train",
                   hardware: str | HardwareProfile = "h100", device_memory: int | str | None = None,
                   **options) -> list[LayoutEstimate]:
    """The legal layouts of `devices` devices for `config`, planned and ranked best first (`plan_layouts`
    without the excluded layouts and the device search)."""
    return plan_layouts(config, devices=devices, batch_size=batch_size, seq_len=seq_len, mode=mode,
                        hardware=hardware, device_memory=device_memory, **options).estimates
