"""Grouped matmul through XLA's `ragged_dot_general`.

Shape letters: M rows, H in features, O out features, E experts.

The dimension numbers contract x's H with w's last axis, so HF's [E, O, H]
weight is used as stored: no transposed copy of w is made.

Cost depends on the platform's lowering of ragged_dot (jax 0.10.2):
- XLA:CPU uses jax's generic rule (`_ragged_dot_general_impl`): x is expanded to
  an [E, M, H] masked copy and contracted over experts too, i.e. E times the
  FLOPs of the grouped matmul, slower than a dense dot of the same FLOPs by
  a factor that grows with E (docs/benchmarks.md, "Grouped matmul").
- GPU emits chlo.ragged_dot, which upstream XLA:GPU rewrites into a dense
  matmul (same E-fold waste; not measured here). jax's opt-in flag
  `jax_ragged_dot_use_gpu_pallas_triton_lowering` swaps in a Pallas Triton kernel.
- TPU lowers chlo.ragged_dot to a native grouped-matmul kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_X_ROWS_BY_W_ROWS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),  # contract x[:, H] with w[:, :, H]
    lhs_ragged_dimensions=[0],  # x's rows are split into the groups
    rhs_group_dimensions=[0],  # w's leading axis picks the group's weight
)


def ragged_dot_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x: [M, H], w: [E, O, H], group_sizes: [E] int32 -> [M, O]; padding rows are 0."""
    out = lax.ragged_dot_general(x, w, group_sizes.astype(jnp.int32), _X_ROWS_BY_W_ROWS)
    # ragged_dot leaves rows past sum(group_sizes) at 0 on CPU, but that is not
    # part of its documented contract on every platform, so mask explicitly.
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)
    return jnp.where((rows < jnp.sum(group_sizes))[:, None], out, jnp.zeros_like(out))
