"""Grouped matmul (each row block times its own expert weight).

Shape letters: M rows, H in features, O out features, E experts.

Weights use Hugging Face's layout [E, out, in] (`gate_up_proj` is [E, 2I, H],
`down_proj` is [E, H, I]), so every backend computes x @ w[e].T per group.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

from .grouped_matmul_backends.tiled_scan import tiled_grouped_matmul
from .grouped_matmul_backends.tokamax_kernel import nvidia_gpu_present, tokamax_available, tokamax_grouped_matmul
from .grouped_matmul_backends.xla_ragged_dot import ragged_dot_grouped_matmul
from .quantized import is_quantized

GroupedMatmulBackend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]

# Backend name -> fn(x [M, H], w [E, O, H], group_sizes [E] int32) -> [M, O].
GROUPED_MATMUL_BACKENDS: dict[str, GroupedMatmulBackend] = {
    "ragged_dot": ragged_dot_grouped_matmul,
    "tiled": tiled_grouped_matmul,
    "tokamax": tokamax_grouped_matmul,
}
# Backends that take a quantised weight (`ops.quantized`) and dequantise one expert at a time; the others get the
# whole dequantised weight.
QUANTIZED_WEIGHT_BACKENDS = {"tiled"}


# The expert matmuls run under this name scope (`experts_scope`): a compiled program's HLO names them in its
# op_name metadata, which `moe_jax.target_compile` reads to say which kernel runs them.
EXPERTS_SCOPE = "experts_matmul"


def experts_scope(backend: str):
    """The name scope of the expert matmuls run by `backend`."""
    return jax.named_scope(f"{EXPERTS_SCOPE}_{backend}")


def register_grouped_matmul_backend(name: str, fn: GroupedMatmulBackend) -> None:
    """Make `fn` selectable as grouped_matmul(..., backend=name)."""
    if name in GROUPED_MATMUL_BACKENDS:
        raise ValueError(
            f"grouped_matmul backend {name!r} is already registered; pick another name "
            f"(taken: {sorted(GROUPED_MATMUL_BACKENDS)})."
        )
    GROUPED_MATMUL_BACKENDS[name] = fn


def _gpu_default() -> str:
    # Follows FLOP counts, not a GPU measurement (see the comment below). tokamax's kernels pick their code from
    # the GPU JAX runs on: compiling for abstract GPUs from a machine without one (`target_devices`), they refuse
    # the host's CPU, so the tiled loop is the program compiled there.
    return "tokamax" if tokamax_available() and nvidia_gpu_present() else "tiled"


# Platform -> chooser. On CPU (scripts/bench/bench_grouped_matmul.py; docs/benchmarks.md,
# "Grouped matmul") the tiled loop stays within a small factor of a dense matmul of the
# same FLOPs, while ragged_dot costs E times the FLOPs (see xla_ragged_dot.py), so CPU
# uses "tiled". GPU and TPU were not measured: an upstream XLA:GPU
# ragged_dot is a dense matmul over all experts (the same E-fold waste), so GPU
# prefers tokamax's grouped kernels and otherwise the tiled scan, which does only
# the real rows' FLOPs at one kernel launch per tile. TPU keeps ragged_dot, which
# XLA:TPU lowers to a native grouped-matmul kernel.
_DEFAULT_BACKEND_BY_PLATFORM: dict[str, Callable[[], str]] = {
    "cpu": lambda: "tiled",
    "gpu": _gpu_default,
    "tpu": lambda: "ragged_dot",
}


def default_backend(platform: str) -> str:
    """The grouped_matmul backend used on `platform` ("cpu", "gpu" or "tpu") when none is given."""
    try:
        choose = _DEFAULT_BACKEND_BY_PLATFORM[platform]
    except KeyError:
        raise ValueError(
            f"no default grouped_matmul backend for platform {platform!r}; known platforms are "
            f"{sorted(_DEFAULT_BACKEND_BY_PLATFORM)}, or pass backend= one of {sorted(GROUPED_MATMUL_BACKENDS)}."
        ) from None
    return choose()


def backend_name(backend: str | None) -> str:
    """`backend`, checked against the registry, or the default for JAX's default platform when None (a model
    resolves None for the platform of its own devices: `MoeForCausalLM.experts_backend_name`)."""
    name = default_backend(jax.default_backend()) if backend is None else backend
    if name not in GROUPED_MATMUL_BACKENDS:
        raise ValueError(
            f"unknown grouped_matmul backend {name!r}; choose one of {sorted(GROUPED_MATMUL_BACKENDS)} "
            "or None for the platform default."
        )
    return name


def check_grouped_operands(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [M, H], got shape {x.shape}.")
    if w.ndim != 3:
        raise ValueError(f"w must be [E, O, H] (HF's [experts, out, in] layout), got shape {w.shape}.")
    if w.shape[2] != x.shape[1]:
        raise ValueError(
            f"w is {w.shape} = [E, O, H] but x has H={x.shape[1]}; w must be stored [experts, out, in] "
            "as in HF (transpose a [E, in, out] weight with jnp.swapaxes(w, 1, 2))."
        )
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"group_sizes must be [E] = [{w.shape[0]}] (one row count per expert), got shape {group_sizes.shape}."
        )
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be integers, got dtype {group_sizes.dtype}; use .astype(jnp.int32)."
        )


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, backend: str | None = None
) -> jax.Array:
    """Rows of x, sorted by group, each multiplied by its group's weight.

    x: [M, H] rows sorted by group: group e owns the next group_sizes[e] rows
    w: [E, O, H], or a quantised stand-in (`ops.quantized.MXFP4Experts`)
    group_sizes: [E] int32 with sum(group_sizes) <= M
    returns [M, O] in the promoted dtype of x and w:
        out[m] = w[e] @ x[m] for m in group e, and 0 for rows past sum(group_sizes)

    backend: a name in GROUPED_MATMUL_BACKENDS; None picks `default_backend` for
    JAX's default platform.
    """
    check_grouped_operands(x, w, group_sizes)
    name = backend_name(backend)
    fn = GROUPED_MATMUL_BACKENDS[name]
    # Backends get one dtype: ragged_dot rejects mixed operands, and this keeps
    # every backend's result dtype the same.
    dtype = jnp.result_type(x.dtype, w.dtype)
    w = w.astype(dtype)
    if is_quantized(w) and name not in QUANTIZED_WEIGHT_BACKENDS:
        w = w.dequantized()   # this backend takes a dense [E, O, H]: every local expert dequantised at once
    with experts_scope(name):
        out = fn(x.astype(dtype), w, group_sizes.astype(jnp.int32))
    # A registered backend is outside code: hold it to the contract at trace time (free at run time).
    contract = f"grouped_matmul backend {name!r} must return [M, O] = {(x.shape[0], w.shape[1])} in {dtype}"
    chex.assert_shape(out, (x.shape[0], w.shape[1]), custom_message=contract)
    chex.assert_type(out, dtype, custom_message=contract)
    return out
