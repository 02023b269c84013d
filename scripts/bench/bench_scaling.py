"""Scaling sweep of the expert layer (CPU): tokens/s and dispatch-buffer bytes as tokens per device, experts,
top-k and ep grow, with plots.

    pip install matplotlib            # for the plots; this script only
    python scripts/bench/bench_scaling.py [--repeats 3] [--out docs/img]

Each point is the expert layer (router choices from random logits, `softmax_top_k`; dispatch over
fsdp = ep = `ep` devices of the 8 virtual CPU devices, all_to_all; ep = 1 is one device without dispatch),
forward + backward, at the capacity the layer reports it needed for this routing (`required_capacity` of a
call at the largest one). Reported per point: tokens/s (global tokens over the median time) and the dispatch
buffers one device holds (send + receive, ep peers x the largest per-peer buffer's rows x hidden x 4 bytes),
against the bytes of the rows it routes. Defaults: hidden 256, moe intermediate 256, 256 tokens per device, 16
experts, top-2, ep 8; one knob moves per sweep. Writes `scaling.png` (four panels) to `--out` and prints the
table. The machine is shared and noisy: compare points of one run.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.distributed.capacity import capacity_ladder  # noqa: E402
from moe_jax.distributed.experts import EP_DISPATCH, LOCAL, ShardedExperts  # noqa: E402
from moe_jax.distributed.mesh import DeviceLayout, build_mesh  # noqa: E402
from moe_jax.ops.experts import swiglu_experts  # noqa: E402
from moe_jax.ops.routing import softmax_top_k  # noqa: E402
from scripts.bench.bench_moe_layer import layer_step  # noqa: E402
from scripts.bench.timing import median_seconds  # noqa: E402

HIDDEN = INTERMEDIATE = 256
DEFAULT = dict(tokens_per_device=256, experts=16, top_k=2, ep=8)
SWEEPS = {
    "tokens_per_device": [64, 256, 1024],
    "experts": [8, 16, 32, 64],
    "top_k": [1, 2, 4, 8],
    "ep": [1, 2, 4, 8],
}


def measure(tokens_per_device: int, experts: int, top_k: int, ep: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    tokens = tokens_per_device * ep
    hidden = jnp.asarray(rng.standard_normal((tokens, HIDDEN), dtype=np.float32))
    weights, index = softmax_top_k(jnp.asarray(rng.standard_normal((tokens, experts), dtype=np.float32)), top_k,
                                   normalize=True)
    params = {"gate_up_proj": jnp.asarray(rng.standard_normal((experts, 2 * INTERMEDIATE, HIDDEN), np.float32) * 0.05),
              "down_proj": jnp.asarray(rng.standard_normal((experts, HIDDEN, INTERMEDIATE), np.float32) * 0.05)}
    config = DistributedConfig(fsdp_size=ep, ep_size=ep) if ep > 1 else DistributedConfig()
    layer = ShardedExperts(mesh=build_mesh(config, jax.devices()[:ep]), layout=DeviceLayout.from_config(config),
                           mode=EP_DISPATCH if ep > 1 else LOCAL, num_experts=experts,
                           experts_forward=partial(swiglu_experts), ep_implementation="all_to_all")
    capacity, buffer_rows = None, 0
    if ep > 1:
        largest = capacity_ladder(ep)[-1]
        _, statistics = jax.jit(lambda h, i, w, p: layer(h, i, w, p, capacity=largest))(hidden, index, weights, params)
        capacity = float(statistics.required_capacity)
        _, statistics = jax.jit(lambda h, i, w, p: layer(h, i, w, p, capacity=capacity))(hidden, index, weights, params)
        assert int(statistics.dropped) == 0
        buffer_rows = int(statistics.buffer_rows)
    seconds = median_seconds(layer_step(layer, capacity), hidden, weights, params, index, repeats=repeats)
    routed_bytes = tokens_per_device * top_k * HIDDEN * 4
    buffer_bytes = 2 * ep * buffer_rows * HIDDEN * 4  # send and receive, one buffer per peer
    return dict(tokens_per_s=tokens / seconds, capacity=capacity, buffer_mib=buffer_bytes / 2**20,
                buffer_over_routed=buffer_bytes / 2 / routed_bytes if ep > 1 else 0.0)


def plot(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for axis, (knob, points) in zip(axes, results.items()):
        values = [value for value, _ in points]
        axis.plot(values, [p["tokens_per_s"] for _, p in points], "o-", color="tab:blue")
        axis.set_xscale("log", base=2)
        axis.set_xlabel(knob.replace("_", " "))
        axis.set_ylabel("tokens/s (fwd+bwd)", color="tab:blue")
        twin = axis.twinx()
        twin.plot(values, [p["buffer_mib"] for _, p in points], "s--", color="tab:orange")
        twin.set_ylabel("dispatch buffers per device (MiB)", color="tab:orange")
    figure.suptitle("moe_jax expert layer on 2-core CPU (8 virtual devices): one knob moves from "
                    + ", ".join(f"{k}={v}" for k, v in DEFAULT.items()))
    figure.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scaling.png"
    figure.savefig(path, dpi=100)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "docs" / "img"))
    args = parser.parse_args()
    print(f"jax {jax.__version__}; hidden {HIDDEN}, moe intermediate {INTERMEDIATE}, fp32, all_to_all")
    print(f"{'knob':<18}{'value':>6}{'tokens/s':>11}{'capacity':>10}{'buffers MiB':>13}{'buffer/routed':>15}")
    results = {}
    for knob, values in SWEEPS.items():
        results[knob] = []
        for value in values:
            point = measure(**{**DEFAULT, knob: value}, repeats=args.repeats)
            results[knob].append((value, point))
            capacity = "-" if point["capacity"] is None else f"{point['capacity']:.2f}"
            print(f"{knob:<18}{value:>6}{point['tokens_per_s']:>11.0f}{capacity:>10}{point['buffer_mib']:>13.2f}"
                  f"{point['buffer_over_routed']:>14.2f}x", flush=True)
            jax.clear_caches()
    print(f"plot: {plot(results, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
