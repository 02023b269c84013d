"""A/B of one train-step choice on bench_vs_reference's Qwen3-MoE: both variants compiled in one process, their
steps run alternately, medians printed with the ratio (docs/benchmarks.md, "Train-step choices").

    python scripts/bench/ab_train_step.py scan-layers [--size default|large] [--seq 128] [--rounds 8]
    python scripts/bench/ab_train_step.py remainder-tiles --size large --seq 256 --rounds 4
    python scripts/bench/ab_train_step.py remainder-rows [--forward] [--size large --seq 256]
    python scripts/bench/ab_train_step.py kept-logits --layout fsdp4_ep4 --capacity 1.5
    python scripts/bench/ab_train_step.py fused-swiglu [--forward]

Choices (the first variant is the baseline):
    scan-layers       scanned layers against unrolled (`scan_layers=True / False`)
    remainder-tiles   the tiled grouped matmul's one-level tiles against two-level (`default_remainder_rows`)
    remainder-rows    two-level tiles with quarter-tile remainders (the default) against 16-row ones (8 for
                      64-row tiles)
    kept-logits       the loss recomputing each chunk's logits in the backward pass against keeping them
    fused-swiglu      the experts' gate/up and down as two chained tiled grouped matmuls against one fused tile
                      loop (`moe_jax.ops.grouped_swiglu`)

--forward times the jitted forward (logits, as bench_vs_reference's forward column) instead of the train step.

A variant that is not a model option is set by patching module constants (in every module that holds them) while
the step is traced and compiled (a measurement device only). AdamW, fp32; with --layout the step runs on 4 virtual
CPU devices (bench_vs_reference's layouts) at --capacity (default 1.5, where a training run settles).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(4)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import moe_jax.ops.grouped_matmul_backends.tiled_scan as tiled_scan  # noqa: E402
import moe_jax.ops.grouped_matmul_backends.tiled_swiglu as tiled_swiglu  # noqa: E402
import moe_jax.ops.grouped_swiglu as grouped_swiglu  # noqa: E402
import moe_jax.training.loss as loss  # noqa: E402
from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402
from scripts.bench.bench_vs_reference import LAYOUTS, SIZES  # noqa: E402

# choice -> ((variant name, model options, {(module, constant): value while tracing}), ...); baseline first.
CHOICES = {
    "scan-layers": (("scanned", {"scan_layers": True}, {}), ("unrolled", {"scan_layers": False}, {})),
    "remainder-tiles": (("one-level", {}, {(module, "default_remainder_rows"): lambda tile_rows: None
                                           for module in (tiled_scan, tiled_swiglu)}),
                        ("two-level", {}, {})),
    "remainder-rows": (("quarter-tile", {}, {}),
                       ("16-row", {}, {(module, "default_remainder_rows"):
                                       lambda tile_rows: min(16, tile_rows // 8) if tile_rows >= 64 else None
                                       for module in (tiled_scan, tiled_swiglu)})),
    "kept-logits": (("recomputed", {}, {(loss, "KEPT_LOGITS_BYTES"): 0}), ("kept", {}, {})),
    "fused-swiglu": (("chained", {}, {(grouped_swiglu, "FUSED_SWIGLU_BACKENDS"): {}}), ("fused", {}, {})),
}


@contextmanager
def patched(constants: dict):
    saved = {key: getattr(*key) for key in constants}
    for (module, name), value in constants.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def compiled_train_step(model, batch, layout, args):
    """-> (run(state) -> (state, metrics), the first state): one AdamW step, compiled now."""
    step = make_train_step(model, optax.adamw(1e-4))
    state = step.init_state(capacity=None if layout is None else args.capacity)
    compiled = step.lower(state, batch).compile()
    return (lambda state: compiled(state, batch)), state


def compiled_forward(model, batch, layout, args):
    """-> (run(params) -> (params, logits), the parameters): the jitted forward, compiled now."""
    capacity = None if layout is None else args.capacity
    ids = jax.device_put(batch["input_ids"], model.batch_sharding())
    forward = jax.jit(lambda params, ids: model.apply(params, ids, capacity=capacity).logits)
    compiled = forward.lower(model.params, ids).compile()
    return (lambda params: (params, compiled(params, ids))), model.params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("choice", choices=sorted(CHOICES))
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--layout", choices=[name for name, kwargs in LAYOUTS.items() if kwargs], default=None)
    parser.add_argument("--capacity", type=float, default=1.5)
    parser.add_argument("--ep-implementation", default="auto", choices=("auto", "all_to_all", "all_reduce"))
    parser.add_argument("--forward", action="store_true", help="time the forward (logits) instead of the train step")
    args = parser.parse_args()
    config = SIZES[args.size]
    layout = (None if args.layout is None else
              DistributedConfig(**LAYOUTS[args.layout], ep_implementation=args.ep_implementation))
    devices = jax.devices()[:1 if layout is None else 4]
    batch = {"input_ids": np.random.default_rng(0).integers(0, config["vocab_size"], (8, args.seq), dtype=np.int32)}
    runs = {}
    for name, options, constants in CHOICES[args.choice]:
        with patched(constants):
            model = Qwen3MoeForCausalLM(config, layout, devices=devices, **options)
            model.init_params(seed=0)
            start = time.perf_counter()
            run, state = (compiled_forward if args.forward else compiled_train_step)(model, batch, layout, args)
            print(f"{name}: compiled in {time.perf_counter() - start:.1f} s", flush=True)
        state, output = run(state)
        jax.block_until_ready(output)
        runs[name] = [run, state, []]
    for _ in range(args.rounds):
        for entry in runs.values():
            start = time.perf_counter()
            entry[1], output = entry[0](entry[1])
            jax.block_until_ready(output)
            entry[2].append(time.perf_counter() - start)
    baseline = float(np.median(next(iter(runs.values()))[2]))
    where = "one device" if layout is None else args.layout
    what = "forward" if args.forward else "train step"
    print(f"{args.choice}, {what}, size {args.size}, batch 8 x {args.seq}, {where}, {args.rounds} alternating rounds:")
    for name, (_, _, times) in runs.items():
        median = float(np.median(times))
        print(f"  {name:<12} median {median * 1e3:8.0f} ms  min {min(times) * 1e3:8.0f} ms  {median / baseline:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
