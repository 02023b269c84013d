"""What one device's compiled program does in a step, read from its optimized HLO: kernels and collectives, each
with how many times it runs.

    costs = program_costs(parse_hlo_module(text), device_count=8, pipeline_iterations=5)
    costs.kernels        # [Kernel(flops, bytes, runs, in_pipeline)]: one per fusion / op outside fusions
    costs.collectives    # [Collective(kind, payload_bytes, groups, runs, in_pipeline)]

XLA's own `cost_analysis()` counts a loop's body once, whatever its trip count (a scanned run of layers, the
pipeline's iterations); here every loop body is multiplied by its trip count: the `known_trip_count` XLA
annotates on scans, else (the grouped matmul's tile loop, whose trip count is the number of live tile visits
at run time) the length of the static visit schedule it carries, times the share of it expected to be live
(`tile_fill`); a loop over one expert's visits inside the loop over experts counts the schedule once in all.
Loops XLA:CPU makes of scatters count as one kernel, as other backends run them.

Bytes of a kernel are what it reads and writes: operands plus result, except that an operand a fusion only
slices (a tile window of a loop-carried array) counts the slices, and a result written by dynamic-update-slice
counts the update, as XLA's cost analysis does. Collective payloads are in the dtype the program asked for:
XLA:CPU widens bfloat16 collectives to float32 (a convert before, one after), which this undoes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .hlo_program import ELEMENT_BYTES, Computation, HloModule, Instruction, array_shapes
from .replica_groups import device_groups

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Instructions that move no data at run time (views, tuples, constants, control tokens).
FREE_OPCODES = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
    "opt-barrier", "add-dependency", "domain", "iota",
})
SLICING_OPCODES = frozenset({"dynamic-slice", "slice", "gather"})
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_NARROW_FLOATS = ("bf16", "f16")
# Ops that re-type or re-view a value without computing on it: through them a fusion's parameter is still the
# buffer a dynamic-update-slice updates.
_VIEW_OPCODES = frozenset({"convert", "bitcast", "copy", "reshape"})
# Ops inside a fusion that only re-type or re-view values (a widening convert fusion is made of these).
_CONVERSION_OPCODES = frozenset({"parameter", "convert", "bitcast", "copy", "reshape", "transpose", "tuple",
                                 "get-tuple-element", "broadcast", "slice"})


@dataclass(frozen=True)
class Kernel:
    """One launch: `flops` of its dots, `bytes` it reads and writes, `runs` per step."""

    flops: float
    bytes: float
    runs: float
    in_pipeline: bool
    name: str = ""        # the instruction, for reading a plan's largest kernels


@dataclass(frozen=True)
class Collective:
    """kind: one of `COLLECTIVE_KINDS`; payload_bytes: the data one device contributes (all-gather: the gathered
    result; reduce-scatter: the input before scattering); groups: device numbers of each group (pairs for a
    permute)."""

    kind: str
    payload_bytes: float
    groups: tuple[tuple[int, ...], ...]
    runs: float
    in_pipeline: bool

    @property
    def group_size(self) -> int:
        return max(len(group) for group in self.groups)


@dataclass
class ProgramCosts:
    kernels: list[Kernel] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    bounded_loops: int = 0       # loops counted at their static bound (no known trip count)

    @property
    def flops(self) -> float:
        return sum(kernel.flops * kernel.runs for kernel in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(kernel.bytes * kernel.runs for kernel in self.kernels)

    @property
    def launches(self) -> float:
        return sum(kernel.runs for kernel in self.kernels)

    def total(self) -> float:
        """A scalar to compare branches by: flops plus bytes (both per step)."""
        return self.flops + self.bytes + sum(c.payload_bytes * c.runs for c in self.collectives)


def dot_flops(instruction: Instruction, computation: Computation) -> float:
    """2 x output elements x contracted elements of a `dot` (0 for anything else)."""
    if instruction.opcode != "dot" or not instruction.operands:
        return 0.0
    lhs = computation.by_name.get(instruction.operands[0])
    if lhs is None:
        return 0.0
    lhs_dims = array_shapes(lhs.shape)[0].dims
    contracting = instruction.attribute("lhs_contracting_dims") or "{}"
    contracted = 1
    for dim in re.findall(r"\d+", contracting):
        contracted *= lhs_dims[int(dim)]
    output = sum(shape.elements for shape in array_shapes(instruction.shape))
    return 2.0 * output * contracted


class _Walker:
    def __init__(self, module: HloModule, device_count: int, pipeline_iterations: int | None, tile_fill: float,
                 cpu_artifacts: bool = True):
        self.module = module
        self.device_count = device_count
        self.pipeline_iterations = pipeline_iterations
        self.tile_fill = tile_fill
        self.cpu_artifacts = cpu_artifacts

    # ---- fused computations ------------------------------------------------------------------------------
    def fused_flops(self, name: str) -> float:
        computation = self.module.computations[name]
        flops = 0.0
        for instruction in computation.instructions:
            flops += dot_flops(instruction, computation)
            if instruction.opcode in ("fusion", "call"):     # nested fusions (a dot's own fusion) and calls
                flops += sum(self.fused_flops(called) for called in
                             instruction.called("calls") + instruction.called("to_apply")
                             if called in self.module.computations)
        return flops

    def fusion_bytes(self, instruction: Instruction, computation: Computation) -> float:
        """Operands read plus result written, with sliced operands and in-place updates at their real size.
        Planning for an accelerator, an update XLA:CPU could not do in place (its bf16 buffer widened to f32
        around the dynamic-update-slice, then narrowed back) counts as the in-place update it is there."""
        fused = self.module.computations[instruction.called("calls")[0]]
        views = _VIEW_OPCODES if not self.cpu_artifacts else frozenset()
        parameters = {int(i.operand_text): i for i in fused.instructions if i.opcode == "parameter"}
        users: dict[str, list[Instruction]] = {}
        for inner in fused.instructions:
            for operand in inner.operands:
                users.setdefault(operand, []).append(inner)
        read = 0.0
        for index, operand in enumerate(instruction.operands):
            parameter = parameters.get(index)
            producer = computation.by_name.get(operand)
            full = producer.result_bytes if producer is not None else 0
            uses = _terminal_uses(parameter.name, users, views) if parameter is not None else []
            in_place = uses and all(use.opcode in SLICING_OPCODES or use.opcode == "dynamic-update-slice"
                                    for _, use in uses) and all(use.operands[0] == source for source, use in uses)
            # sliced (a window of it read) or updated in place (only the update written, below): not read whole
            read += sum(use.result_bytes for _, use in uses if use.opcode in SLICING_OPCODES) if in_place else full
        update = _root_update(fused, views)
        written = update.result_bytes if update is not None else instruction.result_bytes
        return read + written

    def updates_in_place(self, instruction: Instruction | None) -> bool:
        return (instruction is not None and instruction.opcode == "fusion"
                and _root_update(self.module.computations[instruction.called("calls")[0]], _VIEW_OPCODES) is not None)

    def in_place_copy(self, instruction: Instruction, computation: Computation,
                      users: dict[str, list[Instruction]]) -> bool:
        """A copy XLA:CPU makes of a loop buffer because its update was not in place (see fusion_bytes): of
        such an update's result, or of the buffer it updates next."""
        if self.cpu_artifacts or instruction.opcode != "copy" or not instruction.operands:
            return False
        if self.updates_in_place(computation.by_name.get(instruction.operands[0])):
            return True
        consumers = users.get(instruction.name, [])
        return bool(consumers) and all(self.updates_in_place(consumer) and consumer.operands[0] == instruction.name
                                       for consumer in consumers)

    # ---- collectives -------------------------------------------------------------------------------------
    def widening_scale(self, operand: str, computation: Computation) -> float:
        """< 1 when `operand` is a pure widening convert of a narrow float (XLA:CPU's bf16 -> f32 for
        collectives): the narrow size over the wide one."""
        producer = computation.by_name.get(operand)
        if producer is None:
            return 1.0
        sources: list[str] = []
        if producer.opcode == "convert":
            source = computation.by_name.get(producer.operands[0]) if producer.operands else None
            sources = [array_shapes(source.shape)[0].dtype] if source is not None else []
        elif producer.opcode == "fusion":
            fused = self.module.computations.get(producer.called("calls")[0])
            if fused is None or any(i.opcode not in _CONVERSION_OPCODES for i in fused.instructions):
                return 1.0
            sources = [array_shapes(i.shape)[0].dtype for i in fused.instructions if i.opcode == "parameter"]
        results = array_shapes(producer.shape)
        if not sources or not results or not all(source in _NARROW_FLOATS for source in sources):
            return 1.0
        return ELEMENT_BYTES[sources[0]] / max(ELEMENT_BYTES.get(results[0].dtype, 4), 1)

    def collective(self, instruction: Instruction, computation: Computation, runs: float,
                   in_pipeline: bool) -> Collective:
        kind = instruction.opcode.removesuffix("-start")
        operands = [computation.by_name[name] for name in instruction.operands if name in computation.by_name]
        operand_bytes = sum(o.result_bytes * self.widening_scale(o.name, computation) for o in operands)
        scale = (operand_bytes / sum(o.result_bytes for o in operands)) if operands and operand_bytes else 1.0
        if kind == "all-gather":
            result = array_shapes(instruction.shape)
            # an async start's result is (operand, output): the gathered array is the last one
            payload = (result[-1].bytes if result else 0) * scale
        else:
            payload = operand_bytes
        groups = tuple(tuple(group) for group in device_groups(instruction.attributes, self.device_count))
        return Collective(kind, payload, groups, runs, in_pipeline)

    # ---- the walk ----------------------------------------------------------------------------------------
    @staticmethod
    def schedule_lengths(instruction: Instruction) -> list[int]:
        """Lengths of the int32 vectors a loop carries ([V] or [1, V] under vmap), in carry order: the visit
        schedules of the grouped matmul's tile loops (and the expert counts of its per-expert loops)."""
        return [shape.dims[-1] for shape in array_shapes(instruction.shape)
                if shape.dtype == "s32" and shape.dims and shape.dims[-1] > 1 and all(d == 1 for d in shape.dims[:-1])]

    def loop_runs(self, instruction: Instruction, runs: float, enclosing: tuple) -> tuple[float, bool]:
        """(runs of the loop's body per step, whether XLA knew its trip count)."""
        match = _TRIP_COUNT.search(instruction.attributes)
        if match is not None:
            return runs * int(match.group(1)), True
        lengths = self.schedule_lengths(instruction)
        if not lengths:
            return runs, False
        bound = lengths[0]
        # A loop over part of a schedule that an enclosing loop carries whole (one expert's visits inside the
        # loop over experts) runs the schedule once in all, not once per enclosing iteration.
        base = next((before for carried, before in enclosing if bound in carried), runs)
        return base * bound * self.tile_fill, False

    def walk(self, name: str, runs: float, in_pipeline: bool, costs: ProgramCosts, enclosing: tuple = ()) -> None:
        computation = self.module.computations[name]
        users: dict[str, list[Instruction]] = {}
        for instruction in computation.instructions:
            for operand in instruction.operands:
                users.setdefault(operand, []).append(instruction)
        for instruction in computation.instructions:
            opcode = instruction.opcode
            if opcode in FREE_OPCODES or opcode.endswith("-done") or opcode in ("async-update",):
                continue
            if self.in_place_copy(instruction, computation, users):
                continue
            if opcode == "while":
                body_runs, known = self.loop_runs(instruction, runs, enclosing)
                costs.bounded_loops += 0 if known else 1
                pipeline = in_pipeline or (self.pipeline_iterations is not None and known
                                           and body_runs == runs * self.pipeline_iterations)
                if known and _expanded_scatter(instruction):
                    inner = ProgramCosts()
                    for called in instruction.called("body"):
                        self.walk(called, body_runs, pipeline, inner)
                    # XLA:CPU's scatter expander: one kernel elsewhere, not one launch per index
                    costs.kernels.append(Kernel(inner.flops / runs, inner.bytes / runs, runs, pipeline))
                    continue
                inside = (*enclosing, (frozenset(self.schedule_lengths(instruction)), runs))
                for key in ("body", "condition"):
                    for called in instruction.called(key):
                        self.walk(called, body_runs, pipeline, costs, inside)
            elif opcode == "conditional":
                branches = instruction.called("branch_computations") or (
                    instruction.called("true_computation") + instruction.called("false_computation"))
                options = []
                for branch in branches:
                    option = ProgramCosts()
                    self.walk(branch, runs, in_pipeline, option, enclosing)
                    options.append(option)
                if options:
                    chosen = max(options, key=ProgramCosts.total)
                    costs.kernels += chosen.kernels
                    costs.collectives += chosen.collectives
                    costs.bounded_loops += chosen.bounded_loops
            elif opcode in ("call", "async-start"):
                for called in instruction.called("to_apply") + instruction.called("calls"):
                    self.walk(called, runs, in_pipeline, costs, enclosing)
            elif opcode.removesuffix("-start") in COLLECTIVE_KINDS:
                collective = self.collective(instruction, computation, runs, in_pipeline)
                if collective.group_size > 1:
                    costs.collectives.append(collective)
            elif opcode == "fusion":
                called = instruction.called("calls")[0]
                costs.kernels.append(Kernel(self.fused_flops(called), self.fusion_bytes(instruction, computation),
                                            runs, in_pipeline, instruction.name))
            else:
                costs.kernels.append(Kernel(dot_flops(instruction, computation),
                                            self.instruction_bytes(instruction, computation), runs, in_pipeline,
                                            instruction.name))

    def instruction_bytes(self, instruction: Instruction, computation: Computation) -> float:
        if instruction.opcode in SLICING_OPCODES:
            return 2.0 * instruction.result_bytes
        if instruction.opcode == "dynamic-update-slice" and len(instruction.operands) > 1:
            update = computation.by_name.get(instruction.operands[1])
            return 2.0 * (update.result_bytes if update is not None else 0)
        operands = sum(computation.by_name[name].result_bytes for name in instruction.operands
                       if name in computation.by_name)
        return operands + instruction.result_bytes


def program_costs(module: HloModule, *, device_count: int, pipeline_iterations: int | None = None,
                  tile_fill: float = 1.0, cpu_artifacts: bool = True) -> ProgramCosts:
    """The kernels and collectives of one device's step. pipeline_iterations: the pipeline loop's trip count
    (microbatches x repeats + stages - 1), whose loops' work is marked `in_pipeline` (None: no pipeline).
    tile_fill: the share of a tile loop's static schedule expected to be live (the real rows over the rows of
    the buffers it runs on: 1 / capacity behind dispatch buffers, 1 without). cpu_artifacts: count what only
    XLA:CPU does (updates of widened bf16 buffers out of place, the copies they need); False when planning for
    an accelerator, whose backend updates them in place."""
    costs = ProgramCosts()
    _Walker(module, device_count, pipeline_iterations, tile_fill, cpu_artifacts).walk(module.entry_name, 1.0, False,
                                                                                       costs)
    return costs


def _terminal_uses(name: str, users: dict[str, list[Instruction]], views: frozenset) -> list[tuple[str, Instruction]]:
    """(the value it uses, the instruction) for each use of `name`, followed through view ops in `views`."""
    found = []
    for use in users.get(name, []):
        if use.opcode in views:
            found += _terminal_uses(use.name, users, views)
        else:
            found.append((name, use))
    return found


def _root_update(fused: Computation, views: frozenset) -> Instruction | None:
    """The update a fusion writes in place: its root dynamic-update-slice (under view ops in `views`), else None."""
    instruction = fused.root
    while instruction.opcode in views and instruction.operands:
        instruction = fused.by_name.get(instruction.operands[0]) or instruction
        if instruction.opcode not in views:
            break
    if instruction.opcode == "dynamic-update-slice" and len(instruction.operands) > 1:
        return fused.by_name.get(instruction.operands[1])
    return None


def _expanded_scatter(instruction: Instruction) -> bool:
    """A loop XLA:CPU made of a scatter (its op_name ends in the scatter primitive)."""
    metadata = instruction.attribute("metadata") or ""
    match = re.search(r'op_name="([^"]*)"', metadata)
    return match is not None and match.group(1).rsplit("/", 1)[-1].startswith("scatter")
