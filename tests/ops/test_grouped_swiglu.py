"""The experts' gate/up -> activation -> down chain: the tiled scan's fused loop against the chained grouped
matmuls (values and gradients, every split of rows, dtypes), and the dispatch between them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.grouped_matmul_backends.tiled_scan import tiled_grouped_matmul
from moe_jax.ops.grouped_matmul_backends.tiled_swiglu import gated, tiled_swiglu_mlp
from moe_jax.ops.grouped_swiglu import FUSED_SWIGLU_BACKENDS, grouped_swiglu

from .test_grouped_matmul import GROUP_SIZE_CASES, NUM_EXPERTS, NUM_ROWS  # the same row splits

HIDDEN, INTERMEDIATE = 8, 6

# Tiles smaller than, not dividing, and larger than M, one and two levels.
TILINGS = {
    "default tiles": {},
    "4-row tiles": {"tile_rows": 4},
    "1-row tiles": {"tile_rows": 1},
    "64-row tiles": {"tile_rows": 64},
    "8-row tiles, 3-row remainders": {"tile_rows": 8, "remainder_rows": 3},
}


def chained(x, gate_up, down, group_sizes, act=jax.nn.silu, **tiling):
    """The chain as two tiled grouped matmuls around the activation (what the fused loop replaces)."""
    matmul = functools.partial(tiled_grouped_matmul, **tiling)
    return matmul(gated(matmul(x, gate_up, group_sizes), act), down, group_sizes)


def reference(x, gate_up, down, group_sizes, act=jax.nn.silu):
    """Each row through its own expert's MLP, gathered densely; rows in no group are 0."""
    rows = jnp.arange(x.shape[0])
    group_end = jnp.cumsum(group_sizes)
    expert = jnp.minimum(jnp.searchsorted(group_end, rows, side="right"), gate_up.shape[0] - 1)
    h = jnp.einsum("mh,moh->mo", x, gate_up[expert])
    out = jnp.einsum("mi,mhi->mh", gated(h, act), down[expert])
    return jnp.where((rows < group_end[-1])[:, None], out, 0.0)


def _operands(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((NUM_ROWS, HIDDEN)), dtype)
    gate_up = jnp.asarray(rng.standard_normal((NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN)) * 0.5, dtype)
    down = jnp.asarray(rng.standard_normal((NUM_EXPERTS, HIDDEN, INTERMEDIATE)) * 0.5, dtype)
    cotangent = jnp.asarray(rng.standard_normal((NUM_ROWS, HIDDEN)), dtype)
    return x, gate_up, down, cotangent


def _value_and_grads(fn, x, gate_up, down, group_sizes, cotangent):
    out, vjp = jax.vjp(lambda x, gate_up, down: fn(x, gate_up, down, group_sizes), x, gate_up, down)
    return (out, *vjp(cotangent))


@functools.cache
def _compiled(tiling: str | None, fn):
    """One jitted value-and-gradients per tiling and function: group sizes are traced, so every case of a tiling
    runs the same programs (compiled once for the grid, not once per case)."""
    tiled = fn if tiling is None else functools.partial(fn, **TILINGS[tiling])
    return jax.jit(functools.partial(_value_and_grads, tiled))


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("case", GROUP_SIZE_CASES)
def test_fused_loop_matches_the_reference_and_the_chained_loops(tiling, case):
    group_sizes = jnp.asarray(GROUP_SIZE_CASES[case], jnp.int32)
    x, gate_up, down, cotangent = _operands(seed=len(case))
    got = _compiled(tiling, tiled_swiglu_mlp)(x, gate_up, down, group_sizes, cotangent)
    want = _compiled(None, reference)(x, gate_up, down, group_sizes, cotangent)
    chain = _compiled(tiling, chained)(x, gate_up, down, group_sizes, cotangent)
    for name, g, r, c in zip(("out", "dx", "dgate_up", "ddown"), got, want, chain, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=name)
        # Same windows, same dots, same order: the chained loops' values exactly.
        np.testing.assert_array_equal(np.asarray(g), np.asarray(c), err_msg=name)
    padding = slice(int(group_sizes.sum()), None)
    assert np.all(np.asarray(got[0])[padding] == 0.0)
    assert np.all(np.asarray(got[1])[padding] == 0.0)


def test_random_group_sizes_under_one_compilation():
    x, gate_up, down, cotangent = _operands(seed=7)
    fused = jax.jit(functools.partial(_value_and_grads, tiled_swiglu_mlp))
    want = jax.jit(functools.partial(_value_and_grads, reference))
    rng = np.random.default_rng(8)
    for _ in range(6):
        used = rng.integers(0, NUM_ROWS + 1)
        cuts = np.sort(rng.integers(0, used + 1, size=NUM_EXPERTS - 1))
        group_sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts, [used]])), jnp.int32)
        for g, r in zip(fused(x, gate_up, down, group_sizes, cotangent),
                        want(x, gate_up, down, group_sizes, cotangent), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_custom_activation():
    x, gate_up, down, cotangent = _operands(seed=3)
    group_sizes = jnp.asarray([7, 0, 12, 0, 15], jnp.int32)
    fused = functools.partial(tiled_swiglu_mlp, act=jax.nn.gelu, tile_rows=4)
    dense = functools.partial(reference, act=jax.nn.gelu)
    for g, r in zip(_value_and_grads(fused, x, gate_up, down, group_sizes, cotangent),
                    _value_and_grads(dense, x, gate_up, down, group_sizes, cotangent), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtypes", [("bfloat16",) * 3, ("bfloat16", "bfloat16", "float32"),
                                    ("float32", "bfloat16", "bfloat16")])
def test_dtypes_follow_the_chained_grouped_matmuls(dtypes):
    """h and the activation in result_type(x, gate_up), the down projection in result_type(that, down);
    gradients in their operands' dtypes, equal to the chain's."""
    x, gate_up, down, cotangent = _operands(seed=11)
    x, gate_up, down = (array.astype(dtype) for array, dtype in zip((x, gate_up, down), dtypes, strict=True))
    group_sizes = jnp.asarray([10, 5, 0, 20, 2], jnp.int32)
    fused = functools.partial(tiled_swiglu_mlp, tile_rows=8, remainder_rows=3)
    chain = functools.partial(chained, tile_rows=8, remainder_rows=3)
    cotangent = cotangent.astype(jnp.result_type(*dtypes))
    got = jax.jit(functools.partial(_value_and_grads, fused))(x, gate_up, down, group_sizes, cotangent)
    want = jax.jit(functools.partial(_value_and_grads, chain))(x, gate_up, down, group_sizes, cotangent)
    for name, g, c in zip(("out", "dx", "dgate_up", "ddown"), got, want, strict=True):
        assert g.dtype == c.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(c, np.float32), rtol=1e-2, atol=1e-2,
                                   err_msg=name)
    assert got[0].dtype == jnp.result_type(*dtypes)
    assert [g.dtype for g in got[1:]] == [x.dtype, gate_up.dtype, down.dtype]


def test_grouped_swiglu_fuses_for_the_tiled_backend_and_chains_for_the_others(monkeypatch):
    x, gate_up, down, _ = _operands(seed=5)
    group_sizes = jnp.asarray([7, 0, 12, 0, 15], jnp.int32)
    want = reference(x, gate_up, down, group_sizes)
    calls = []
    fused = FUSED_SWIGLU_BACKENDS["tiled"]
    monkeypatch.setitem(FUSED_SWIGLU_BACKENDS, "tiled", lambda *a, **k: calls.append("fused") or fused(*a, **k))
    for backend in ("tiled", "ragged_dot"):
        np.testing.assert_allclose(np.asarray(grouped_swiglu(x, gate_up, down, group_sizes, backend=backend)),
                                   np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=backend)
    assert calls == ["fused"]   # ragged_dot has no fused form: two grouped matmuls


def test_grouped_swiglu_errors_name_the_shapes_and_the_backends():
    x, gate_up, down, _ = _operands(seed=6)
    group_sizes = jnp.asarray([7, 0, 12, 0, 15], jnp.int32)
    with pytest.raises(ValueError, match=r"down must be \[E, H, I\] = \[5, 8, 6\].*got \(5, 6, 8\)"):
        grouped_swiglu(x, gate_up, jnp.swapaxes(down, 1, 2), group_sizes)
    with pytest.raises(ValueError, match="unknown grouped_matmul backend 'fast'; choose one of"):
        grouped_swiglu(x, gate_up, down, group_sizes, backend="fast")


def test_the_forward_loop_enters_only_experts_with_rows():
    """Experts without rows are left out of the loop (each one entered copies its weights out of the stacks):
    the ones with visits come first, in expert order, and the loop runs that many."""
    from moe_jax.ops.grouped_matmul_backends.tile_plan import plan_tile_schedules
    from moe_jax.ops.grouped_matmul_backends.tiled_swiglu import _by_expert, _experts_with_visits

    group_sizes = jnp.asarray([0, 3, 0, 0, 9, 1], jnp.int32)
    runs = _by_expert(plan_tile_schedules(group_sizes, 16, 8, 2), 6)
    order, entered = _experts_with_visits(runs, 6)
    assert int(entered) == 3
    assert order.tolist() == [1, 4, 5, 0, 2, 3]
