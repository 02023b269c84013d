"""Reinforcement learning on the library's own sampler and train step: GRPO's objective
(`ClippedPolicyObjective`, `group_advantages`) and the rollout batch (`rollout_batch`). The sampler is the
continuous-batching engine (`model.generate_batch(..., logprobs=True)`), the trainer `make_train_step(...,
objective=..., routing_replay=True)`; `scripts/rl_grpo.py` is a whole run (docs/training.md, "Reinforcement
learning")."""

from .objective import ClippedPolicyObjective, group_advantages
from .rollout import rollout_batch, routing_mismatch

__all__ = ["ClippedPolicyObjective", "group_advantages", "rollout_batch", "routing_mismatch"]
