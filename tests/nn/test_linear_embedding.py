"""`linear` and `embed` against `torch.nn.Linear` / `torch.nn.Embedding`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from nn_reference import max_abs_diff, params_of, to_jax

from moe_jax.nn.embedding import embed
from moe_jax.nn.linear import linear


@pytest.mark.reference
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_torch(bias):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(2, 7, 24)
    params = params_of(module)
    assert params["weight"].shape == (40, 24)  # PyTorch layout kept
    assert ("bias" in params) == bias

    diff = max_abs_diff(linear(params, to_jax(x)), module(x))
    print(f"linear bias={bias}: max abs diff {diff:.2e}")
    assert diff <= 1e-5


def test_linear_rejects_transposed_weight():
    params = {"weight": jnp.zeros((24, 40))}
    with pytest.raises(ValueError, match=r"\[out_features, in_features\]"):
        linear(params, jnp.zeros((3, 24)))


def test_linear_keeps_bf16():
    params = {"weight": jnp.ones((8, 4), jnp.bfloat16), "bias": jnp.ones((8,), jnp.bfloat16)}
    y = linear(params, jnp.ones((2, 4), jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), 5.0)


@pytest.mark.reference
def test_a_bf16_projection_split_over_its_input_sums_the_partials_in_fp32():
    """A rowwise-sharded bf16 projection (I split over 8 devices) lands where one device does: the partial
    products meet in fp32 and the sum is rounded once. Each device's partial product is 3 x (85.5 or -85):
    256.5 rounds to 256 in bf16, so summing rounded partials gives 4 where the exact sum is 6 (measured: 4
    with a plain bf16 einsum, XLA:CPU). The gradients are the plain bf16 ones."""
    mesh = jax.make_mesh((8,), ("tp",))
    per_device = 16
    x = jnp.full((2, 4, 8 * per_device), 3.0, jnp.bfloat16)
    row = np.zeros(8 * per_device, np.float32)
    row[::per_device] = [85.5, -85.0] * 4
    weight = jnp.asarray(np.tile(row, (16, 1)), jnp.bfloat16)
    split = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))  # noqa: E731
    project = jax.jit(lambda x, weight: linear({"weight": weight}, x),
                      in_shardings=(split(None, None, "tp"), split(None, "tp")))
    sharded = project(x, weight)
    assert sharded.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(sharded, np.float32), 6.0)
    np.testing.assert_array_equal(np.asarray(linear({"weight": weight}, x), np.float32), 6.0)

    loss = lambda x, weight: jnp.sum(linear({"weight": weight}, x) * jnp.bfloat16(1.5))  # noqa: E731
    plain = lambda x, weight: jnp.sum(jnp.einsum("...i,oi->...o", x, weight) * jnp.bfloat16(1.5))  # noqa: E731
    for ours, theirs in zip(jax.grad(loss, (0, 1))(x, weight), jax.grad(plain, (0, 1))(x, weight)):
        assert ours.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))


def test_embed_matches_torch_and_padding_row_gets_no_gradient():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.Embedding(50, 16, padding_idx=1)
    with torch.no_grad():
        module.weight.normal_()  # torch zeroes the padding row at init; the forward must still read it
    ids = torch.tensor([[3, 1, 1, 7, 49], [0, 2, 1, 5, 5]])
    upstream = torch.randn(2, 5, 16)

    params = params_of(module)
    out = embed(params, to_jax(ids, jnp.int32), padding_idx=1)
    diff = max_abs_diff(out, module(ids))
    print(f"embed: max abs diff {diff:.2e}")
    assert diff == 0.0

    (module(ids) * upstream).sum().backward()
    grad = jax.grad(lambda p: jnp.sum(embed(p, to_jax(ids, jnp.int32), padding_idx=1) * to_jax(upstream)))(
        params
    )
    assert max_abs_diff(grad["weight"], module.weight.grad) <= 1e-6
    assert float(jnp.abs(grad["weight"][1]).max()) == 0.0


def test_embed_out_of_range_ids_are_nan():
    params = {"weight": jnp.ones((10, 4))}
    out = embed(params, jnp.array([0, 9, 10, -1]))
    assert bool(jnp.isfinite(out[:2]).all())
    assert bool(jnp.isnan(out[2:]).all())


def test_embed_rejects_float_ids():
    with pytest.raises(TypeError, match="integers"):
        embed({"weight": jnp.ones((10, 4))}, jnp.array([0.0, 1.0]))
