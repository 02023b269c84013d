"""Per-token log probabilities as the train step computes them: what an RL trainer compares with the sampler's
(the policy ratio of PPO / GRPO), with the sampler's routing replayed (`models.routing_replay`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp


@jax.jit
def next_token_logprobs(logits: jax.Array, input_ids: jax.Array) -> jax.Array:
    """logits: [B, S, V], input_ids: [B, S] -> [B, S - 1] float32, position i's log probability of token i + 1
    (the train step's cross entropy, negated: float32 logits, logsumexp)."""
    logits = logits[:, :-1].astype(jnp.float32)
    picked = jnp.take_along_axis(logits, input_ids[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def sequence_logprobs(model, params: Mapping[str, Any], input_ids, *, routing=None, attention_mask=None,
                      adapter: Mapping[str, Any] | None = None, expert_placement=None,
                      compute_dtype=None) -> jax.Array:
    """input_ids: [B, S] -> [B, S - 1] float32: log p(input_ids[:, i + 1] | input_ids[:, :i + 1]) from the train
    step's forward (`inference=False`, dropless capacity), in the model's layout.

    routing: [B, L, S, K] expert ids to replay (the sampler's `ModelOutput.routing`; -1: the router picks), so the
    experts are those the sampler ran. attention_mask: [B, S] (1: real); padded positions get a value too, which
    the caller masks. adapter / expert_placement / compute_dtype: as `model.apply` takes them (a train step's
    `weights(state.params)` gives (params, adapter); compute_dtype: its activations' dtype under mixed precision).
    """
    output = model.apply(params, input_ids, attention_mask=attention_mask, routing=routing, inference=False,
                         adapter=adapter, expert_placement=expert_placement, compute_dtype=compute_dtype)
    return next_token_logprobs(output.logits, jnp.asarray(input_ids))
