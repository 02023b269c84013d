"""The layout planner against the clock: predicted step times on `--hardware cpu` vs measured ones, per layout.

    python scripts/checks/check_plan_auto.py [--batch-size 16] [--seq-len 128] [--steps 3] [--repeats 5]
                                             [--layouts N] [--json FILE [--resume]]
                                             [--save-plan FILE | --plan FILE]

Plans bench_train's model (scripts/bench/bench_train.py: a Qwen3-MoE of 4 layers, layer 0 dense, 8 experts
top-2, fp32, AdamW) on 8 virtual CPU devices with `moe_jax.planning.plan_layouts(hardware="cpu")`, which
compiles every legal layout's train step and predicts its time from the compiled program and a profile measured
on this machine. Then runs each layout's train step (`make_train_step`, the program the planner compiled: AdamW,
grad clip 1.0, dispatch buffers at the capacity ladder's first rung) with bench_train's runner and times it:
the fastest of `--repeats` loops of `--steps` steps (the loop least disturbed by other work on a shared
machine), and the process's CPU seconds per step beside it. Prints measured against predicted per layout, the
Spearman rank correlation of the two, and the measured time of the planner's first choice over the fastest
measured. `--save-plan` keeps the planner's rows, `--plan` measures against saved ones without planning again.

The virtual devices share the machine's cores, so the times measure each layout's total work and overheads on
this machine; the check is whether the planner ranks them as the machine does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)

import jax  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax.planning import Layout, PipelineChoice, plan_layouts  # noqa: E402
from moe_jax.planning.compiled_step import build_model  # noqa: E402
from moe_jax.planning.request import PlanRequest  # noqa: E402
from moe_jax.training.optimizers import build_optimizer  # noqa: E402
from moe_jax.training.step import make_train_step  # noqa: E402
from scripts.bench.bench_train import bench_config, device_batches, time_steps, warm_runner  # noqa: E402


def spearman(first: list[float], second: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values):
        order = np.argsort(values, kind="stable")
        result = np.empty(len(values))
        result[order] = np.arange(len(values), dtype=float)
        for value in set(values):            # ties share their mean rank
            tied = [i for i, v in enumerate(values) if v == value]
            result[tied] = np.mean(result[tied])
        return result
    return float(np.corrcoef(ranks(first), ranks(second))[0, 1])


def measure(layout, config: dict, request, args) -> tuple[float, float]:
    """(wall seconds per step: the fastest loop, CPU seconds of this process per step) of the layout's train
    step on this machine."""
    model = build_model(config, layout, request, jax.devices())
    model.init_params(0)
    step = make_train_step(model, build_optimizer("adamw", learning_rate=1e-3), grad_clip=1.0)
    capacity = None if layout.ep == 1 else model.capacity_schedule.start().capacity
    runner, _ = warm_runner(step, capacity, device_batches(model, args.batch_size, args.seq_len))
    cpu_start = time.process_time()
    loops = time_steps(runner, args.steps, args.repeats)
    cpu = (time.process_time() - cpu_start) / (args.steps * args.repeats)
    return float(min(loops)), cpu


def layout_of(row: dict) -> Layout:
    sizes = row["distributed_config"]
    pipeline = None if row["pipeline"] is None else PipelineChoice(**row["pipeline"])
    return Layout(sizes["tp_size"], sizes["ep_size"], sizes["fsdp_size"], sizes["dp_replicate_size"],
                  sizes["pp_size"], sizes["ep_implementation"], pipeline, sizes.get("cp_size", 1),
                  sizes.get("cp_strategy", "all_gather"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per layout (the fastest counts)")
    parser.add_argument("--layouts", type=int, default=None, help="measure only the first N of the ranking")
    parser.add_argument("--json", default=None, help="write the rows (predicted, measured) to this file")
    parser.add_argument("--save-plan", default=None, help="write the planner's rows (its --json) to this file")
    parser.add_argument("--plan", default=None, help="measure against the rows of a --save-plan file instead")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already measured in the --json file and measure the rest")
    args = parser.parse_args()

    config = bench_config(args.hidden)
    request = PlanRequest(batch_size=args.batch_size, seq_len=args.seq_len, dtype="float32", optimizer="adamw")
    print(f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}; "
          f"{jax.device_count()} x {jax.devices()[0].platform}, os.cpu_count() = {os.cpu_count()}")
    if args.plan:
        with open(args.plan, encoding="utf-8") as handle:
            document = json.load(handle)
        print(f"model: bench_train's qwen3_moe, hidden {args.hidden}; batch {args.batch_size} x {args.seq_len}; "
              f"rows of {args.plan}")
    else:
        start = time.perf_counter()
        plan = plan_layouts(config, devices=8, batch_size=args.batch_size, seq_len=args.seq_len, hardware="cpu",
                            dtype="float32", optimizer="adamw",
                            progress=lambda message: print(f"[{time.perf_counter() - start:5.0f} s] {message}",
                                                           file=sys.stderr, flush=True))
        document = plan.as_json()
        print(f"model: bench_train's qwen3_moe, hidden {args.hidden}; batch {args.batch_size} x {args.seq_len}; "
              f"planned {len(plan.estimates)} layouts in {time.perf_counter() - start:.0f} s")
        if args.save_plan:
            with open(args.save_plan, "w", encoding="utf-8") as handle:
                json.dump(document, handle, indent=1)
    rows = [row for row in document["layouts"] if row["compiled"]][:args.layouts]
    print(f"\n{'rank':>4} {'layout':<40} {'predicted ms':>12} {'measured ms':>11} {'CPU ms':>8}")
    results = []
    if args.json and args.resume and os.path.exists(args.json):
        with open(args.json, encoding="utf-8") as handle:
            results = json.load(handle)           # rows measured before: kept, not measured again
    measured_before = {row["layout"] for row in results}
    for row in rows:
        if row["layout"] not in measured_before:
            seconds, cpu = measure(layout_of(row), config, request, args)
            results.append({"rank": row["rank"], "layout": row["layout"], "predicted": row["step_seconds"],
                            "measured": seconds, "cpu": cpu, "parts": row["step_parts"]})
            if args.json:                             # after every layout: a long run can be resumed
                with open(args.json, "w", encoding="utf-8") as handle:
                    json.dump(results, handle, indent=1)
        result = next(result for result in results if result["layout"] == row["layout"])
        print(f"{row['rank']:4d} {row['layout']:<40} {row['step_seconds'] * 1e3:12.1f} "
              f"{result['measured'] * 1e3:11.1f} {result['cpu'] * 1e3:8.1f}", flush=True)
    results = [next(result for result in results if result["layout"] == row["layout"]) for row in rows]
    predicted = [row["predicted"] for row in results]
    measured = [row["measured"] for row in results]
    fastest = min(measured)
    print(f"\nSpearman(predicted, measured) over {len(results)} layouts: {spearman(predicted, measured):.3f} "
          f"(against CPU seconds: {spearman(predicted, [row['cpu'] for row in results]):.3f})")
    print(f"planner's first choice ({results[0]['layout']}) measured {measured[0] * 1e3:.1f} ms; fastest measured "
          f"{fastest * 1e3:.1f} ms ({results[measured.index(fastest)]['layout']}): ratio {measured[0] / fastest:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
