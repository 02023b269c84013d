"""What one traced step hands the family's math besides parameters and inputs (`StepOptions`), and the
remat policies a layer can run under."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
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

    sharded_experts: per sparse layer, its experts module (`distributed.experts.ShardedExperts`); capacity: the
    dispatch capacity they run at (None: the largest, or no dispatch buffers); layouts: activation sharding
    constraints from the plans; remat: a `REMAT_POLICIES` name.
    """

    sharded_experts: Mapping[int, Callable]
    capacity: float | None
    inference: bool
    rng: jax.Array | None
    remat: str
    layouts: ActivationLayouts
    compute_dtype: jnp.dtype | None = None
    cache: Any = None
    segment_ids: jax.Array | None = None   # [B, S] packed rows' document ids (0: padding), or None
    # The caller gave no attention mask (nor packed rows): every key is real, so attention over the whole sequence
    # needs only the causal mask, which fused kernels (cuDNN's on a GPU) take without reading a padding mask.
    unpadded: bool = False
    # `nn.attention_core.attend`'s implementation for the model's devices (`attention_for_device`: "fused" on
    # GPUs, "blocked" on CPUs), so a program compiled for target GPUs on a CPU host is the one a GPU runs.
    attention: str | None = None
    # Routing replay: [num_hidden_layers, B, S, K] expert ids each layer runs (rows of -1 and dense layers' rows:
    # the router's own choice), or None; record_routing: each sparse layer's statistics carry the ids it ran.
    routing: jax.Array | None = None
    record_routing: bool = False
    # Context parallelism: the sequence runs split over cp in the context order, and attention over a whole
    # sequence goes through `nn.context_attention.ContextAttention` (None: one device holds each sequence).
    context: Any = None

    @property
    def attention_core(self) -> Callable | None:
        """The context-parallel attention core over a whole sequence (`attention_core.attend`'s arguments), or
        None: the layer's own `attend`."""
        return None if self.context is None else self.context.attend

    def layer_experts(self, layer: int) -> Callable:
        """Layer `layer`'s experts module bound to this step's mode and capacity:
        `(tokens [N, H], top_k_index [N, K], top_k_weights [N, K], experts_params) -> (out [N, H], statistics)`."""
        return partial(self.sharded_experts[layer], inference=self.inference, capacity=self.capacity)

    def layer_rng(self, layer) -> jax.Array | None:
        """This layer's key (`fold_in(rng, layer)`; `layer` may be traced inside a scan)."""
        return None if self.rng is None else jax.random.fold_in(self.rng, layer)
