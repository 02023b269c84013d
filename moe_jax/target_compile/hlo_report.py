"""What a compiled program's optimized HLO says: its collectives, the kernel that runs the expert matmuls, host
transfers, fusions, and whether the collectives overlap compute.

    reading = read_program(compiled.as_text(), device_count=8)
    reading.collectives          # [CollectiveSummary(kind, count, bytes, group_size)], per device per step
    reading.experts_kernel       # "tiled: ...", "dense all-experts dot ...", "custom call ..."
    reading.experts_flops        # the expert matmuls' FLOPs per device per step (loops times their trip counts)
    reading.host_transfers       # [] when nothing crosses to the host inside the step

Counts and bytes are per step: a collective inside a loop counts once per iteration (known trip counts; a
data-dependent tile loop at its bound), through `planning.hlo_costs`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from ..ops.experts import GATHERED
from ..ops.grouped_matmul import EXPERTS_SCOPE
from ..planning.hlo_costs import program_costs
from ..planning.hlo_program import HloModule, parse_hlo_module

# Instructions that move data between the device and the host inside a program.
HOST_TRANSFER_OPCODES = frozenset({"send", "recv", "send-done", "recv-done", "infeed", "outfeed"})
_HOST_CALL_TARGET = re.compile(r"callback|host|Host", re.IGNORECASE)
_HOST_MEMORY_SPACE = re.compile(r"\bS\(5\)")          # XLA's pinned-host memory space in a layout
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_EXPERTS = re.compile(rf"{EXPERTS_SCOPE}_([A-Za-z0-9_]+)")
_SYNC = re.compile(r'"is_sync":true')
COMPUTE_OPCODES = frozenset({"fusion", "custom-call", "dot", "convolution"})
# Custom calls that are plain matmuls (XLA:GPU's dots handed to cuBLAS): read as dots, in a loop or not.
GEMM_LIBRARY_CALLS = ("__cublas", "__cudnn$matmul")


@dataclass(frozen=True)
class CollectiveSummary:
    """Collectives of one kind and group size: `count` runs per step, `bytes` each device sends in all."""

    kind: str
    count: int
    bytes: int
    group_size: int

    def as_dict(self) -> dict:
        return {"kind": self.kind, "count": self.count, "bytes": self.bytes, "group_size": self.group_size}


@dataclass(frozen=True)
class AsyncOverlap:
    """Of the `started` asynchronous collectives of `kind` in the program text, `overlapped` have compute
    scheduled between their start and done (the rest XLA marked synchronous or left nothing between)."""

    kind: str
    started: int
    overlapped: int

    def as_dict(self) -> dict:
        return {"kind": self.kind, "started": self.started, "overlapped": self.overlapped}


@dataclass
class ProgramReading:
    collectives: list[CollectiveSummary]
    experts_kernel: str
    experts_backends: list[str]
    experts_flops: float
    flops: float
    host_transfers: list[str]
    fusions: int
    overlap: list[AsyncOverlap] = field(default_factory=list)
    attention_kernels: list[str] = field(default_factory=list)


def _collective_summaries(costs) -> list[CollectiveSummary]:
    totals: dict[tuple[str, int], list[float]] = {}
    for collective in costs.collectives:
        entry = totals.setdefault((collective.kind, collective.group_size), [0.0, 0.0])
        entry[0] += collective.runs
        entry[1] += collective.payload_bytes * collective.runs
    return [CollectiveSummary(kind, round(count), round(size), group)
            for (kind, group), (count, size) in sorted(totals.items())]


def _experts_instructions(module: HloModule):
    """(computation, instruction, backend) of each instruction the expert matmuls' name scope emitted."""
    for computation in module.computations.values():
        for instruction in computation.instructions:
            name = _OP_NAME.search(instruction.attributes)
            match = _EXPERTS.search(name.group(1)) if name else None
            if match:
                yield computation, instruction, match.group(1)


def _experts_kernel(module: HloModule, loop_bodies: set[str]) -> tuple[str, list[str]]:
    """How the expert matmuls were compiled, in words, and the backends whose scope appears."""
    backends, dots_in_loops, dense_dots, gathered_dots, calls = set(), 0, 0, 0, Counter()
    for computation, instruction, backend in _experts_instructions(module):
        backends.add(backend)
        target = _CUSTOM_CALL_TARGET.search(instruction.attributes) if instruction.opcode == "custom-call" else None
        if target is not None and not target.group(1).startswith(GEMM_LIBRARY_CALLS):
            calls[target.group(1)] += 1          # a kernel of its own (tokamax, Triton, Mosaic): grouped
        elif instruction.opcode in ("dot", "ragged-dot") or target is not None:   # cuBLAS is a dot
            if backend == GATHERED:
                gathered_dots += 1     # each routed pair times its own expert's gathered weights
            elif computation.name in loop_bodies:
                dots_in_loops += 1
            else:
                dense_dots += 1
    if not backends:
        return "none found (no expert matmul in this program)", []
    parts = []
    if calls:
        parts.append("custom call " + ", ".join(f"{target} x{count}" for target, count in sorted(calls.items())))
    if dots_in_loops:
        parts.append(f"tiled loop: {dots_in_loops} dot(s) inside while loops over row tiles (only routed rows' "
                     "FLOPs)")
    if gathered_dots:
        parts.append(f"gathered per pair: {gathered_dots} dot(s) of each routed pair with its own expert's weights "
                     "(few pairs: decode)")
    if dense_dots:
        parts.append(f"{dense_dots} dot(s) outside any loop" + (
            " (dense over every local expert: the E-fold ragged_dot fallback)" if "ragged_dot" in backends else ""))
    return "; ".join(parts) or "no matmul found under the experts' scope", sorted(backends)


def _loop_bodies(module: HloModule) -> set[str]:
    """Every computation run inside a while loop (bodies and what they call or fuse, transitively)."""
    inside: set[str] = set()
    pending = [called for computation in module.computations.values() for instruction in computation.instructions
               if instruction.opcode == "while" for called in instruction.called("body")]
    while pending:
        name = pending.pop()
        if name in inside or name not in module.computations:
            continue
        inside.add(name)
        for instruction in module.computations[name].instructions:
            for key in ("calls", "to_apply", "body", "condition", "branch_computations"):
                pending += instruction.called(key)
    return inside


def _host_transfers(module: HloModule) -> list[str]:
    found = Counter()
    for computation in module.computations.values():
        for instruction in computation.instructions:
            if instruction.opcode in HOST_TRANSFER_OPCODES:
                found[instruction.opcode] += 1
            elif instruction.opcode == "custom-call":
                target = _CUSTOM_CALL_TARGET.search(instruction.attributes)
                if target and _HOST_CALL_TARGET.search(target.group(1)):
                    found[f"custom-call {target.group(1)}"] += 1
            elif _HOST_MEMORY_SPACE.search(instruction.shape):
                found[f"{instruction.opcode} to host memory"] += 1
    return [f"{what} x{count}" for what, count in sorted(found.items())]


def _overlap(module: HloModule) -> list[AsyncOverlap]:
    """Per kind of asynchronous collective: how many have compute scheduled between start and done."""
    started, overlapped = Counter(), Counter()
    for computation in module.computations.values():
        order = {instruction.name: index for index, instruction in enumerate(computation.instructions)}
        for index, instruction in enumerate(computation.instructions):
            if not instruction.opcode.endswith("-start") or instruction.opcode == "async-start":
                continue
            kind = instruction.opcode.removesuffix("-start")
            done = next((i for i in computation.instructions[index + 1:]
                         if i.opcode == f"{kind}-done" and instruction.name in i.operands), None)
            started[kind] += 1
            if done is None or _SYNC.search(instruction.attributes):
                continue
            between = computation.instructions[index + 1:order[done.name]]
            if any(i.opcode in COMPUTE_OPCODES for i in between):
                overlapped[kind] += 1
    return [AsyncOverlap(kind, started[kind], overlapped[kind]) for kind in sorted(started)]


def _experts_flops(module: HloModule, costs) -> float:
    """FLOPs per step of the kernels that run expert matmuls: instructions under the experts' scope, and fusions
    whose fused computations (at any depth) hold one."""
    scoped = {instruction.name for _, instruction, _ in _experts_instructions(module)}
    holds: dict[str, bool] = {}

    def holds_experts(name: str) -> bool:
        if name not in holds:
            holds[name] = False    # a computation does not call itself; guards the recursion
            computation = module.computations.get(name)
            holds[name] = computation is not None and any(
                instruction.name in scoped or any(holds_experts(called) for called in instruction.called("calls"))
                for instruction in computation.instructions)
        return holds[name]

    fusions = {instruction.name: instruction.called("calls") for computation in module.computations.values()
               for instruction in computation.instructions if instruction.opcode == "fusion"}
    return sum(kernel.flops * kernel.runs for kernel in costs.kernels
               if kernel.name in scoped or any(holds_experts(called) for called in fusions.get(kernel.name, ())))


# Custom-call targets of fused attention kernels -> their names in the report.
_ATTENTION_KERNELS = {"__cudnn$fmha": "cuDNN flash attention"}


def _attention_kernels(module: HloModule) -> list[str]:
    """The fused attention kernels the program calls (cuDNN's forward and backward: "__cudnn$fmha..."), sorted;
    empty where attention compiled to plain fusions."""
    found = set()
    for computation in module.computations.values():
        for instruction in computation.instructions:
            target = _CUSTOM_CALL_TARGET.search(instruction.attributes) if instruction.opcode == "custom-call" else None
            for prefix, name in _ATTENTION_KERNELS.items():
                if target and target.group(1).startswith(prefix):
                    found.add(f"{name} ({target.group(1)})")
    return sorted(found)


def read_program(hlo_text: str, *, device_count: int, tile_fill: float = 1.0) -> ProgramReading:
    """Read one device's optimized HLO (`compiled.as_text()`). tile_fill: the share of a tile loop's static
    schedule expected to be live (1 / the dispatch capacity behind all-to-all buffers; 1: at its bound)."""
    module = parse_hlo_module(hlo_text)
    costs = program_costs(module, device_count=device_count, tile_fill=tile_fill, cpu_artifacts=False)
    kernel, backends = _experts_kernel(module, _loop_bodies(module))
    fusions = sum(1 for computation in module.computations.values() for instruction in computation.instructions
                  if instruction.opcode == "fusion")
    return ProgramReading(_collective_summaries(costs), kernel, backends, _experts_flops(module, costs), costs.flops,
                          _host_transfers(module), fusions, _overlap(module), _attention_kernels(module))
