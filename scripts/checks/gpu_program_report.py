"""Qwen3-30B-A3B's train step as XLA:GPU compiles it for 8 (and 16) abstract H100s: what the program does.

    PYTHONPATH=. python scripts/checks/gpu_program_report.py [--sections reduced,depth,memory,overflow,offload]
        [--layouts tp1-ep8-fsdp8-a2a,...] [--hardware h100] [--json FILE] [--hlo-dir DIR]

Each 4- or 8-layer compile takes 1-3 minutes on 2 CPU cores, a 48-layer one 2-5; the default run (every section,
every layout) is about 25 compiles. Sections run in the order given; a section only takes the layouts given
(depth and overflow: the first of them).

Needs JAX's CUDA plugin, not a GPU (`moe_jax.distributed.target_devices`). The model is
tests/fixtures/configs/qwen3_30b_a3b.json (48 layers, all sparse, 128 experts, top 8, H 2048, I 768); each case
is one train step (mixed precision: float32 masters, bfloat16 compute; AdamW; seq 4096) lowered with
`moe_jax.target_compile` and read from its optimized HLO. Sections:

- reduced: 4-layer and 8-layer reductions (num_hidden_layers=4 / 8, unrolled) at each layout x remat none /
  full: no host transfers; the expert matmuls' FLOPs against the routed pairs' (`expected_experts_flops`),
  within 1.3x; the all-to-alls and all-gathers asynchronous with compute between start and done; fusions per
  layer = (fusions at 8 layers - fusions at 4) / 4.
- depth: compile seconds at 4, 8, 16 and 48 layers, remat none (16 and more are scanned: the compile should be
  flat in depth).
- memory: the full 48 layers, per-device memory and whether it fits (90% of 80 GB) for remat x batch on 8 H100s
  and on 16 (two hosts of 8).
- overflow: the full model with and without the train step's overflow check (a step whose dispatch dropped pairs
  is skipped: a conditional around the optimizer update on CPU, a select inside it on accelerators), whose
  memory it changes.
- offload: the full model at the first layout, remat full, batch 8, with nothing, the optimizer state, the
  parameters and both kept in pinned host memory between steps (`PlanRequest.offload`; the placement written
  into the lowered step, `target_compile.host_placement`): device and host bytes per device, and the device
  bytes each choice saves against none.

The expert FLOPs are read at the tile loop's expected visits: a loop whose trip count is only known at run time
is counted at its static schedule times the share expected live (1 / capacity behind all_to_all dispatch
buffers, whose rows are capacity x the balanced share; 1 without them). The figure at the schedule's bound is
printed too. The ratio is checked on the unrolled reductions only (`SCANNED_FROM` says why). Prints a Markdown
table per section and exits 1 if any case has a problem; --json writes every case. Compiled, not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.planning.hlo_costs import program_costs  # noqa: E402
from moe_jax.planning.hlo_program import parse_hlo_module  # noqa: E402
from moe_jax.planning.request import PlanRequest  # noqa: E402
from moe_jax.planning.hardware import load_hardware  # noqa: E402
from moe_jax.target_compile import DEFAULT_MARGIN, build_target_model, compile_devices  # noqa: E402
from moe_jax.target_compile.hlo_report import _experts_flops, read_program  # noqa: E402
from moe_jax.target_compile.programs import train_program  # noqa: E402
from moe_jax.planning.compiled_step import CompiledMemory  # noqa: E402
from moe_jax.target_compile.report import GIB  # noqa: E402
from moe_jax.training.optimizers import build_optimizer  # noqa: E402
from moe_jax.training.state import abstract_train_state  # noqa: E402
from moe_jax.training.step import make_train_step  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "configs" / "qwen3_30b_a3b.json"
SEQ_LEN = 4096
FLOPS_RATIO_LIMIT = 1.3
# Layers are scanned from 16 on. In a scanned stack the HLO walk (`planning.hlo_costs`) counts the forward's tile
# loops once per step instead of once per layer (the layer scan's carry holds an int32 vector as long as the tile
# loop's schedule, which the walk takes for a loop over experts); the FLOPs ratio is checked on the unrolled
# reductions and only printed for scanned programs.
SCANNED_FROM = 16
LAYOUTS = {
    "tp1-ep8-fsdp8-a2a": (8, dict(fsdp_size=8, ep_size=8, ep_implementation="all_to_all")),
    "tp2-ep4-fsdp4": (8, dict(tp_size=2, fsdp_size=4, ep_size=4)),
    "tp4-ep4-fsdp2-a2a": (8, dict(tp_size=4, fsdp_size=2, ep_size=4, ep_implementation="all_to_all")),
    "tp1-ep8-fsdp16-a2a": (16, dict(fsdp_size=16, ep_size=8, ep_implementation="all_to_all")),
    "tp2-ep4-fsdp8": (16, dict(tp_size=2, fsdp_size=8, ep_size=4)),
}
REDUCED_LAYOUTS = ["tp1-ep8-fsdp8-a2a", "tp2-ep4-fsdp4", "tp4-ep4-fsdp2-a2a"]
DEPTHS = (4, 8, 16, 48)
# Fusions per layer from 4 and 8 layers, at these remat settings (each 8-layer compile costs minutes on 2 cores).
FUSION_REMATS = ("none",)
# (layout, remat, batch) of the full model, most telling first: on 8 devices remat full and none at one sequence
# per data-parallel rank, on 16 the same, then the other layouts and the next batch up.
MEMORY_CASES = [
    ("tp1-ep8-fsdp8-a2a", "full", 8), ("tp1-ep8-fsdp8-a2a", "none", 8),
    ("tp1-ep8-fsdp16-a2a", "full", 16), ("tp1-ep8-fsdp16-a2a", "none", 16),
    ("tp2-ep4-fsdp4", "full", 8), ("tp2-ep4-fsdp4", "full", 4), ("tp4-ep4-fsdp2-a2a", "full", 8),
    ("tp1-ep8-fsdp16-a2a", "full", 32), ("tp2-ep4-fsdp8", "full", 16), ("tp1-ep8-fsdp8-a2a", "full", 16),
]


@dataclass(frozen=True)
class Case:
    layout: str
    layers: int
    remat: str
    batch: int
    check_overflow: bool = True    # the train step's skip of a step that dropped pairs (make_train_step's default)
    offload: str | None = None     # the train state kept in pinned host memory between steps (PlanRequest.offload)

    @property
    def devices(self) -> int:
        return LAYOUTS[self.layout][0]


def model_config(layers: int) -> dict:
    config = json.loads(CONFIG.read_text())
    config["num_hidden_layers"] = layers
    config["max_window_layers"] = min(config.get("max_window_layers", layers), layers)
    return config


def sparse_layers(config: dict) -> int:
    """Qwen3-MoE's layers with routed experts: every `decoder_sparse_step`-th, less `mlp_only_layers`."""
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers", []))
    return sum(1 for layer in range(config["num_hidden_layers"])
               if layer not in dense and step > 0 and (layer + 1) % step == 0)


def expected_experts_flops(config: dict, batch: int, devices: int, remat: str) -> float:
    """The routed pairs' expert FLOPs per device per step: (batch x seq x top_k / devices) pairs, each
    2 x (H x 2I + I x H) in the forward, x 3 with the backward (input and weight gradients), x 4 with remat
    full (the forward recomputed), times the sparse layers."""
    hidden, inner = config["hidden_size"], config["moe_intermediate_size"]
    pairs = batch * SEQ_LEN * config["num_experts_per_tok"] / devices
    passes = 4 if remat == "full" else 3
    return pairs * 2 * (hidden * 2 * inner + inner * hidden) * passes * sparse_layers(config)


def tile_fill(model) -> float:
    """The share of the tile loop's static schedule expected live: 1 / capacity behind all_to_all's dispatch
    buffers (capacity x the balanced share of rows), 1 where the loop runs on the routed rows themselves."""
    if model.layout.ep_size == 1:
        return 1.0
    return 1.0 / model.capacity_schedule.start().capacity


_COMPILED: dict[tuple[Case, str], dict] = {}


def compile_case(case: Case, hardware: str, hlo_dir: Path | None = None) -> dict:
    """The reading of `case`'s train step; a case already compiled by another section is not compiled again."""
    if (case, hardware) not in _COMPILED:
        _COMPILED[case, hardware] = read_case(case, hardware, hlo_dir)
    return dict(_COMPILED[case, hardware])


def train_program_without_overflow_check(model, request: PlanRequest):
    """`target_compile.programs.train_program` with `make_train_step(check_overflow=False)`: the optimizer update
    runs unconditionally instead of under the `lax.cond` that skips a step whose dispatch dropped pairs."""
    step = make_train_step(model, build_optimizer(request.optimizer, learning_rate=1e-3), grad_clip=1.0,
                           grad_accum=request.grad_accum, mixed_precision=request.mixed_precision,
                           check_overflow=False)
    capacity = None if model.layout.ep_size == 1 else model.capacity_schedule.start().capacity
    state = abstract_train_state(model, step.optimizer, capacity, trainable=step.trainable)
    batch = jax.ShapeDtypeStruct((request.batch_size, request.seq_len), jnp.int32, sharding=model.batch_sharding())
    return step.lower(state, {"input_ids": batch})


def read_case(case: Case, hardware: str, hlo_dir: Path | None = None) -> dict:
    config = model_config(case.layers)
    request = PlanRequest(mode="train", batch_size=case.batch, seq_len=SEQ_LEN, mixed_precision=True,
                          optimizer="adamw", remat=case.remat, offload=case.offload)
    devices, layout = LAYOUTS[case.layout]
    start = time.perf_counter()
    model = build_target_model(config, DistributedConfig(**layout), compile_devices(hardware, devices), request)
    built = time.perf_counter()
    compiled = (train_program(model, request) if case.check_overflow
                else train_program_without_overflow_check(model, request)).compile()
    compile_seconds = time.perf_counter() - built
    text = compiled.as_text()
    memory = CompiledMemory.of(compiled)
    reading = read_program(text, device_count=devices)
    usable = load_hardware(hardware).memory_bytes * (1 - DEFAULT_MARGIN)
    expected = expected_experts_flops(config, case.batch, devices, case.remat)
    fill = tile_fill(model)
    module = parse_hlo_module(text)
    at_expected = _experts_flops(module, program_costs(module, device_count=devices, tile_fill=fill,
                                                         cpu_artifacts=False))
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{case.layout}_L{case.layers}_{case.remat}_b{case.batch}.hlo").write_text(text)
    overlap = {o.kind: (o.overlapped, o.started) for o in reading.overlap}
    return {
        **asdict(case), "devices": devices, "layout": case.layout, "request": request.describe(),
        "ep_implementation": model.distributed_config.ep_implementation,
        "compile_seconds": round(compile_seconds, 1), "build_seconds": round(built - start, 1),
        "memory_gib": {"arguments": memory.argument / GIB, "outputs": memory.output / GIB,
                       "aliased": memory.alias / GIB, "temporaries": memory.temp / GIB,
                       "total": memory.total / GIB},
        "host_memory_gib": {"arguments": memory.host_argument / GIB, "temporaries": memory.host_temp / GIB,
                            "total": memory.host_total / GIB},
        "usable_gib": usable / GIB, "fits": memory.total <= usable,
        "host_transfers": reading.host_transfers, "experts_kernel": reading.experts_kernel,
        "experts_backends": reading.experts_backends,
        "experts_flops_at_bound": reading.experts_flops, "experts_flops_expected_visits": at_expected,
        "tile_fill": fill, "routed_flops": expected, "ratio": at_expected / expected,
        "ratio_at_bound": reading.experts_flops / expected, "flops": reading.flops,
        "fusions": reading.fusions, "overlap": {kind: list(pair) for kind, pair in overlap.items()},
        "collectives": [c.as_dict() for c in reading.collectives],
    }


def problems(row: dict) -> list[str]:
    found = []
    if row["host_transfers"] and row["offload"] is None:
        found.append("host transfers: " + ", ".join(row["host_transfers"]))
    if row["offload"] is not None and not row["host_memory_gib"]["total"]:
        found.append(f"offload {row['offload']}: no pinned host memory in the compiled program")
    if row["layers"] < SCANNED_FROM and not 1 / FLOPS_RATIO_LIMIT <= row["ratio"] <= FLOPS_RATIO_LIMIT:
        found.append(f"expert FLOPs {row['ratio']:.2f}x the routed pairs' (limit {FLOPS_RATIO_LIMIT}x)")
    if "outside any loop" in row["experts_kernel"] or not row["experts_backends"]:
        found.append(f"expert matmuls: {row['experts_kernel']}")
    for kind in ("all-to-all", "all-gather"):
        overlapped, started = row["overlap"].get(kind, (0, 0))
        if started and overlapped < started:
            found.append(f"{kind}: {started - overlapped} of {started} without compute between start and done")
    return found


def overlap_text(row: dict) -> str:
    return ", ".join(f"{kind} {o}/{s}" for kind, (o, s) in sorted(row["overlap"].items())
                     if kind in ("all-to-all", "all-gather", "reduce-scatter", "all-reduce"))


class Recorder:
    """Every case's row, in order; the JSON file is rewritten after each one (a long run stopped early keeps what
    it compiled)."""

    def __init__(self, hardware: str, path: Path | None, hlo_dir: Path | None = None):
        self.hardware, self.path, self.hlo_dir, self.rows = hardware, path, hlo_dir, []

    def case(self, case: Case, section: str) -> dict:
        row = compile_case(case, self.hardware, self.hlo_dir)
        row["problems"] = problems(row)
        self.rows.append(dict(row, section=section))
        if self.path is not None:
            self.path.write_text(json.dumps({"hardware": self.hardware, "cases": self.rows}, indent=1) + "\n")
        return row


def run_reduced(layouts: list[str], recorder: Recorder) -> None:
    print("\n### 4-layer reduction, batch 8 x 4096 (8 layers with remat none for fusions per layer)\n")
    print("| layout | remat | layers | compile s | total GiB | expert TFLOP/device (expected visits; at bound) | "
          "routed pairs' TFLOP | ratio | async with compute between (overlapped/started) | fusions | "
          "fusions/layer | host transfers | problems |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layout in layouts:
        for remat in ("none", "full"):
            fusions_at_four = None
            for layers in (4, 8) if remat in FUSION_REMATS else (4,):
                row = recorder.case(Case(layout, layers, remat, 8), "reduced")
                per_layer = "" if fusions_at_four is None else f"{(row['fusions'] - fusions_at_four) / 4:.1f}"
                fusions_at_four = row["fusions"] if fusions_at_four is None else fusions_at_four
                print(f"| {layout} | {remat} | {layers} | {row['compile_seconds']} | "
                      f"{row['memory_gib']['total']:.2f} | {row['experts_flops_expected_visits'] / 1e12:.3f}; "
                      f"{row['experts_flops_at_bound'] / 1e12:.3f} | {row['routed_flops'] / 1e12:.3f} | "
                      f"{row['ratio']:.3f} | {overlap_text(row)} | {row['fusions']} | {per_layer} | "
                      f"{', '.join(row['host_transfers']) or 'none'} | {'; '.join(row['problems']) or '-'} |",
                      flush=True)


def run_depth(layout: str, recorder: Recorder) -> None:
    print(f"\n### Compile seconds against depth ({layout}, remat none, batch 8 x 4096)\n")
    print("| layers | scanned | compile s | fusions | total GiB | expert FLOPs ratio | problems |")
    print("|---|---|---|---|---|---|---|")
    for layers in DEPTHS:
        row = recorder.case(Case(layout, layers, "none", 8), "depth")
        print(f"| {layers} | {'yes' if layers >= 16 else 'no'} | {row['compile_seconds']} | {row['fusions']} | "
              f"{row['memory_gib']['total']:.2f} | {row['ratio']:.3f} | {'; '.join(row['problems']) or '-'} |",
              flush=True)


def run_memory(layouts: list[str], recorder: Recorder) -> None:
    print("\n### Full model (48 layers, scanned): per-device memory and fit (usable = 90% of the device)\n")
    print("| devices | layout | remat | batch x 4096 | arguments GiB | temporaries GiB | total GiB | fits | "
          "compile s | expert FLOPs ratio | problems |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layout, remat, batch in MEMORY_CASES:
        if layout not in layouts:
            continue
        row = recorder.case(Case(layout, 48, remat, batch), "memory")
        memory = row["memory_gib"]
        print(f"| {row['devices']} | {layout} | {remat} | {batch} | {memory['arguments']:.2f} | "
              f"{memory['temporaries']:.2f} | {memory['total']:.2f} | {'yes' if row['fits'] else 'NO'} "
              f"({row['usable_gib']:.1f} usable) | {row['compile_seconds']} | {row['ratio']:.3f} | "
              f"{'; '.join(row['problems']) or '-'} |", flush=True)


def run_overflow(layout: str, recorder: Recorder) -> None:
    print(f"\n### The overflow check's cost in memory ({layout}, 48 layers, remat full, smallest batch)\n")
    print("| check_overflow | arguments GiB | temporaries GiB | total GiB | fits | compile s |")
    print("|---|---|---|---|---|---|")
    batch = LAYOUTS[layout][1].get("fsdp_size", 1) * LAYOUTS[layout][1].get("dp_replicate_size", 1)
    for check in (False, True):
        row = recorder.case(Case(layout, 48, "full", batch, check), "overflow")
        memory = row["memory_gib"]
        print(f"| {check} | {memory['arguments']:.2f} | {memory['temporaries']:.2f} | {memory['total']:.2f} | "
              f"{'yes' if row['fits'] else 'NO'} ({row['usable_gib']:.1f} usable) | {row['compile_seconds']} |",
              flush=True)


def run_offload(layout: str, recorder: Recorder) -> None:
    print(f"\n### Host offload ({layout}, 48 layers, remat full, batch 8 x 4096): device and pinned host memory per "
          "device\n")
    print("| offload | device arguments GiB | device temporaries GiB | device total GiB | saved GiB | host GiB | fits "
          "| compile s | host transfers |")
    print("|---|---|---|---|---|---|---|---|---|")
    plain = None
    for offload in OFFLOAD_CHOICES:
        row = recorder.case(Case(layout, 48, "full", 8, offload=offload), "offload")
        memory, host = row["memory_gib"], row["host_memory_gib"]
        plain = memory["total"] if plain is None else plain
        print(f"| {offload or 'none'} | {memory['arguments']:.2f} | {memory['temporaries']:.2f} | "
              f"{memory['total']:.2f} | {plain - memory['total']:.2f} | {host['total']:.2f} | "
              f"{'yes' if row['fits'] else 'NO'} ({row['usable_gib']:.1f} usable) | {row['compile_seconds']} | "
              f"{len(row['host_transfers'])} kinds |", flush=True)


SECTIONS = ("reduced", "depth", "memory", "overflow", "offload")
OFFLOAD_CHOICES = (None, "optimizer", "parameters", "all")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, run in this order")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hlo-dir", type=Path, help="also write each compiled program's optimized HLO here")
    args = parser.parse_args(argv)
    sections = [name for name in args.sections.split(",") if name]
    layouts = [name for name in args.layouts.split(",") if name]
    if unknown := sorted(set(layouts) - set(LAYOUTS)) + sorted(set(sections) - set(SECTIONS)):
        parser.error(f"unknown {unknown}")
    print(f"Qwen3-30B-A3B train step (mixed precision, AdamW, seq {SEQ_LEN}) compiled by XLA:GPU for abstract "
          f"{args.hardware} devices; compiled, not run", flush=True)
    recorder = Recorder(args.hardware, args.json, args.hlo_dir)
    for section in sections:
        if section == "reduced":
            run_reduced([name for name in REDUCED_LAYOUTS if name in layouts], recorder)
        elif section == "depth":
            run_depth(layouts[0], recorder)
        elif section == "overflow":
            run_overflow(layouts[0], recorder)
        elif section == "offload":
            run_offload(layouts[0], recorder)
        else:
            run_memory(layouts, recorder)
    failed = [row for row in recorder.rows if row["problems"]]
    print(f"\n{len(recorder.rows) - len(failed)} cases without problems, {len(failed)} with")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
