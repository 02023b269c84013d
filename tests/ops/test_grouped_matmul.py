"""Every grouped-matmul backend against a dense per-row reference, values and gradients."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.grouped_matmul import (
    GROUPED_MATMUL_BACKENDS,
    default_backend,
    grouped_matmul,
    register_grouped_matmul_backend,
)
from moe_jax.ops.grouped_matmul_backends.tile_plan import plan_tile_schedules
from moe_jax.ops.grouped_matmul_backends.tiled_scan import (
    MAX_TILE_ROWS,
    MIN_TILE_ROWS,
    SMALL_TILE_ROWS,
    default_remainder_rows,
    default_tile_rows,
    tiled_grouped_matmul,
)
from moe_jax.ops.grouped_matmul_backends.tokamax_kernel import tokamax_available

# The package re-exports the function `grouped_matmul`, which hides the module attribute.
gm = importlib.import_module("moe_jax.ops.grouped_matmul")

NUM_ROWS, NUM_EXPERTS, IN_FEATURES, OUT_FEATURES = 37, 5, 8, 6

GROUP_SIZE_CASES = {
    "empty groups and padding rows": [7, 0, 12, 0, 15],
    "all rows in one group": [0, 0, NUM_ROWS, 0, 0],
    "every row used": [10, 5, 0, 20, 2],
    "no rows in any group": [0, 0, 0, 0, 0],
    "single-row groups": [1, 1, 1, 1, 1],
}


def _runnable_backends():
    on_nvidia_gpu = jax.default_backend() == "gpu" and tokamax_available()
    return [name for name in GROUPED_MATMUL_BACKENDS if name != "tokamax" or on_nvidia_gpu]


# Tiles smaller than, not dividing, and larger than M; "tiled" alone uses the default tile.
IMPLEMENTATIONS = {
    **{name: functools.partial(grouped_matmul, backend=name) for name in _runnable_backends()},
    "tiled, 4-row tiles": functools.partial(tiled_grouped_matmul, tile_rows=4),
    "tiled, 16-row tiles": functools.partial(tiled_grouped_matmul, tile_rows=16),
    "tiled, 1-row tiles": functools.partial(tiled_grouped_matmul, tile_rows=1),
    # Two levels: whole 8-row chunks, then each group's last rows in 3-row chunks (and 16 / 4).
    "tiled, 8-row tiles, 3-row remainders": functools.partial(tiled_grouped_matmul, tile_rows=8, remainder_rows=3),
    "tiled, 16-row tiles, 4-row remainders": functools.partial(tiled_grouped_matmul, tile_rows=16,
                                                              remainder_rows=4),
}


def reference_grouped_matmul(x, w, group_sizes):
    """Each row times its own group's weight, gathered densely: [M, O]."""
    num_rows = x.shape[0]
    rows = jnp.arange(num_rows)
    group_end = jnp.cumsum(group_sizes)
    row_group = jnp.minimum(jnp.searchsorted(group_end, rows, side="right"), w.shape[0] - 1)
    in_a_group = rows < group_end[-1]
    out = jnp.einsum("mh,moh->mo", x, w[row_group])
    return jnp.where(in_a_group[:, None], out, 0.0)


@functools.cache
def _compiled_value_and_grads(implementation):
    """jit(x, w, group_sizes, cotangent) -> (out, dx, dw); one compile serves every split."""
    fn = reference_grouped_matmul if implementation == "reference" else IMPLEMENTATIONS[implementation]

    @jax.jit
    def value_and_grads(x, w, group_sizes, cotangent):
        out, vjp = jax.vjp(lambda x, w: fn(x, w, group_sizes), x, w)
        return (out, *vjp(cotangent))

    return value_and_grads


def _operands(seed, num_rows=NUM_ROWS, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_rows, IN_FEATURES)), dtype)
    w = jnp.asarray(rng.standard_normal((NUM_EXPERTS, OUT_FEATURES, IN_FEATURES)), dtype)
    cotangent = jnp.asarray(rng.standard_normal((num_rows, OUT_FEATURES)), dtype)
    return x, w, cotangent


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", GROUP_SIZE_CASES)
def test_backend_matches_reference_values_and_gradients(implementation, case):
    group_sizes = jnp.asarray(GROUP_SIZE_CASES[case], jnp.int32)
    x, w, cotangent = _operands(seed=len(case))
    got = _compiled_value_and_grads(implementation)(x, w, group_sizes, cotangent)
    want = _compiled_value_and_grads("reference")(x, w, group_sizes, cotangent)
    for name, g, r in zip(("out", "dx", "dw"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=name)
    padding = slice(int(group_sizes.sum()), None)
    assert np.all(np.asarray(got[0])[padding] == 0.0)
    assert np.all(np.asarray(got[1])[padding] == 0.0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_random_group_sizes(implementation):
    x, w, cotangent = _operands(seed=7)
    rng = np.random.default_rng(8)
    for _ in range(6):
        used = rng.integers(0, NUM_ROWS + 1)
        cuts = np.sort(rng.integers(0, used + 1, size=NUM_EXPERTS - 1))
        group_sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts, [used]])), jnp.int32)
        got = _compiled_value_and_grads(implementation)(x, w, group_sizes, cotangent)
        want = _compiled_value_and_grads("reference")(x, w, group_sizes, cotangent)
        for g, r in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_mixed_dtypes_promote():
    x, w, _ = _operands(seed=9)
    group_sizes = jnp.asarray([7, 0, 12, 0, 15], jnp.int32)
    for backend in _runnable_backends():
        out = grouped_matmul(x.astype(jnp.bfloat16), w, group_sizes, backend=backend)
        assert out.dtype == jnp.float32
        want = reference_grouped_matmul(x.astype(jnp.bfloat16).astype(jnp.float32), w, group_sizes)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bf16_tiled_gradient_accumulates_weight_grads_in_fp32():
    x, w, cotangent = _operands(seed=10, num_rows=32, dtype=jnp.bfloat16)
    group_sizes = jnp.asarray([32, 0, 0, 0, 0], jnp.int32)
    grad_w = jax.jit(
        jax.grad(lambda w: jnp.vdot(tiled_grouped_matmul(x, w, group_sizes, tile_rows=2), cotangent))
    )(w)
    want = np.einsum("mo,mh->oh", np.asarray(cotangent, np.float32), np.asarray(x, np.float32))
    assert grad_w.dtype == jnp.bfloat16
    # 16 chunks summed in fp32 then rounded once: within one bf16 ulp of the exact sum.
    np.testing.assert_allclose(np.asarray(grad_w[0], np.float32), want, rtol=2**-7, atol=1e-2)


def test_zero_rows():
    x = jnp.zeros((0, IN_FEATURES))
    w = jnp.ones((NUM_EXPERTS, OUT_FEATURES, IN_FEATURES))
    for backend in _runnable_backends():
        out = grouped_matmul(x, w, jnp.zeros((NUM_EXPERTS,), jnp.int32), backend=backend)
        assert out.shape == (0, OUT_FEATURES)


def test_default_tile_rows_follow_average_group_size():
    assert default_tile_rows(4096, 32) == 128
    assert default_tile_rows(4096, 48) == 64  # 85 rows per group rounds down
    assert default_tile_rows(4096, 8) == MAX_TILE_ROWS
    assert default_tile_rows(131072, 128, platform="gpu") == 1024   # Qwen3-30B-A3B's groups on a GPU
    assert default_tile_rows(131072, 128, platform="cpu") == MAX_TILE_ROWS
    assert default_tile_rows(4096, 160) == MIN_TILE_ROWS  # 25 rows per group: not below the floor
    assert default_tile_rows(4096, 1024) == SMALL_TILE_ROWS  # 4 rows per group: decode-sized
    assert default_tile_rows(32, 16) == SMALL_TILE_ROWS  # 8 tokens x top-4 over 16 experts
    assert default_tile_rows(3, 8) == SMALL_TILE_ROWS  # the window then shrinks to the 3 rows


@pytest.mark.parametrize("tile_rows,remainder_rows", [(8, 3), (16, 4), (16, None), (64, 16)])
def test_tile_schedules_cover_every_group_row_once_and_leave_small_remainders_to_small_tiles(tile_rows,
                                                                                              remainder_rows):
    """A group of g rows costs ceil(g / R) * R rows when g mod R >= R / 2, else floor(g / R) * R plus
    ceil((g mod R) / r) * r: whole tiles, then small ones for short remainders."""
    rng = np.random.default_rng(tile_rows)
    for _ in range(5):
        group_sizes = rng.integers(0, 40, size=6)
        num_rows = max(int(group_sizes.sum()) + int(rng.integers(0, 20)), tile_rows)
        covered = np.zeros(num_rows, int)
        computed = 0
        for visits, rows in plan_tile_schedules(jnp.asarray(group_sizes), num_rows, tile_rows, remainder_rows):
            live = np.asarray(visits.live)
            for start, end in zip(np.asarray(visits.chunk_start)[live], np.asarray(visits.chunk_end)[live]):
                covered[start:end] += 1
                assert end - start <= rows
            computed += rows * int(live.sum())
        assert np.all(covered[:group_sizes.sum()] == 1) and np.all(covered[group_sizes.sum():] == 0)

        def cost(g):
            last = g % tile_rows
            if remainder_rows is None or 2 * last >= tile_rows:
                return -(-g // tile_rows) * tile_rows
            return g - last + -(-last // remainder_rows) * remainder_rows

        assert computed == sum(cost(g) for g in group_sizes)


def test_default_remainder_tiles_are_a_quarter_from_64_row_tiles():
    assert default_remainder_rows(256) == 64 and default_remainder_rows(64) == 16
    assert default_remainder_rows(32) is None and default_remainder_rows(SMALL_TILE_ROWS) is None


def test_default_backend_per_platform(monkeypatch):
    assert default_backend("cpu") == "tiled"
    assert default_backend("tpu") == "ragged_dot"
    monkeypatch.setattr(gm, "tokamax_available", lambda: False)
    assert default_backend("gpu") == "tiled"
    monkeypatch.setattr(gm, "tokamax_available", lambda: True)
    monkeypatch.setattr(gm, "nvidia_gpu_present", lambda: False)   # abstract GPU targets compiled from a CPU host
    assert default_backend("gpu") == "tiled"
    monkeypatch.setattr(gm, "nvidia_gpu_present", lambda: True)
    assert default_backend("gpu") == "tokamax"
    with pytest.raises(ValueError, match="'metal'"):
        default_backend("metal")


def test_backend_none_uses_platform_default():
    x, w, _ = _operands(seed=12)
    group_sizes = jnp.asarray([7, 0, 12, 0, 15], jnp.int32)
    chosen = default_backend(jax.default_backend())
    np.testing.assert_array_equal(
        np.asarray(grouped_matmul(x, w, group_sizes)),
        np.asarray(grouped_matmul(x, w, group_sizes, backend=chosen)),
    )


@pytest.mark.parametrize("case", GROUP_SIZE_CASES)
def test_tokamax_wrapper_layout_and_padding_rows(case, monkeypatch):
    """The wrapper's weight transpose and zeroed padding rows, through tokamax's portable (XLA) implementation:
    tokamax picks it off GPU, so this runs wherever tokamax installs (Python >= 3.12, jax >= 0.11.1); the
    Pallas kernels themselves only run on an NVIDIA GPU (scripts/gpu_check.sh)."""
    pytest.importorskip("tokamax")
    tokamax_kernel = importlib.import_module("moe_jax.ops.grouped_matmul_backends.tokamax_kernel")
    monkeypatch.setattr(tokamax_kernel, "nvidia_gpu_present", lambda: True)
    group_sizes = jnp.asarray(GROUP_SIZE_CASES[case], jnp.int32)
    x, w, cotangent = _operands(seed=len(case))

    def value_and_grads(fn):
        out, vjp = jax.vjp(lambda x, w: fn(x, w, group_sizes), x, w)
        return (out, *vjp(cotangent))

    got = value_and_grads(tokamax_kernel.tokamax_grouped_matmul)
    want = value_and_grads(reference_grouped_matmul)
    for name, g, r in zip(("out", "dx", "dw"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=name)
    assert np.all(np.asarray(got[0])[int(group_sizes.sum()):] == 0.0)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error raised off GPU")
def test_tokamax_backend_refuses_to_run_off_gpu():
    x, w, _ = _operands(seed=13)
    with pytest.raises(RuntimeError, match="needs .*tokamax.* NVIDIA GPU"):
        grouped_matmul(x, w, jnp.asarray([7, 0, 12, 0, 15], jnp.int32), backend="tokamax")


def test_errors_name_the_problem():
    x, w, _ = _operands(seed=14)
    group_sizes = jnp.asarray([7, 0, 12, 0, 15], jnp.int32)
    with pytest.raises(ValueError, match="unknown grouped_matmul backend 'megablox'"):
        grouped_matmul(x, w, group_sizes, backend="megablox")
    with pytest.raises(ValueError, match=r"jnp.swapaxes\(w, 1, 2\)"):
        grouped_matmul(x, jnp.swapaxes(w, 1, 2), group_sizes)
    with pytest.raises(ValueError, match=r"group_sizes must be \[E\] = \[5\]"):
        grouped_matmul(x, w, group_sizes[:3])
    with pytest.raises(ValueError, match="group_sizes must be integers"):
        grouped_matmul(x, w, group_sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="already registered"):
        register_grouped_matmul_backend("tiled", tiled_grouped_matmul)


def test_a_registered_backend_is_held_to_the_output_contract(monkeypatch):
    x, w, _ = _operands(seed=15)
    group_sizes = jnp.asarray([7, 0, 12, 0, 15], jnp.int32)
    monkeypatch.setitem(GROUPED_MATMUL_BACKENDS, "transposed", lambda x, w, sizes: (x @ w[0].T).T)
    with pytest.raises(AssertionError, match=r"backend 'transposed' must return \[M, O\]"):
        grouped_matmul(x, w, group_sizes, backend="transposed")
    monkeypatch.setitem(GROUPED_MATMUL_BACKENDS, "half", lambda x, w, sizes: (x @ w[0].T).astype(jnp.bfloat16))
    with pytest.raises(AssertionError, match=r"backend 'half' must return .* in float32"):
        grouped_matmul(x, w, group_sizes, backend="half")
