"""What a step returns: `ModelOutput` (the pytree `apply` returns) and `DroplessOutput` (what `forward`
returns: dispatched at once, checked for overflow on first read, cut to the caller's batch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from ..distributed.capacity import DispatchStatistics


@dataclass
class ModelOutput:
    """What one step returns (a pytree).

    logits: [B, S, V] (None with `return_hidden=True`); hidden_states: [B, S, H] after the final norm, the
    lm_head's input (None unless `return_hidden=True`); router_logits: per sparse layer [B*S, E]; aux_loss:
    the router load-balancing loss (HF's `load_balancing_loss_func`, unscaled: multiply by
    `router_aux_loss_coef` as HF does with labels; 0 for a family without one, `has_router_aux_loss`);
    statistics: dispatch counts summed over layers and devices; cache: the updated KV cache (None: no cache
    was given); expert_load: [L, E] per sparse layer, the real tokens its router sent to each expert (through
    pipeline stages too: each stage counts its own layers; None without sparse layers); ep_rank_load: [L, ep]
    int32, the real (token, expert) pairs each expert-parallel rank computed in each sparse layer under the
    step's expert placement (None when experts are not dispatched over ep ranks); mtp_logits: [D, B, S, V] of the
    D multi-token-prediction layers (`models.mtp`), row k - 1 at position i predicting token i + k + 1 (None unless
    `return_mtp_logits=True`); mtp_hidden_states: [D, B, S, H] their shared heads' inputs instead (with
    `return_hidden=True` too); routing: [B, L, S, K] int32, the logical expert ids each sparse layer ran for each
    token (None unless `return_routing=True`): what `routing=` replays.
    """

    logits: jax.Array | None
    hidden_states: jax.Array | None
    router_logits: list[jax.Array]
    aux_loss: jax.Array
    statistics: DispatchStatistics
    cache: Any = None
    expert_load: jax.Array | None = None
    ep_rank_load: jax.Array | None = None
    mtp_logits: jax.Array | None = None
    mtp_hidden_states: jax.Array | None = None
    routing: jax.Array | None = None


jax.tree_util.register_dataclass(
    ModelOutput,
    data_fields=["logits", "hidden_states", "router_logits", "aux_loss", "statistics", "cache", "expert_load",
                 "ep_rank_load", "mtp_logits", "mtp_hidden_states", "routing"],
    meta_fields=[],
)


class DroplessOutput:
    """The result of `forward`: dispatched at once, checked for overflow on first read, cut to the batch.

    Read fields as from a `ModelOutput` (`.logits`, `.router_logits`, ...) or get the whole verified
    `ModelOutput` with `.result()`; `.recomputed` counts the reruns its call needed."""

    _FIELDS = ("logits", "hidden_states", "router_logits", "aux_loss", "statistics", "cache", "expert_load",
               "ep_rank_load")

    def __init__(self, model, call: Callable[..., ModelOutput], inference: bool, batch: int):
        # model: the `MoeForCausalLM` whose `forward` made it (its forward capacity tracker moves).
        self._model, self._call, self._inference, self._batch = model, call, inference, batch
        self.capacity = model.forward_capacity[inference].capacity
        self._output = call(capacity=self.capacity)
        self._verified: ModelOutput | None = None
        self.recomputed = 0

    def result(self) -> ModelOutput:
        if self._verified is None:
            self._verified = self._cut_to_batch(self._exact_output())
        return self._verified

    def _exact_output(self) -> ModelOutput:
        model = self._model

        def replay(capacity: float) -> ModelOutput:
            self.recomputed += 1  # counted before a check can raise
            return self._call(capacity=capacity)

        # The tracker's state as it is now (another call may have moved it since this one was dispatched).
        replayed = model.forward_capacity[self._inference].run_exact(replay, dispatched=(self._output, self.capacity))
        self.capacity = replayed.capacity
        return replayed.output

    def _cut_to_batch(self, output: ModelOutput) -> ModelOutput:
        padded = (output.logits if output.logits is not None else output.hidden_states).shape[0]
        if padded == self._batch:
            return output
        batch = self._batch
        router_logits = [r.reshape(padded, -1, r.shape[-1])[:batch].reshape(-1, r.shape[-1])
                         for r in output.router_logits]
        return ModelOutput(
            None if output.logits is None else output.logits[:batch],
            None if output.hidden_states is None else output.hidden_states[:batch],
            router_logits, output.aux_loss, output.statistics, output.cache, output.expert_load,
            output.ep_rank_load,
        )

    def __getattr__(self, name: str):
        if name in DroplessOutput._FIELDS:
            return getattr(self.result(), name)
        raise AttributeError(name)
