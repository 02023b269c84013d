"""What a train step is built with (`TrainStepOptions`) and the keys its batches may hold."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from .loss import DEFAULT_LOSS_CHUNK
from .objectives import TokenObjective

# segment_ids / positions: packed rows (documents 1, 2, ... per row; `moe_jax.training.corpus`); routing: the
# expert ids a sampler ran, [B, L, S, K], replayed with `routing_replay=True` (`models.routing_replay`).
BATCH_KEYS = ("input_ids", "attention_mask", "labels", "segment_ids", "positions", "routing")


@dataclass(frozen=True)
class TrainStepOptions:
    """grad_accum: micro-batches per step; grad_clip: max global gradient norm (None: no clipping);
    loss_chunk: positions per lm_head call in the loss; compute_dtype: the activations' dtype (None: the
    parameters'; bfloat16 with float32 parameters is mixed precision: each parameter is cast where it is
    used and its gradient accumulated and reduced in float32, `moe_jax.nn.precision`);
    check_overflow: skip a step whose dispatch dropped pairs (off only to measure what the check costs; a
    model without dispatch buffers, capacity None, has nothing to check);
    offload: keep state in host memory between steps: "optimizer" (its state), "parameters", "all" (both; True),
    None / False (neither): `offload_memory_kinds`; pipeline_microbatches: with
    pipeline stages, how many microbatches each micro-batch is cut into (None: the model's);
    router_z_loss_coef, router_bias_update_rate: the balance terms of `moe_jax.training.balance` (0: off);
    mtp_loss_coef: the multi-token-prediction loss's weight (`moe_jax.training.mtp_loss`; 0: off);
    routing_replay: every batch holds "routing" [B, L, S, K], the experts each token runs (R3); objective: the
    per-token loss (`training.objectives`; None: cross entropy), whose `batch_keys` every batch holds too."""

    grad_accum: int = 1
    grad_clip: float | None = None
    loss_chunk: int = DEFAULT_LOSS_CHUNK
    compute_dtype: jnp.dtype | None = None
    check_overflow: bool = True
    offload: bool | str | None = False
    pipeline_microbatches: int | None = None
    router_z_loss_coef: float = 0.0
    router_bias_update_rate: float = 0.0
    mtp_loss_coef: float = 0.0
    routing_replay: bool = False
    objective: TokenObjective | None = None

    def batch_keys(self) -> tuple[str, ...]:
        """The keys a batch may hold: BATCH_KEYS and the objective's."""
        return BATCH_KEYS + (() if self.objective is None else tuple(self.objective.batch_keys))


# `offload` -> where (parameters, optimizer state) live between steps; None: the device.
OFFLOAD_CHOICES = {"all": ("pinned_host", "pinned_host"), "optimizer": (None, "pinned_host"),
                   "parameters": ("pinned_host", None)}


def offload_memory_kinds(offload) -> tuple[str | None, str | None] | None:
    """(parameters', optimizer state's) memory kinds of an `offload` choice; None when nothing is offloaded."""
    if offload is None or offload is False:
        return None
    choice = "all" if offload is True else offload
    if choice not in OFFLOAD_CHOICES:
        raise ValueError(f"offload={offload!r}: choose one of {sorted(OFFLOAD_CHOICES)}, True (all), or None / False "
                         "(nothing offloaded).")
    return OFFLOAD_CHOICES[choice]
