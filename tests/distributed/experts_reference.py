"""A plain single-device experts forward (one-hot over local experts) used as the reference in EP tests."""

import jax
import jax.numpy as jnp


def reference_swiglu_experts(tokens, expert_ids, weights, gate_up_proj, down_proj):
    """tokens: [N, H]; expert_ids: [N, K] local (sentinel L = not mine); weights: [N, K];
    gate_up_proj: [L, 2I, H]; down_proj: [L, H, I] -> [N, H]."""
    num_local = gate_up_proj.shape[0]
    one_hot = jax.nn.one_hot(expert_ids, num_local + 1, dtype=weights.dtype)[..., :num_local]  # [N, K, L]
    coefficient = jnp.einsum("nk,nkl->nl", weights, one_hot)
    fused = jnp.einsum("nh,lfh->nlf", tokens, gate_up_proj)
    gate, up = jnp.split(fused, 2, axis=-1)
    expert_out = jnp.einsum("nli,lhi->nlh", jax.nn.silu(gate) * up, down_proj)
    return jnp.einsum("nl,nlh->nh", coefficient, expert_out).astype(tokens.dtype)
