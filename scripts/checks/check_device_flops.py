"""Work each device's program does, per layout: finds computation a layout repeats on every device.

    python scripts/checks/check_device_flops.py [--size default|large] [--seq 128] [--layouts tp4_ep4,fsdp4_ep4]

For bench_vs_reference's model and layouts, compiles the forward (the logits, as the bench's forward row) and the
train step (AdamW; dispatch buffers at the capacity ladder's largest rung) once per layout and prints XLA's own
cost analysis of one device's program: FLOPs and bytes accessed, and the FLOPs of all devices together against
the one-device program's. A layout that splits its work
shows the same ratio as the others; one that repeats work on every device stands out (the LM head run whole on
each tp device showed as a tp4/ep4 forward ratio twice fsdp4/ep4's).

XLA counts a loop's body once, whatever its trip count (the experts' tile loop, a scanned run of layers): the
ratios of split layouts are above 1.0 by what each device's copy of those bodies adds, the same for every layout
of one model. Read the ratios against each other, not against 1.0. Compiles only; nothing is timed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

DEVICES = 4

from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(DEVICES)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402
from scripts.bench.bench_vs_reference import LAYOUTS, SIZES, implementations  # noqa: E402


def program_costs(compiled) -> tuple[float, float]:
    """(GFLOP, GB accessed) of one device's compiled program, from XLA's cost analysis."""
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    return costs.get("flops", 0.0) / 1e9, costs.get("bytes accessed", 0.0) / 1e9


def layout_costs(config: dict, ids: np.ndarray, layout: dict | None, implementation: str) -> dict:
    """{"forward": (GFLOP, GB), "train": (GFLOP, GB)} of one device's programs on `layout` (None: one device)."""
    distributed = None if layout is None else DistributedConfig(**layout, ep_implementation=implementation)
    model = Qwen3MoeForCausalLM(config, distributed, devices=jax.devices()[:1] if layout is None else None)
    model.init_params(seed=0)
    capacity = None if model.layout.ep_size == 1 else model.capacity_schedule.largest
    forward = jax.jit(lambda params, ids: model.apply(params, ids, capacity=capacity).logits)
    step = make_train_step(model, optax.adamw(1e-4), grad_clip=None)
    state = step.init_state(capacity=capacity)
    return {"forward": program_costs(forward.lower(model.params, ids).compile()),
            "train": program_costs(step.lower(state, {"input_ids": ids}).compile())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layouts", default=",".join(name for name in LAYOUTS if LAYOUTS[name] is not None),
                        help="comma-separated 4-device layouts of bench_vs_reference")
    args = parser.parse_args()
    names = args.layouts.split(",")
    if unknown := sorted(set(names) - {name for name, layout in LAYOUTS.items() if layout is not None}):
        parser.error(f"--layouts names {unknown}; choose from the 4-device layouts of bench_vs_reference.")
    config = SIZES[args.size]
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (args.batch, args.seq)).astype(np.int32)

    single = layout_costs(config, ids, None, "-")
    print(f"size {args.size}, batch {args.batch} x {args.seq}; XLA's cost analysis of one device's program "
          f"(loop bodies counted once); 'x{DEVICES} / 1 device': all devices' FLOPs over the one-device program's")
    print(f"{'layout':<14} {'ep_impl':<11} {'fwd GFLOP':>9} {'fwd GB':>7} {'x4 / 1 device':>13} "
          f"{'train GFLOP':>11} {'train GB':>8} {'x4 / 1 device':>13}")
    print(f"{'single':<14} {'-':<11} {single['forward'][0]:9.2f} {single['forward'][1]:7.2f} {'':>13} "
          f"{single['train'][0]:11.2f} {single['train'][1]:8.2f}")
    for name in names:
        for implementation in implementations(LAYOUTS[name]):
            costs = layout_costs(config, ids, LAYOUTS[name], implementation)
            ratios = [DEVICES * costs[part][0] / single[part][0] for part in ("forward", "train")]
            print(f"{name:<14} {implementation:<11} {costs['forward'][0]:9.2f} {costs['forward'][1]:7.2f} "
                  f"{ratios[0]:12.2f}x {costs['train'][0]:11.2f} {costs['train'][1]:8.2f} {ratios[1]:12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
