"""Token objectives: what the train step minimises per predicted token. Cross entropy is the default (the
reference's loss); a policy-gradient objective (`moe_jax.rl.ClippedPolicyObjective`) weighs each sampled token's
log probability by its advantage instead. The step computes every predicted token's log probability chunk by chunk
from the hidden states (`loss.chunked_objective`: the [B, S, V] logits are never held at once) and hands it to the
objective with the batch's per-token inputs; the loss is the mean over the predicted tokens of the global batch.

An objective is any object with
    name: str                              its metric's prefix
    batch_keys: tuple[str, ...]            the float [B, S] arrays it reads from each batch, aligned with the
                                           predictions (position t belongs to the token at t + 1)
    term_names: tuple[str, ...]            per-token quantities it reports (their means are step metrics)
    token_loss(logprobs, extras) -> (loss, terms)
                                           logprobs: [B, C] float32, each predicted token's log probability;
                                           extras: {key: [B, C]} of batch_keys; loss and each term: [B, C]
"""

from __future__ import annotations

from typing import Protocol

import jax


class TokenObjective(Protocol):
    name: str
    batch_keys: tuple[str, ...]
    term_names: tuple[str, ...]

    def token_loss(self, logprobs: jax.Array, extras: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        ...


class CrossEntropy:
    """-log p(token): the causal-LM loss."""

    name = "ce"
    batch_keys: tuple[str, ...] = ()
    term_names: tuple[str, ...] = ()

    def token_loss(self, logprobs: jax.Array, extras: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        return -logprobs, {}


CROSS_ENTROPY = CrossEntropy()
