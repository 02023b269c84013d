"""A slow, obviously correct experts forward for tests: every expert densely over every token."""

import jax
import jax.numpy as jnp

from moe_jax.ops.experts import Activation, _check_experts_operands


def swiglu_experts_reference(
    hidden: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    act: Activation = jax.nn.silu,
) -> jax.Array:
    """Same contract as `swiglu_experts`, one expert at a time over all tokens.

    hidden: [N, H]; expert_ids: [N, K]; weights: [N, K]
    gate_up_proj: [E, 2I, H]; down_proj: [E, H, I]
    returns [N, H] in hidden's dtype

    Every expert runs densely on every token and is scaled by the summed routing
    weight of the choices that picked it (0 for the rest), which is E times the
    work of the real thing: meant for tests, not models.
    """
    _check_experts_operands(hidden, expert_ids, weights, gate_up_proj, down_proj)
    num_experts, two_i, _ = gate_up_proj.shape
    intermediate = two_i // 2
    accumulate_dtype = jnp.result_type(hidden.dtype, weights.dtype, gate_up_proj.dtype, down_proj.dtype)
    out = jnp.zeros(hidden.shape, accumulate_dtype)
    for expert in range(num_experts):
        picked = expert_ids == expert  # [N, K]
        token_weight = jnp.sum(jnp.where(picked, weights, jnp.zeros_like(weights)), axis=1)  # [N]
        gate = hidden @ gate_up_proj[expert, :intermediate].T  # [N, I]
        up = hidden @ gate_up_proj[expert, intermediate:].T  # [N, I]
        expert_out = (act(gate) * up) @ down_proj[expert].T  # [N, H]
        out = out + token_weight[:, None].astype(accumulate_dtype) * expert_out.astype(accumulate_dtype)
    return out.astype(hidden.dtype)
