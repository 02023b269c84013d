"""The `cpu` hardware profile, measured on this machine's virtual CPU devices in a few seconds.

    profile = measure_cpu_profile(devices=8)

XLA's virtual CPU devices share the machine's cores: when a step runs, all of them work at once, so each gets
a share of the machine. Every rate is therefore measured with all `devices` busy at once (one sharded program)
and divided among them: a device's FLOP/s is the machine's over `devices`, and the same for memory bandwidth.
Collectives between virtual devices are copies in one process; their latency and bandwidth come from an
all-reduce over all devices at two sizes, fitted to the ring model `step_time` uses. A kernel's fixed cost
(XLA:CPU runs each fusion as one task) is the time of a chain of tiny dots divided by its length.
"""

from __future__ import annotations

import os
import time
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .hardware import HardwareProfile, Link

MATMUL_SHAPE = (512, 256, 512)   # rows, depth, columns of each dot in the FLOP-rate chain
MATMUL_CHAIN = 8         # dots per chain: one program call's fixed cost spread over them
STREAM_ELEMENTS = 1 << 22  # float32 elements per device for the bandwidth pass
CHAIN_LENGTH = 256       # tiny dots in the launch-overhead chain
REPEATS = 9


def _seconds(function, *args) -> float:
    """The fastest of `REPEATS` calls after a warm-up (less noise from other work on a shared machine)."""
    jax.block_until_ready(function(*args))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def _mesh(devices: list) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.asarray(devices), ("d",))


def _sharded(array: np.ndarray, mesh) -> jax.Array:
    return jax.device_put(array, NamedSharding(mesh, P("d")))


def matmul_rate(mesh, dtype) -> float:
    """FLOP/s of one device while every device runs its own chain of mid-sized dots (a model's dots are of
    this order; the rate of one large square dot overstates what they reach on a CPU)."""
    count = mesh.devices.size
    rows, depth, columns = MATMUL_SHAPE
    rng = np.random.default_rng(0)
    a = _sharded(rng.standard_normal((count, rows, depth)).astype(np.float32) * 0.01, mesh).astype(dtype)
    up = _sharded(rng.standard_normal((count, depth, columns)).astype(np.float32) * 0.01, mesh).astype(dtype)
    down = _sharded(rng.standard_normal((count, columns, depth)).astype(np.float32) * 0.01, mesh).astype(dtype)

    def chain(a, up, down):
        for _ in range(MATMUL_CHAIN // 2):
            a = jnp.einsum("dij,djk->dik", jnp.einsum("dij,djk->dik", a, up), down)
        return a

    return 2.0 * rows * depth * columns * MATMUL_CHAIN / _seconds(jax.jit(chain), a, up, down)


def stream_bandwidth(mesh) -> float:
    """Bytes/s one device reads and writes while every device streams its own array."""
    count = mesh.devices.size
    x = _sharded(np.ones((count, STREAM_ELEMENTS), np.float32), mesh)
    seconds = _seconds(jax.jit(lambda x: x * 1.5 + 1.0), x)
    return 2.0 * STREAM_ELEMENTS * 4 / seconds


def all_reduce_link(mesh) -> Link:
    """The ring model's latency and bandwidth fitted to all-reduces of a small and a large array."""
    count = mesh.devices.size
    if count == 1:
        return Link(1e12, 0.0)

    def all_reduce_seconds(elements: int) -> float:
        x = _sharded(np.ones((count, elements), np.float32), mesh)
        reduce = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        return _seconds(reduce, x)

    small, large = 16, 1 << 20
    small_seconds, large_seconds = all_reduce_seconds(small), all_reduce_seconds(large)
    steps, factor = 2 * (count - 1), 2 * (count - 1) / count
    latency = small_seconds / steps
    bandwidth = factor * large * 4 / max(large_seconds - small_seconds, 1e-9)
    return Link(bandwidth, latency)


def kernel_overhead(mesh) -> float:
    """Seconds per kernel: a chain of tiny dependent dots (no fusion joins dots) over every device at once."""
    count = mesh.devices.size
    x = _sharded(np.ones((count, 8, 8), np.float32), mesh)

    def chain(x):
        for _ in range(CHAIN_LENGTH):
            x = jnp.einsum("dij,djk->dik", x, x) * 0.125
        return x

    return _seconds(jax.jit(chain), x) / CHAIN_LENGTH


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@lru_cache(maxsize=8)
def measure_cpu_profile(devices: int) -> HardwareProfile:
    """The `cpu` profile of `devices` virtual CPU devices of this process (measured once per count)."""
    available = jax.devices("cpu")
    if len(available) < devices:
        raise ValueError(f"measuring the cpu profile needs {devices} CPU devices but JAX has {len(available)}; set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts.")
    mesh = _mesh(available[:devices])
    link = all_reduce_link(mesh)
    float32 = matmul_rate(mesh, jnp.float32)
    rates = {"float32": float32, "bfloat16": matmul_rate(mesh, jnp.bfloat16)}
    return HardwareProfile(
        name="cpu", peak_flops=rates, hbm_bytes_per_second=stream_bandwidth(mesh),
        memory_bytes=host_memory_bytes() / devices, devices_per_node=devices, intra_node=link, inter_node=link,
        kernel_overhead_seconds=kernel_overhead(mesh),
        source=f"measured now on {devices} virtual devices sharing {os.cpu_count()} cores",
    )


def describe_profile(profile: HardwareProfile) -> str:
    """One line of the rates a profile holds."""
    flops = ", ".join(f"{dtype} {rate / 1e9:.3g} GFLOP/s" for dtype, rate in profile.peak_flops.items())
    return (f"{profile.name}: {flops}; memory {profile.hbm_bytes_per_second / 1e9:.3g} GB/s; "
            f"links {profile.intra_node.bytes_per_second / 1e9:.3g} GB/s, "
            f"{profile.intra_node.latency_seconds * 1e6:.3g} us; kernel {profile.kernel_overhead_seconds * 1e6:.3g} us"
            f" ({profile.source})")
