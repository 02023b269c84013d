"""Kept-quantised expert weights (`ops.quantized`): decoded in the step exactly as the loader decodes them, and
the grouped matmul over them equal to the one over the decoded weights, one expert decoded per visit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from converters.mxfp4 import dequantize_mxfp4 as loader_dequantize
from moe_jax.ops.grouped_matmul import grouped_matmul
from moe_jax.ops.quantized import MXFP4Experts, dequantize_mxfp4

EXPERTS, ROWS, COLUMNS, TOKENS = 4, 48, 64, 40


def random_experts(seed: int = 0) -> MXFP4Experts:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (EXPERTS, ROWS, COLUMNS // 32, 16), dtype=np.uint8)
    scales = rng.integers(118, 132, (EXPERTS, ROWS, COLUMNS // 32), dtype=np.uint8)
    return MXFP4Experts.checked(jnp.asarray(blocks), jnp.asarray(scales))


def test_decoding_in_the_step_equals_the_loaders():
    weight = random_experts()
    np.testing.assert_array_equal(np.asarray(weight.dequantized()),
                                  loader_dequantize(np.asarray(weight.blocks), np.asarray(weight.scales)))
    # bfloat16 holds every MXFP4 value exactly.
    np.testing.assert_array_equal(np.asarray(dequantize_mxfp4(weight.blocks, weight.scales, jnp.bfloat16),
                                             np.float32), np.asarray(weight.dequantized()))


@pytest.mark.parametrize("backend", ["tiled", "ragged_dot"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_over_kept_weights_equals_the_decoded_ones(backend, dtype):
    weight = random_experts()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(TOKENS, COLUMNS)), dtype)
    group_sizes = jnp.asarray([10, 0, 20, 7], jnp.int32)
    # The stand-in decodes to the compute dtype it is given (the experts pass the activations').
    kept = jax.jit(lambda x, w: grouped_matmul(x, w, group_sizes, backend=backend))(x, weight.astype(dtype))
    decoded = grouped_matmul(x, weight.dequantized().astype(dtype), group_sizes, backend=backend)
    assert kept.dtype == dtype
    np.testing.assert_array_equal(np.asarray(kept, np.float32), np.asarray(decoded, np.float32))


def test_the_tiled_loop_decodes_one_expert_per_visit():
    """No [E, O, H] decoded weight appears in the program: only [O, H] ones."""
    weight = random_experts()
    x = jnp.zeros((TOKENS, COLUMNS), jnp.float32)
    group_sizes = jnp.asarray([10, 10, 10, 10], jnp.int32)
    text = jax.jit(lambda x, w: grouped_matmul(x, w, group_sizes, backend="tiled")).lower(x, weight).as_text()
    assert f"tensor<{ROWS}x{COLUMNS}xf32>" in text
    assert f"tensor<{EXPERTS}x{ROWS}x{COLUMNS}xf32>" not in text


def test_gradients_reach_the_rows_not_the_frozen_codes():
    weight = random_experts()
    x = jnp.asarray(np.random.default_rng(2).normal(size=(TOKENS, COLUMNS)), jnp.float32)
    group_sizes = jnp.asarray([10, 5, 20, 5], jnp.int32)
    loss = lambda x, w: jnp.sum(grouped_matmul(x, w, group_sizes, backend="tiled") ** 2)  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(x, weight)),
                               np.asarray(jax.grad(loss)(x, weight.dequantized())), rtol=1e-6, atol=1e-5)


def test_wrong_blocks_and_scales_are_refused_by_shape_and_dtype():
    weight = random_experts()
    with pytest.raises(ValueError, match="uint8 blocks \\[E, O, G, 16\\]"):
        MXFP4Experts.checked(weight.blocks[..., :8], weight.scales)
    with pytest.raises(ValueError, match="got float32"):
        MXFP4Experts.checked(weight.blocks.astype(jnp.float32), weight.scales)
