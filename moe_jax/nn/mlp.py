"""Dense gated MLP (SwiGLU when the activation is SiLU) with Hugging Face parameter names.

Matches `Qwen3MoeMLP`, `Qwen2MoeMLP` (also the Qwen2-MoE shared expert) and `OlmoeMLP`:
`down_proj(act(gate_proj(x)) * up_proj(x))`, all projections without bias.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from .activations import ACTIVATIONS, Activation, get_activation
from .linear import linear

__all__ = ["ACTIVATIONS", "mlp"]


def mlp(params: Mapping[str, Mapping[str, jax.Array]], x: jax.Array, act: str | Activation) -> jax.Array:
    """Gated MLP.

    params: `{"gate_proj": {"weight": [I, H]}, "up_proj": {"weight": [I, H]}, "down_proj": {"weight": [H, I]}}`
    x: [..., H]  ->  [..., H]
    act: an HF `hidden_act` name (see `ACTIVATIONS`) or a callable.
    """
    act_fn = get_activation(act)
    gated = act_fn(linear(params["gate_proj"], x)) * linear(params["up_proj"], x)
    return linear(params["down_proj"], gated)
