"""The experts' gate/up -> activation -> down chain over rows sorted by expert, fused where a backend can.

Shape letters: M rows, H hidden, I intermediate, E experts.

A grouped-matmul backend with a fused form of the whole chain registers it in `FUSED_SWIGLU_BACKENDS` (the tiled
scan's: one tile loop forward and one backward instead of two and four, `tiled_swiglu`); every other backend
runs the chain as two `grouped_matmul` calls around the activation. Both give the same values.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .grouped_matmul import backend_name, check_grouped_operands, experts_scope, grouped_matmul
from .grouped_matmul_backends.tiled_swiglu import gated, tiled_swiglu_mlp
from .grouped_matmul_backends.tiled_swiglu_lora import tiled_adapted_swiglu_mlp
from .lora import ExpertAdapterRows, LoraFactors, adapted_grouped_matmul
from .quantized import is_quantized

Activation = Callable[[jax.Array], jax.Array]
# fn(x [M, H], gate_up [E, 2I, H], down [E, H, I], group_sizes [E] int32, *, act) -> [M, H]
FusedSwiGLU = Callable[..., jax.Array]

FUSED_SWIGLU_BACKENDS: dict[str, FusedSwiGLU] = {
    "tiled": tiled_swiglu_mlp,
}
# The same chain with LoRA updates on gate_up and / or down (`moe_jax.ops.lora`), fused the same way:
# fn(x, gate_up, down, group_sizes, lora_gate_up or None, lora_down or None, *, act) -> [M, H]
FUSED_ADAPTED_SWIGLU_BACKENDS: dict[str, Callable[..., jax.Array]] = {
    "tiled": tiled_adapted_swiglu_mlp,
}


def grouped_swiglu(
    x: jax.Array, gate_up: jax.Array, down: jax.Array, group_sizes: jax.Array, *,
    act: Activation = jax.nn.silu, backend: str | None = None, lora: dict[str, LoraFactors] | None = None,
) -> jax.Array:
    """Each row's expert MLP: out[m] = down[e] @ (act(gate[e] @ x[m]) * (up[e] @ x[m])) for m in group e.

    x: [M, H] rows sorted by group
    gate_up: [E, 2I, H] (gate rows first, then up: HF's fused layout)
    down: [E, H, I]
    group_sizes: [E] int32 with sum(group_sizes) <= M
    returns [M, H]; rows past sum(group_sizes) are 0

    backend: a grouped_matmul backend name, None for the platform default.
    lora: LoRA factors of "gate_up_proj" (a [E, r, H], b [E, 2I, r]) and / or "down_proj" (a [E, r, I],
    b [E, H, r]) in this [E, out, in] orientation: their updates join the chain, fused where the backend can.
    """
    check_grouped_operands(x, gate_up, group_sizes)
    num_experts, two_i, hidden = gate_up.shape
    if two_i % 2 or down.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"down must be [E, H, I] = [{num_experts}, {hidden}, {two_i // 2}] to match gate_up {gate_up.shape} "
            f"(an even 2I: gate rows, then up rows), got {down.shape}."
        )
    name = backend_name(backend)
    # Kept-quantised weights run chained: the grouped matmul decodes one expert per visit (the fused loops index
    # dense weights).
    kept = is_quantized(gate_up) or is_quantized(down)
    if lora:
        fused = FUSED_ADAPTED_SWIGLU_BACKENDS.get(name)
        per_row = any(isinstance(factors, ExpertAdapterRows) for factors in lora.values())
        if fused is not None and not kept and not per_row:
            with experts_scope(name):
                return fused(x, gate_up, down, group_sizes.astype(jnp.int32), lora.get("gate_up_proj"),
                             lora.get("down_proj"), act=act)
        gate_up_rows = adapted_grouped_matmul(x, gate_up, group_sizes, lora.get("gate_up_proj"), backend=name)
        return adapted_grouped_matmul(gated(gate_up_rows, act), down, group_sizes, lora.get("down_proj"),
                                      backend=name)
    fused = FUSED_SWIGLU_BACKENDS.get(name)
    if fused is not None and not kept:
        with experts_scope(name):
            return fused(x, gate_up, down, group_sizes.astype(jnp.int32), act=act)
    gate_up_rows = grouped_matmul(x, gate_up, group_sizes, backend=name)
    return grouped_matmul(gated(gate_up_rows, act), down, group_sizes, backend=name)
