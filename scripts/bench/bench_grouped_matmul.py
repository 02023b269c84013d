"""Time every grouped-matmul backend against a dense matmul of the same FLOPs.

    python scripts/bench/bench_grouped_matmul.py            # forward and forward+backward
    python scripts/bench/bench_grouped_matmul.py --no-grad  # forward only
    python scripts/bench/bench_grouped_matmul.py --quick    # one small shape, for a smoke run

For each shape, x is [M, H], w is [E, O, H] and the M rows are split into E
groups, balanced or skewed (a fixed Dirichlet(0.3) draw, usually with empty
groups). The baseline is XLA's dense [M, H] x [H, O] matmul, which does the same
FLOPs as a perfect grouped matmul. Shared machines are noisy, so every timed
candidate call is paired with a baseline call just before it; the table gives
the median time, the median of the paired ratios and the best-of ratio
(fastest candidate run over fastest baseline run). Read the ratios, not the
absolute times.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.ops.grouped_matmul import GROUPED_MATMUL_BACKENDS, default_backend, grouped_matmul
from moe_jax.ops.grouped_matmul_backends.tiled_scan import default_tile_rows, tiled_grouped_matmul


@dataclass(frozen=True)
class Shape:
    rows: int
    experts: int
    in_features: int
    out_features: int
    skewed: bool

    def label(self) -> str:
        split = "skewed" if self.skewed else "balanced"
        return f"M={self.rows} E={self.experts} H={self.in_features} O={self.out_features} {split}"


SHAPES = [
    Shape(4096, 8, 1024, 2048, skewed=False),
    Shape(4096, 8, 1024, 2048, skewed=True),
    Shape(4096, 32, 512, 1024, skewed=False),
    Shape(4096, 32, 512, 1024, skewed=True),
    Shape(4096, 128, 512, 768, skewed=False),
    Shape(4096, 128, 512, 768, skewed=True),
]
BASELINE = "dense [M,H]x[H,O]"
QUICK_SHAPES = [Shape(512, 8, 128, 256, skewed=True)]


def group_sizes_for(shape: Shape) -> np.ndarray:
    """[E] int32 summing to M: equal shares, or a fixed skewed draw."""
    if not shape.skewed:
        sizes = np.full(shape.experts, shape.rows // shape.experts)
        sizes[: shape.rows - sizes.sum()] += 1
        return sizes.astype(np.int32)
    rng = np.random.default_rng(0)
    shares = rng.dirichlet(np.full(shape.experts, 0.3))
    return rng.multinomial(shape.rows, shares).astype(np.int32)


def candidates(shape: Shape, tile_sizes: list[int], platform_name: str) -> dict[str, Callable]:
    """Label -> fn(x, w, group_sizes) for every backend runnable here, tiled at each tile size."""
    runnable = {}
    for name in GROUPED_MATMUL_BACKENDS:
        if name == "tiled":
            auto_tile = default_tile_rows(shape.rows, shape.experts)
            for tile in sorted(set(tile_sizes) | {auto_tile}):
                label = f"tiled R={tile}" + (" (default)" if tile == auto_tile else "")
                runnable[label] = functools.partial(tiled_grouped_matmul, tile_rows=tile)
        elif name == "tokamax" and default_backend(platform_name) != "tokamax":
            continue  # needs tokamax on an NVIDIA GPU
        else:
            runnable[name] = functools.partial(grouped_matmul, backend=name)
    return runnable


def forward_and_backward(fn: Callable) -> Callable:
    """jit(x, w, group_sizes, cotangent) -> (y, dx, dw): 3x the forward FLOPs."""

    def run(x, w, group_sizes, cotangent):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, group_sizes), x, w)
        return (y, *vjp(cotangent))

    return jax.jit(run)


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


def time_against_baseline(
    baseline: Callable[[], object], calls: dict[str, Callable[[], object]], repeats: int, flops: float
) -> dict[str, tuple[float, float, float, float]]:
    """label -> (median ms, GFLOP/s at the median, median paired ratio, best-of ratio).

    Every timed candidate call is paired with a baseline call made just before
    it, so load that comes and goes on a shared machine hits both sides of a
    ratio. The best-of ratio divides the fastest candidate run by the fastest
    baseline run: interference only ever adds time, so it is the least noisy.
    """
    baseline_seconds: list[float] = []
    seconds: dict[str, list[float]] = {label: [] for label in calls}
    ratios: dict[str, list[float]] = {label: [] for label in calls}
    # Candidates one after another, not interleaved: a slow candidate's memory
    # churn (ragged_dot allocates an [E, M, H] copy) must not land on the next one.
    for label, call in calls.items():
        for _ in range(2):  # compile and warm up
            jax.block_until_ready(baseline())
            jax.block_until_ready(call())
        for _ in range(repeats):
            before = _seconds(baseline)
            seconds[label].append(_seconds(call))
            baseline_seconds.append(before)
            ratios[label].append(seconds[label][-1] / before)
    seconds[BASELINE] = baseline_seconds
    ratios[BASELINE] = [1.0]
    return {
        label: (
            statistics.median(seconds[label]) * 1e3,
            flops / statistics.median(seconds[label]) / 1e9,
            statistics.median(ratios[label]),
            min(seconds[label]) / min(baseline_seconds),
        )
        for label in [BASELINE, *calls]
    }


def bench_shape(shape: Shape, tile_sizes: list[int], repeats: int, with_grad: bool) -> list[str]:
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((shape.rows, shape.in_features)), jnp.float32)
    w = jnp.asarray(
        rng.standard_normal((shape.experts, shape.out_features, shape.in_features)) * 0.03, jnp.float32
    )
    cotangent = jnp.asarray(rng.standard_normal((shape.rows, shape.out_features)), jnp.float32)
    group_sizes = jnp.asarray(group_sizes_for(shape))
    dense_w = w[0]
    flops = 2.0 * shape.rows * shape.in_features * shape.out_features

    dense = jax.jit(lambda x, w: x @ w.T)
    fns = candidates(shape, tile_sizes, jax.default_backend())
    forward_calls = {label: functools.partial(jax.jit(fn), x, w, group_sizes) for label, fn in fns.items()}
    forward = time_against_baseline(lambda: dense(x, dense_w), forward_calls, repeats, flops)

    backward = {}
    if with_grad:
        dense_grad = forward_and_backward(lambda x, w, _: x @ w[0].T)
        grad_calls = {
            label: functools.partial(forward_and_backward(fn), x, w, group_sizes, cotangent)
            for label, fn in fns.items()
        }
        dense_grad_call = functools.partial(dense_grad, x, w[:1], group_sizes[:1], cotangent)
        backward = time_against_baseline(dense_grad_call, grad_calls, repeats, 3 * flops)

    sizes = np.asarray(group_sizes)
    lines = [
        f"\n{shape.label()}: group sizes min {sizes.min()} / max {sizes.max()}, "
        f"{int((sizes == 0).sum())} empty; {flops / 1e9:.2f} GFLOP forward",
        "| backend | fwd ms | fwd GFLOP/s | fwd / dense (median, best) |"
        + (" fwd+bwd ms | fwd+bwd / dense (median, best) |" if with_grad else ""),
        "|---|---:|---:|---:|" + ("---:|---:|" if with_grad else ""),
    ]
    for label, (ms, gflops, ratio, best_ratio) in forward.items():
        line = f"| {label} | {ms:.1f} | {gflops:.0f} | {ratio:.2f}x, {best_ratio:.2f}x |"
        if with_grad:
            grad_ms, _, grad_ratio, grad_best_ratio = backward[label]
            line += f" {grad_ms:.1f} | {grad_ratio:.2f}x, {grad_best_ratio:.2f}x |"
        lines.append(line)
    return lines


def cpu_model() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed repeats per candidate (median reported)"
    )
    parser.add_argument(
        "--tiles", default="32,64,128,256,512", help="tile sizes for the tiled backend (its default is added)"
    )
    parser.add_argument("--experts", default="", help="only shapes with these expert counts, e.g. 8,32")
    parser.add_argument("--no-grad", action="store_true", help="skip the forward+backward timings")
    parser.add_argument("--quick", action="store_true", help="one small shape and 3 repeats, a smoke run")
    args = parser.parse_args()

    tile_sizes = [int(tile) for tile in args.tiles.split(",")]
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.experts:
        wanted = {int(count) for count in args.experts.split(",")}
        shapes = [shape for shape in shapes if shape.experts in wanted]
    repeats = 3 if args.quick else args.repeats

    print(f"date: {datetime.date.today().isoformat()}")
    print(f"cpu: {cpu_model()}; jax {jax.__version__}, jaxlib {jax.lib.__version__}, numpy {np.__version__}")
    print(f"platform: {jax.default_backend()}, devices: {jax.devices()}; fp32; {repeats} repeats, medians")
    print(f"load average at start (1/5/15 min): {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    for shape in shapes:
        print("\n".join(bench_shape(shape, tile_sizes, repeats, with_grad=not args.no_grad)), flush=True)


if __name__ == "__main__":
    main()
