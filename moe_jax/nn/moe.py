"""The sparse MoE block: router -> experts (through whatever runs them) -> output. Math only.

    logits = x @ gate.weight.T                 [N, E]
    weights, index = route(logits)             [N, K], [N, K]   (moe_jax.ops.routing)
    out, statistics = sharded_experts(x, index, weights, experts_params)   (a ShardedExperts call on a mesh,
                                                                        or any callable with its contract)

`sharded_experts` decides nothing here about devices: the model builds it from the resolved plans.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from .linear import Constrain, linear, no_constraint


def sparse_moe_block(
    params: dict,
    hidden_states: jax.Array,
    *,
    route: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
    sharded_experts: Callable,
    constrain: Constrain = no_constraint,
    router: str = "gate",
):
    """hidden_states: [B, S, H]; params: {router: {"weight": [E, H], "bias"?: [E]}, "experts": {...}}
    -> (output [B, S, H], router_logits [B*S, E], dispatch statistics).
    router: the router module's name ("gate"; gpt-oss: "router", with a bias)
    constrain: lays out the router's output by its dims' logical axes (`moe_jax.nn.linear.Constrain`)."""
    batch, sequence, hidden = hidden_states.shape
    tokens = hidden_states.reshape(batch * sequence, hidden)
    router_logits = constrain(linear(params[router], tokens), ("tokens", "experts"))
    top_k_weights, top_k_index = route(router_logits)
    output, statistics = sharded_experts(tokens, top_k_index, top_k_weights, params["experts"])
    return output.astype(hidden_states.dtype).reshape(batch, sequence, hidden), router_logits, statistics


def shared_expert_output(params: dict, hidden_states: jax.Array, mlp: Callable) -> jax.Array:
    """Qwen2-MoE's shared expert: `sigmoid(shared_expert_gate(x)) * shared_expert(x)`; x: [B, S, H]."""
    gate = jax.nn.sigmoid(linear(params["shared_expert_gate"], hidden_states))
    return (gate * mlp(params["shared_expert"], hidden_states)).astype(hidden_states.dtype)
