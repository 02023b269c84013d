"""Compile time of a tiny Qwen3-MoE step: scanned vs unrolled layers, 4 vs 48 layers, on 8 CPU devices.

    python scripts/bench/bench_compile.py                      # tp2 fsdp4 ep4, layers 4 and 48
    python scripts/bench/bench_compile.py --layers 4,48 --fsdp 8 --ep 8 --tp 1

For each depth and layer mode it times `lower + compile` of the forward (`model.apply`) and of
forward+backward (`jax.value_and_grad` of a loss on `apply(..., return_hidden=True)`), keeps the fastest
of `--repeats` compilations, and prints each figure as a ratio to the 4-layer (first depth) figure of the
same mode, measured in the same run.
Goal (issue "step engine"): the scanned 48-layer compile within 1.5x of the 4-layer one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    max_position_embeddings=512,
)


def compile_seconds(make_function, *args, repeats: int) -> float:
    """The fastest of `repeats` lower + compile runs, each of a fresh function (no cache hit)."""
    times = []
    for _ in range(repeats):
        function = make_function()
        start = time.perf_counter()
        jax.jit(function).lower(*args).compile()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(layers: int, scan: bool, config: DistributedConfig, batch: int, sequence: int,
            repeats: int) -> tuple[float, float]:
    model = Qwen3MoeForCausalLM(dict(TINY, num_hidden_layers=layers), config, scan_layers=scan)
    params = {name: jax.ShapeDtypeStruct(shape, model.dtype, sharding=model.storage_shardings()[name])
              for name, shape in model.storage_shapes().items()}
    ids = jax.ShapeDtypeStruct((batch, sequence), jnp.int32, sharding=model.batch_sharding())

    def make_forward():
        return lambda params, ids: model.apply(params, ids, capacity=model.capacity_schedule.ladder[0]).logits

    def make_forward_backward():
        def loss(params, ids):
            hidden = model.apply(params, ids, return_hidden=True, inference=False,
                                 capacity=model.capacity_schedule.ladder[0]).hidden_states
            return jnp.mean((hidden @ params["lm_head.weight"].T) ** 2)

        return jax.value_and_grad(loss)

    return (compile_seconds(make_forward, params, ids, repeats=repeats),
            compile_seconds(make_forward_backward, params, ids, repeats=repeats))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="4,48", help="comma-separated depths; the first is the baseline")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=4)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--modes", default="scanned,unrolled")
    parser.add_argument("--repeats", type=int, default=2, help="compile each this many times, keep the fastest")
    args = parser.parse_args(argv)

    config = DistributedConfig(tp_size=args.tp, fsdp_size=args.fsdp, ep_size=args.ep)
    depths = [int(d) for d in args.layers.split(",")]
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, tp={args.tp} "
          f"fsdp={args.fsdp} ep={args.ep}, batch {args.batch} x {args.sequence} tokens")
    print(f"{'layers':>6} {'mode':<9} {'fwd s':>8} {'fwd ratio':>10} {'fwd+bwd s':>10} {'fwd+bwd ratio':>14}")
    for mode in args.modes.split(","):
        baseline = None
        for layers in depths:
            forward, backward = measure(layers, mode == "scanned", config, args.batch, args.sequence, args.repeats)
            baseline = baseline or (forward, backward)
            print(f"{layers:>6} {mode:<9} {forward:8.2f} {forward / baseline[0]:9.2f}x {backward:10.2f} "
                  f"{backward / baseline[1]:13.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
