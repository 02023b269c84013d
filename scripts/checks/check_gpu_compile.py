"""Compile every family's train step and serving programs for 8 abstract H100s (XLA:GPU, no GPU needed).

    PYTHONPATH=. python scripts/checks/check_gpu_compile.py [--families qwen3_moe,mixtral]
        [--layouts fsdp8-ep8-a2a,tp2-fsdp4-ep4,tp8-ep8-allreduce,pp2-fsdp4-ep4[,tp2-fsdp4]] [--programs train,generate,serve]
        [--hardware h100] [--json FILE]

Needs JAX's CUDA plugin (`pip install "jax[cuda13]==<jax's version>"`), not a GPU: the devices come from
`moe_jax.distributed.target_devices`. Each family's tiny fixture config (tests/fixtures/models/<family>/config.json)
is built on each layout and each program is lowered and compiled: the mixed-precision AdamW train step
(`--programs train`), generate's prefill and decode (`generate`), the server's continuous-batching step and
decode (`serve`). Every compiled program must have:

- compiled (an error is a failure, its text printed);
- no host transfers inside the step (`reading.host_transfers` empty);
- expert matmuls run by a grouped kernel (a custom call) or the tiled loop (dots inside while loops over row
  tiles), never a dense dot over every expert outside a loop (`reading.experts_kernel` / `experts_backends`; a
  cuBLAS call, XLA:GPU's lowering of a plain dot, is read as a dot).

A decode step's few tokens skip the grouped kernel: `swiglu_experts` gathers each (token, choice) pair's expert
weights (`moe_jax.ops.experts.gathers_experts`), a product per routed pair, not a dense one over every expert:
the reading names it "gathered per pair" and this script accepts it.

A layout the library refuses when it builds the model (its own ValueError, e.g. Llama 4 has no expert-parallel
plan) is reported as "not a legal layout: <reason>", not as a failure. One row per (family, layout, program);
the last line is "N passed, N failed, N not legal"; the exit status is 1 on any failure. Nothing runs: the
figures are XLA:GPU's, compiled, not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.ops.experts import GATHERED  # noqa: E402
from moe_jax.planning.compiled_step import compile_lowered  # noqa: E402
from moe_jax.target_compile.hlo_report import read_program  # noqa: E402
from moe_jax.planning.request import PlanRequest  # noqa: E402
from moe_jax.target_compile import build_target_model, compile_devices  # noqa: E402
from moe_jax.target_compile.programs import PROGRAMS  # noqa: E402
from moe_jax.planning.compiled_step import CompiledMemory  # noqa: E402
from moe_jax.target_compile.report import GIB, ProgramReport  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models"
FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v3", "llama4_text"]
FAMILY_ALIASES = {"llama4": "llama4_text"}
DEVICES = 8
LAYOUTS = {
    "fsdp8-ep8-a2a": dict(fsdp_size=8, ep_size=8, ep_implementation="all_to_all"),
    "tp2-fsdp4-ep4": dict(tp_size=2, fsdp_size=4, ep_size=4),
    "tp8-ep8-allreduce": dict(tp_size=8, ep_size=8, ep_implementation="all_reduce"),
    "pp2-fsdp4-ep4": dict(pp_size=2, fsdp_size=4, ep_size=4),
}
# Not in the default grid: experts sharded by TP alone, the one way Llama 4 (no expert-parallel plan) shards them.
EXTRA_LAYOUTS = {"tp2-fsdp4": dict(tp_size=2, fsdp_size=4)}
ALL_LAYOUTS = {**LAYOUTS, **EXTRA_LAYOUTS}
# Small enough for 2 CPU cores; the batch divides every layout's data-parallel size and pp2's two microbatches.
REQUESTS = {
    "train": PlanRequest(mode="train", batch_size=8, seq_len=32, mixed_precision=True, optimizer="adamw"),
    "generate": PlanRequest(mode="serve", seq_len=16, max_slots=8, max_model_len=64),
    "serve": PlanRequest(mode="serve", seq_len=16, max_slots=8, max_model_len=64),
}
SHORT_KINDS = {"all-to-all": "a2a", "all-gather": "ag", "all-reduce": "ar", "reduce-scatter": "rs",
               "collective-permute": "cp", "ragged-all-to-all": "ra2a"}


@dataclass
class CaseResult:
    family: str
    layout: str
    program: str
    status: str                      # "passed", "failed" or "not legal"
    problems: list[str] = field(default_factory=list)
    report: ProgramReport | None = None
    layout_text: str = ""

    def as_dict(self) -> dict:
        entry = {"family": self.family, "layout": self.layout, "layout_text": self.layout_text,
                 "program": self.program, "status": self.status, "problems": self.problems}
        if self.report is not None:
            entry.update(self.report.as_dict(device_memory=0))
            entry.pop("memory_bytes", None)
            memory = self.report.memory
            entry["memory_bytes"] = {"arguments": memory.argument, "outputs": memory.output,
                                     "aliased": memory.alias, "temporaries": memory.temp,
                                     "total": memory.total}
        return entry


def fixture_config(family: str) -> dict:
    return json.loads((FIXTURES / family / "config.json").read_text())


def experts_problem(reading) -> str | None:
    """Why the expert matmuls are not a grouped kernel, the tiled loop or decode's per-pair gathered products;
    None when they are. Dots outside loops are accepted only from the gathered path (one product per routed pair)."""
    kernel, backends = reading.experts_kernel, set(reading.experts_backends)
    if not backends:
        return f"no expert matmul found: {kernel}"
    dense = "outside any loop" in kernel and backends != {GATHERED}
    if dense:
        return f"a dense expert dot outside the tile loop: {kernel} [backends {sorted(backends)}]"
    if "custom call" in kernel or "tiled loop" in kernel or backends == {GATHERED}:
        return None
    return f"expert matmuls are neither a grouped kernel nor the tiled loop: {kernel} [backends {sorted(backends)}]"


def program_problems(report: ProgramReport, hlo_text: str) -> list[str]:
    problems = []
    if report.reading.host_transfers:
        problems.append("host transfers: " + ", ".join(report.reading.host_transfers))
    if (problem := experts_problem(report.reading)) is not None:
        problems.append(problem)
    return problems


def compile_program(model, name: str, build, request: PlanRequest) -> tuple[ProgramReport, str]:
    """One program of `PROGRAMS`, lowered and compiled, read as `compile_model` reads it (each program on its own,
    so a failing prefill does not hide the decode); and its optimized HLO."""
    start = time.perf_counter()
    compiled, note = compile_lowered(build(model, request))   # cuBLAS GEMMs where Triton's cannot be tiled
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    if note is not None:
        print(f"  note: {name}: {note}", flush=True)
    return ProgramReport(name, CompiledMemory.of(compiled), seconds,
                         read_program(text, device_count=model.mesh.devices.size)), text


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".strip()


def run_mode(family: str, layout_name: str, mode: str, hardware: str) -> list[CaseResult]:
    """Every program of `mode` ("train", "generate" or "serve") for `family` on `layout_name`."""
    request = REQUESTS[mode]
    programs = PROGRAMS[mode]
    try:
        model = build_target_model(fixture_config(family), DistributedConfig(**ALL_LAYOUTS[layout_name]),
                                   compile_devices(hardware, DEVICES), request)
    except (ValueError, NotImplementedError) as error:
        return [CaseResult(family, layout_name, name, "not legal", [f"not a legal layout: {error}"])
                for name in programs]
    config = model.distributed_config
    layout_text = (f"tp{config.tp_size} ep{config.ep_size} fsdp{config.fsdp_size} pp{config.pp_size}"
                   + (f" {config.ep_implementation}" if config.ep_size > 1 else ""))
    results = []
    for name, build in programs.items():
        try:
            report, text = compile_program(model, name, build, request)
        except (ValueError, NotImplementedError) as error:   # the library refuses the program on this layout
            results.append(CaseResult(family, layout_name, name, "not legal", [f"not a legal layout: {error}"],
                                      layout_text=layout_text))
            continue
        except Exception as error:  # noqa: BLE001  (every compile error is a finding, reported with its text)
            results.append(CaseResult(family, layout_name, name, "failed",
                                      [error_text(error), traceback.format_exc(limit=-4)], layout_text=layout_text))
            continue
        problems = program_problems(report, text)
        results.append(CaseResult(family, layout_name, name, "failed" if problems else "passed", problems, report,
                                  layout_text))
    return results


def collectives_summary(reading) -> str:
    parts = [f"{SHORT_KINDS.get(c.kind, c.kind)}x{c.count}/{c.group_size}" for c in reading.collectives]
    overlapped = sum(o.overlapped for o in reading.overlap)
    started = sum(o.started for o in reading.overlap)
    return (" ".join(parts) or "none") + (f" (async overlapped {overlapped}/{started})" if started else "")


def short_kernel(reading) -> str:
    kernel = reading.experts_kernel
    if reading.experts_backends == [GATHERED]:
        return "gathered per pair"
    if kernel.startswith("tiled loop"):
        return kernel.split(" inside")[0].replace("tiled loop: ", "tiled: ")
    return kernel[:60]


def row(result: CaseResult) -> str:
    head = f"{result.family:<12} {result.layout:<18} {result.program:<10}"
    if result.report is None:
        reason = result.problems[0] if result.problems else ""
        return f"{head} {result.status.upper():<9} {reason}"
    report = result.report
    reading = report.reading
    line = (f"{head} {result.status.upper():<9} {report.compile_seconds:>6.1f} s {report.memory.total / GIB:>7.4f} GiB"
            f"  {short_kernel(reading):<20} {collectives_summary(reading)}")
    if result.status == "failed":
        line += "\n    " + "\n    ".join(result.problems)
    return line


def parse_list(text: str, choices, aliases=None) -> list[str]:
    names = [(aliases or {}).get(name, name) for name in text.split(",") if name]
    if unknown := [name for name in names if name not in choices]:
        raise SystemExit(f"unknown {unknown}; choose among {list(choices)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (llama4 = llama4_text)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated, of {', '.join(ALL_LAYOUTS)} (default: all but {', '.join(EXTRA_LAYOUTS)})")
    parser.add_argument("--programs", default="train,generate,serve",
                        help="train (the train step), generate (prefill, decode), serve (the continuous-batching "
                             "step and decode)")
    parser.add_argument("--hardware", default="h100", help="h100, h200, b200 or a100 (abstract devices)")
    parser.add_argument("--json", type=Path, help="write every case's result and reading here")
    args = parser.parse_args(argv)
    families = parse_list(args.families, FAMILIES, FAMILY_ALIASES)
    layouts = parse_list(args.layouts, ALL_LAYOUTS)
    modes = parse_list(args.programs, REQUESTS)
    print(f"compiling for {DEVICES} x {args.hardware} (XLA:GPU, abstract devices; compiled, not run)", flush=True)
    print(f"{'family':<12} {'layout':<18} {'program':<10} {'status':<9} {'compile':>8} {'total':>11}  "
          f"{'experts kernel':<20} collectives (kind x count / group)", flush=True)
    results: list[CaseResult] = []
    start = time.perf_counter()
    for family in families:
        for layout in layouts:
            for mode in modes:
                for result in run_mode(family, layout, mode, args.hardware):
                    results.append(result)
                    print(row(result), flush=True)
    counts = {status: sum(r.status == status for r in results) for status in ("passed", "failed", "not legal")}
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['not legal']} not legal "
          f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"hardware": args.hardware, "devices": DEVICES,
                                         "requests": {mode: REQUESTS[mode].describe() for mode in modes},
                                         "cases": [result.as_dict() for result in results]}, indent=1) + "\n")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
