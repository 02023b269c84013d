"""What one traced step hands the family's math besides parameters and inputs (`StepOptions`), and the
remat policies a layer can run under."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ..distributed.activations import ActivationLayouts

# remat policies of the decoder layers: what a layer keeps for the backward pass.
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,                                                  # keep everything (no recompute)
    "full": jax.checkpoint_policies.nothing_saveable,              # keep only the layer input
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs
}


@dataclass(frozen=True)
class StepOptions:
    """What the family's `forward_math` needs besides parameters and inputs, for one traced step.

    run_experts: per sparse layer, `(tokens [N, H], top_k_index, top_k_weights, experts_params) -> (out,
    statistics)`; layouts: activation sharding constraints from the plans; remat: a `REMAT_POLICIES` name.
    """

    run_experts: dict[int, Callable]
    inference: bool
    rng: jax.Array | None
    remat: str
    layouts: ActivationLayouts
    compute_dtype: jnp.dtype | None = None
    cache: Any = None
    segment_ids: jax.Array | None = None   # [B, S] packed rows' document ids (0: padding), or None

    def layer_rng(self, layer) -> jax.Array | None:
        """This layer's key (`fold_in(rng, layer)`; `layer` may be traced inside a scan)."""
        return None if self.rng is None else jax.random.fold_in(self.rng, layer)
