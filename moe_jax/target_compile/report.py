"""One compiled program's report: per-device memory against the device, compile time, collectives, the expert
kernel, host transfers; and the whole answer of `compile_for_target` (`CompileReport`) with its JSON form.

    report.fits, report.memory.total, report.advice, report.as_json()
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..planning.compiled_step import CompiledMemory
from .hlo_report import ProgramReading

GIB = 2**30


def size_text(count: int) -> str:
    """Bytes as GiB from 1 GiB up, else MiB (a tiny model's program is not "0.00 GiB")."""
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2**20:.1f} MiB"


@dataclass
class ProgramReport:
    name: str
    memory: CompiledMemory     # XLA's memory_analysis() of one device's program (`planning.compiled_step`)
    compile_seconds: float
    reading: ProgramReading

    def as_dict(self, device_memory: int) -> dict:
        reading = self.reading
        return {
            "memory_bytes": {"arguments": self.memory.argument, "outputs": self.memory.output,
                             "aliased": self.memory.alias, "temporaries": self.memory.temp,
                             "total": self.memory.total, "device_memory": device_memory},
            "host_memory_bytes": {"arguments": self.memory.host_argument, "outputs": self.memory.host_output,
                                  "aliased": self.memory.host_alias, "temporaries": self.memory.host_temp,
                                  "total": self.memory.host_total},
            "compile_seconds": round(self.compile_seconds, 2),
            "collectives": [collective.as_dict() for collective in reading.collectives],
            "async_collectives": [overlap.as_dict() for overlap in reading.overlap],
            "experts_kernel": reading.experts_kernel,
            "attention_kernels": reading.attention_kernels,
            "experts_backends": reading.experts_backends,
            "experts_flops_per_device": reading.experts_flops,
            "flops_per_device": reading.flops,
            "fusions": reading.fusions,
            "host_transfers": reading.host_transfers,
        }


@dataclass
class CompileReport:
    """hardware / devices / compiler: what was compiled for, and by what; usable_bytes: the device memory less
    the margin; programs: each compiled program (train_step, or prefill and decode)."""

    hardware: str
    devices: int
    compiler: str
    layout: str
    request: str
    device_memory: int
    usable_bytes: int
    programs: list[ProgramReport]
    notes: list[str] = field(default_factory=list)
    executables: dict = field(default_factory=dict, repr=False)   # name -> the compiled program (`save_executables`)

    @property
    def largest(self) -> ProgramReport:
        """The program that needs the most memory: the one that decides whether the layout fits."""
        return max(self.programs, key=lambda program: program.memory.total)

    @property
    def fits(self) -> bool:
        return all(program.memory.total <= self.usable_bytes for program in self.programs)

    @property
    def advice(self) -> str:
        """What to change when the largest program does not fit ("" when it does)."""
        if self.fits:
            return ""
        memory = self.largest.memory
        if memory.argument > self.usable_bytes:
            return ("the program's inputs alone (parameters, optimizer state, cache) exceed the device: shard them "
                    "over more devices (--fsdp / --ep / --tp, or a larger --devices), or use --dtype bfloat16")
        if not self.request.startswith("train"):
            return "the temporaries exceed what is left: lower --max-slots or --max-model-len, or use more devices"
        remat = "" if "remat full" in self.request else "add --remat full, or "
        return (f"the activations and temporaries exceed what is left: {remat}lower --batch-size (or raise "
                "--grad-accum), or use more devices")

    def as_json(self) -> dict:
        largest = self.largest
        return {
            "hardware": self.hardware,
            "devices": self.devices,
            "compiler": self.compiler,
            "layout": self.layout,
            "request": self.request,
            "program": largest.name,
            **largest.as_dict(self.device_memory),
            "usable_memory_bytes": self.usable_bytes,
            "fits": self.fits,
            "advice": self.advice,
            "compile_seconds": round(sum(program.compile_seconds for program in self.programs), 2),
            "programs": {program.name: program.as_dict(self.device_memory) for program in self.programs},
            "notes": list(self.notes),
        }

    def text(self) -> str:
        lines = [f"{self.request}", f"layout {self.layout} on {self.devices} x {self.hardware} "
                 f"({self.device_memory / GIB:.1f} GiB each, {self.usable_bytes / GIB:.1f} GiB usable); "
                 f"compiled by {self.compiler}; compiled, not run"]
        for program in self.programs:
            memory, reading = program.memory, program.reading
            lines += ["", f"{program.name}: compiled in {program.compile_seconds:.1f} s, {reading.fusions} fusions",
                      f"  memory per device: arguments {size_text(memory.argument)}, outputs "
                      f"{size_text(memory.output)} (aliased {size_text(memory.alias)}), temporaries "
                      f"{size_text(memory.temp)}, total {size_text(memory.total)} -> "
                      + ("fits" if memory.total <= self.usable_bytes else "does NOT fit"),
                      *([f"  pinned host memory per device: arguments {size_text(memory.host_argument)}, outputs "
                         f"{size_text(memory.host_output)} (aliased {size_text(memory.host_alias)}), temporaries "
                         f"{size_text(memory.host_temp)}, total {size_text(memory.host_total)}"]
                        if memory.host_total else []),
                      f"  expert matmuls: {reading.experts_kernel}"
                      + (f" [backend {', '.join(reading.experts_backends)}]" if reading.experts_backends else ""),
                      "  attention: " + (", ".join(reading.attention_kernels) or "fusions (no fused kernel)"),
                      "  collectives per step (kind, count, MiB sent per device, group size):"]
            lines += [f"    {c.kind:<20} {c.count:>6} {c.bytes / 2**20:>12.2f} {c.group_size:>4}"
                      for c in reading.collectives] or ["    none"]
            if reading.overlap:
                lines.append("  asynchronous with compute between start and done: " + ", ".join(
                    f"{o.kind} {o.overlapped}/{o.started}" for o in reading.overlap))
            lines.append("  host transfers: " + (", ".join(reading.host_transfers) or "none"))
        lines.append("")
        lines.append("fits" if self.fits else f"does not fit: {self.advice}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)
