"""Grouped matmul through tokamax's Pallas ragged_dot kernels (NVIDIA GPUs).

Shape letters: M rows, H in features, O out features, E experts.

tokamax is an optional package and is not a dependency of moe_jax. Its public
`tokamax.ragged_dot` takes the weight as [E, H, O], so HF's [E, O, H] weight is
transposed once per call. tokamax itself falls back to XLA's ragged_dot (dense
on GPU) for inputs its Pallas kernels do not support.

Not exercised on this project's CPU machines: without a GPU the backend raises.
"""

from __future__ import annotations

import importlib
import importlib.util

import jax
import jax.numpy as jnp


def tokamax_available() -> bool:
    """True when the `tokamax` package can be imported."""
    return importlib.util.find_spec("tokamax") is not None


def nvidia_gpu_present() -> bool:
    """Whether JAX's first device is a real NVIDIA GPU (tokamax's kernels read it)."""
    devices = jax.devices()
    return devices[0].platform == "gpu" and "nvidia" in devices[0].device_kind.lower()


def tokamax_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x: [M, H], w: [E, O, H], group_sizes: [E] int32 -> [M, O]; padding rows are 0."""
    if not tokamax_available():
        raise RuntimeError(
            "grouped_matmul backend 'tokamax' needs the tokamax package on an NVIDIA GPU, and tokamax "
            "is not installed; `pip install tokamax` on a CUDA machine, or use backend='tiled'."
        )
    if not nvidia_gpu_present():
        device = jax.devices()[0]
        raise RuntimeError(
            "grouped_matmul backend 'tokamax' needs tokamax on an NVIDIA GPU, but JAX's first device is "
            f"{device.platform} ({device.device_kind}); use backend='tiled' or backend=None here."
        )
    tokamax = importlib.import_module("tokamax")
    out = tokamax.ragged_dot(x, jnp.swapaxes(w, 1, 2), group_sizes.astype(jnp.int32))
    # The kernels do not promise anything for rows past sum(group_sizes).
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)
    return jnp.where((rows < jnp.sum(group_sizes))[:, None], out, jnp.zeros_like(out))
