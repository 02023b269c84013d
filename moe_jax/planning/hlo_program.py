"""XLA's HLO text read into computations and instructions: what `hlo_costs` walks.

    module = parse_hlo_module(compiled.as_text())        # or the `*after_optimizations.txt` of a dump
    module.entry.instructions[0].opcode, .shape, .operands, .attributes
    shape_bytes("(f32[8,32]{1,0}, s32[])")              # 1028

Only what a cost walk needs is kept: each instruction's name, opcode, result shape text, operand names and the
attribute text after its operands (calls=, body=, backend_config=, replica_groups=, ...). Shape letters in the
docstrings: none (this module reads text, not arrays).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Bytes per element of each HLO primitive type (sub-byte types rounded up: XLA stores one per byte on CPU).
ELEMENT_BYTES = {
    "pred": 1, "s2": 1, "s4": 1, "s8": 1, "s16": 2, "s32": 4, "s64": 8, "u2": 1, "u4": 1, "u8": 1, "u16": 2,
    "u32": 4, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e4m3": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 1,
}
_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY )?%(?P<name>[\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclass(frozen=True)
class ArrayShape:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return self.elements * ELEMENT_BYTES.get(self.dtype, 4)


def array_shapes(shape_text: str) -> list[ArrayShape]:
    """Every array in a (possibly tuple) shape text, in order: `(f32[2,3]{1,0}, s32[])` -> two shapes."""
    return [ArrayShape(match["dtype"], tuple(int(d) for d in match["dims"].split(",") if d))
            for match in _ARRAY.finditer(shape_text.replace("/*index=", " "))]


def shape_bytes(shape_text: str) -> int:
    return sum(shape.bytes for shape in array_shapes(shape_text))


@dataclass
class Instruction:
    name: str
    opcode: str
    shape: str          # the result's shape text (a tuple's in parentheses)
    operands: list[str]
    attributes: str     # everything after the operand list
    operand_text: str = ""   # the operand list as written (a parameter's number, a constant's value)

    @property
    def result_bytes(self) -> int:
        return shape_bytes(self.shape)

    def attribute(self, key: str) -> str | None:
        """The value of `key=` (a computation name without its %, or a {...} / [...] group), else None."""
        match = re.search(rf"\b{re.escape(key)}=", self.attributes)
        if match is None:
            return None
        start = match.end()
        text = self.attributes
        if text[start] in "{[":
            return text[start:_matching(text, start) + 1]
        end = start
        while end < len(text) and text[end] not in ", ":
            end += 1
        return text[start:end].lstrip("%")

    def called(self, key: str) -> list[str]:
        """Computation names of `key=%a` or `key={%a, %b}`."""
        value = self.attribute(key)
        return [] if value is None else _OPERAND.findall(value) or [value]


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def __post_init__(self):
        self.by_name: dict[str, Instruction] = {}

    def add(self, instruction: Instruction) -> None:
        self.instructions.append(instruction)
        self.by_name[instruction.name] = instruction

    @property
    def root(self) -> Instruction:
        return self.instructions[-1]


@dataclass
class HloModule:
    computations: dict[str, Computation]
    entry_name: str

    @property
    def entry(self) -> Computation:
        return self.computations[self.entry_name]


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start` (brackets of any kind nest)."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] in "([{":
            depth += 1
        elif text[index] in ")]}":
            depth -= 1
            if depth == 0:
                return index
    return len(text) - 1


def parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    rest = match["rest"]
    if rest.startswith("("):                      # a tuple shape
        end = _matching(rest, 0) + 1
    else:
        end = rest.index(" ") if " " in rest else len(rest)
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    close = _matching(rest, paren)
    operands = _OPERAND.findall(rest[paren + 1:close])
    return Instruction(match["name"], opcode, shape, operands, rest[close + 1:], rest[paren + 1:close])


def parse_hlo_module(text: str) -> HloModule:
    """The computations of an HLO module's text (`HloModule ...` followed by `%name (...) -> ... {` blocks)."""
    computations: dict[str, Computation] = {}
    entry_name = None
    current: Computation | None = None
    for line in text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match is not None:
                current = Computation(match["name"])
                computations[current.name] = current
                if match["entry"]:
                    entry_name = current.name
            continue
        if line.startswith("}"):
            current = None
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            current.add(instruction)
    if entry_name is None:
        raise ValueError("the HLO text has no ENTRY computation: pass a whole module (compiled.as_text()).")
    return HloModule(computations, entry_name)
