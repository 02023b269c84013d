"""Dense gated MLP (SwiGLU when the activation is SiLU) with Hugging Face parameter names.

Matches `Qwen3MoeMLP`, `Qwen2MoeMLP` (also the Qwen2-MoE shared expert) and `OlmoeMLP`:
`down_proj(act(gate_proj(x)) * up_proj(x))`, all projections without bias.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from .activations import ACTIVATIONS, Activation, get_activation
from .linear import Constrain, linear, no_constraint

__all__ = ["ACTIVATIONS", "mlp"]


def mlp(params: Mapping[str, Mapping[str, jax.Array]], x: jax.Array, act: str | Activation,
        constrain: Constrain = no_constraint) -> jax.Array:
    """Gated MLP.

    params: `{"gate_proj": {"weight": [I, H]}, "up_proj": {"weight": [I, H]}, "down_proj": {"weight": [H, I]}}`
    x: [..., H]  ->  [..., H]  ([B, S, H] when constrained)
    act: an HF `hidden_act` name (see `ACTIVATIONS`) or a callable.
    constrain: lays out each projection's output by its dims' logical axes (`moe_jax.nn.linear.Constrain`).
    """
    act_fn = get_activation(act)
    gate = constrain(linear(params["gate_proj"], x), ("batch", "length", "mlp"))
    up = constrain(linear(params["up_proj"], x), ("batch", "length", "mlp"))
    return constrain(linear(params["down_proj"], act_fn(gate) * up), ("batch", "sequence", "embed"))
