"""MoE layer benchmark: expert GEMM rate vs XLA's dense matmul, and EP dispatch cost vs ep=1.

    python scripts/bench/bench_moe_layer.py [--tokens 4096] [--hidden 512] [--intermediate 512] [--experts 16]
                                      [--top-k 2] [--repeats 5]

Runs on 8 virtual CPU devices (set here before JAX starts). Prints, per grouped-matmul backend:
- the experts computation alone on one device (forward), its GFLOP/s and the ratio to a dense
  `[N*K, H] x [H, 3I]` matmul of the same FLOPs measured in the same run;
- the whole expert layer (forward + backward) for the same total tokens: ep=1 on one device, all_to_all
  over 8 devices (fsdp=8, ep=8), all_reduce over 8 devices (tp=8, ep=8), as times and ratios to ep=1.
The machine is shared and noisy: compare ratios, not absolute times. Medians of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.distributed.capacity import DEFAULT_FIRST_CAPACITY  # noqa: E402
from moe_jax.distributed.experts import EP_DISPATCH, LOCAL, ShardedExperts  # noqa: E402
from moe_jax.distributed.mesh import DeviceLayout, build_mesh  # noqa: E402
from moe_jax.ops.experts import swiglu_experts  # noqa: E402
from moe_jax.ops.routing import softmax_top_k  # noqa: E402
from scripts.bench.timing import median_seconds  # noqa: E402


def make_problem(args):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((args.tokens, args.hidden), dtype=np.float32))
    logits = jnp.asarray(rng.standard_normal((args.tokens, args.experts), dtype=np.float32))
    weights, index = softmax_top_k(logits, args.top_k, normalize=True)
    params = {
        "gate_up_proj": jnp.asarray(
            rng.standard_normal((args.experts, 2 * args.intermediate, args.hidden), dtype=np.float32) * 0.05),
        "down_proj": jnp.asarray(
            rng.standard_normal((args.experts, args.hidden, args.intermediate), dtype=np.float32) * 0.05),
    }
    return hidden, index, weights, params


def layer_step(experts: ShardedExperts, capacity: float):
    """Forward + backward of the expert layer (what a training step pays) at a dispatch capacity."""

    def loss(hidden, weights, params, index):
        output, _ = experts(hidden, index, weights, params, capacity=capacity)
        return jnp.sum(output * output)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="tiled,ragged_dot")
    parser.add_argument("--capacity", type=float, default=DEFAULT_FIRST_CAPACITY,
                        help=f"dispatch capacity (default: the ladder's first, {DEFAULT_FIRST_CAPACITY})")
    args = parser.parse_args(argv)

    hidden, index, weights, params = make_problem(args)
    pairs = args.tokens * args.top_k
    expert_flops = 2 * pairs * 3 * args.hidden * args.intermediate  # gate_up (2I x H) + down (H x I)

    dense_lhs = jnp.ones((pairs, args.hidden), jnp.float32)
    dense_rhs = jnp.ones((args.hidden, 3 * args.intermediate), jnp.float32)
    dense_time = median_seconds(jax.jit(jnp.dot), dense_lhs, dense_rhs, repeats=args.repeats)
    dense_rate = expert_flops / dense_time / 1e9
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices; tokens={args.tokens} hidden={args.hidden} "
          f"intermediate={args.intermediate} experts={args.experts} top_k={args.top_k}")
    print(f"dense matmul [{pairs}, {args.hidden}] x [{args.hidden}, {3 * args.intermediate}]: "
          f"{dense_time * 1e3:.1f} ms, {dense_rate:.1f} GFLOP/s")
    print()
    print(f"{'backend':<11} {'what':<34} {'ms':>9} {'GFLOP/s':>9} {'ratio':>18}")

    for backend in args.backends.split(","):
        experts_forward = partial(swiglu_experts, backend=backend)
        forward = jax.jit(lambda h, i, w, p, experts_forward=experts_forward: experts_forward(h, i, w, **p))
        experts_time = median_seconds(forward, hidden, index, weights, params, repeats=args.repeats)
        rate = expert_flops / experts_time / 1e9
        print(f"{backend:<11} {'experts forward, 1 device':<34} {experts_time * 1e3:9.1f} {rate:9.1f} "
              f"{rate / dense_rate:10.2f} x dense")

        layouts = [
            ("ep=1, 1 device", DistributedConfig(), LOCAL, "auto"),
            ("ep=1 fsdp=8 (no dispatch)", DistributedConfig(fsdp_size=8), LOCAL, "auto"),
            ("all_to_all fsdp=8 ep=8", DistributedConfig(fsdp_size=8, ep_size=8), EP_DISPATCH, "all_to_all"),
            ("all_reduce tp=8 ep=8", DistributedConfig(tp_size=8, ep_size=8), EP_DISPATCH, "all_reduce"),
        ]
        baseline = None
        for name, config, mode, implementation in layouts:
            experts = ShardedExperts(
                mesh=build_mesh(config), layout=DeviceLayout.from_config(config), mode=mode,
                num_experts=args.experts, experts_forward=experts_forward, ep_implementation=implementation,
            )
            step = layer_step(experts, args.capacity)
            seconds = median_seconds(step, hidden, weights, params, index, repeats=args.repeats)
            baseline = baseline or seconds
            step_rate = 3 * expert_flops / seconds / 1e9  # forward + backward ~ 3x forward FLOPs
            print(f"{backend:<11} {'layer fwd+bwd, ' + name:<34} {seconds * 1e3:9.1f} {step_rate:9.1f} "
                  f"{seconds / baseline:10.2f} x ep=1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
