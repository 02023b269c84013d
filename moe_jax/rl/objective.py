"""GRPO's loss as a token objective of the train step (`training.objectives`): the clipped importance-ratio
objective of PPO with group-normalised advantages (Shao et al., DeepSeekMath), an optional KL penalty to a reference
policy, and the per-token quantities an RL run watches.

    objective = ClippedPolicyObjective(clip_eps=0.2)
    step = make_train_step(model, optax.adamw(1e-5), objective=objective, routing_replay=True)
    state, metrics = step(state, rollout.batch)   # metrics["policy_clipped"]: the clip fraction, ...

Each completion token t contributes -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) with r_t = exp(logp_t -
old_logp_t), old_logp the sampler's log probability and A its sequence's advantage; the loss is the mean over the
batch's completion tokens (the train step's token mean: long and short completions weigh each token alike, as
DAPO's token-level loss). With kl_coef, + kl_coef * KL(policy || reference) by the k3 estimator
exp(ref - logp) - (ref - logp) - 1 (Schulman's), reading the reference's log probabilities from the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class ClippedPolicyObjective:
    """clip_eps: the ratio's clip (clip_eps_high: its upper bound's, DAPO's clip-higher; None: clip_eps);
    kl_coef: the KL penalty's weight (0: none, and no "ref_logprobs" in the batch)."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    name: str = "policy"

    def __post_init__(self):
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        if not 0 < self.clip_eps < 1 or not high > 0:
            raise ValueError(f"clip_eps={self.clip_eps} must be in (0, 1) and clip_eps_high={self.clip_eps_high} "
                             "> 0 (the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]).")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef} must be >= 0 (0: no KL penalty).")

    @property
    def batch_keys(self) -> tuple[str, ...]:
        return ("old_logprobs", "advantages") + (("ref_logprobs",) if self.kl_coef else ())

    @property
    def term_names(self) -> tuple[str, ...]:
        return ("clipped", "ratio", "logprob_gap") + (("kl",) if self.kl_coef else ())

    def token_loss(self, logprobs: jax.Array, extras: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        """logprobs: [B, C] the policy's; extras: old_logprobs, advantages (and ref_logprobs) [B, C] -> (loss
        [B, C], terms: clipped (1 where the clipped term is the smaller), ratio, logprob_gap |logp - old_logp|
        (the train step's disagreement with the sampler before any update), kl)."""
        old, advantages = extras["old_logprobs"].astype(jnp.float32), extras["advantages"].astype(jnp.float32)
        ratio = jnp.exp(logprobs - old)
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        unclipped = ratio * advantages
        clipped = jnp.clip(ratio, 1.0 - self.clip_eps, 1.0 + high) * advantages
        loss = -jnp.minimum(unclipped, clipped)
        terms = {"clipped": (clipped < unclipped).astype(jnp.float32), "ratio": ratio,
                 "logprob_gap": jnp.abs(logprobs - old)}
        if self.kl_coef:
            delta = extras["ref_logprobs"].astype(jnp.float32) - logprobs
            terms["kl"] = jnp.exp(delta) - delta - 1.0
            loss = loss + self.kl_coef * terms["kl"]
        return loss, terms


def group_advantages(rewards, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> np.ndarray:
    """rewards: [N] (N = prompts x group_size, each prompt's samples adjacent) -> [N] float32 advantages: each
    reward minus its group's mean, over the group's standard deviation (scale=False: not divided, Dr. GRPO's
    choice). A group whose rewards are all equal gets 0 (it teaches nothing)."""
    rewards = np.asarray(rewards, np.float32)
    if group_size < 1 or rewards.ndim != 1 or rewards.size % group_size:
        raise ValueError(f"rewards of shape {list(rewards.shape)} do not split into groups of {group_size}: give one "
                         "reward per sample, each prompt's group_size samples adjacent.")
    groups = rewards.reshape(-1, group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (groups.std(axis=1, keepdims=True) + eps)
    return centred.reshape(-1)
