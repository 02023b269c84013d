"""Muon (momentum orthogonalised by Newton-Schulz) on the decoder layers' weight matrices, AdamW on the rest.

    muon(1e-3, weight_decay=0.1)       # what build_optimizer("muon", ...) and `moe-jax train --optimizer muon` use
    muon_labels(params)                # storage name -> "muon" or "adamw"

Muon takes the decoder layers' projections (attention, dense MLPs, shared experts, the routed experts); AdamW
the embeddings, output heads, norms, routers and gates, biases and every other vector. A routed expert stack
`[E, O, I]` (with a leading layer axis when scanned, `[L, E, O, I]`) is E matrices, not one: each is
orthogonalised on its own, by a Newton-Schulz iteration vmapped over the leading axes. No reshape merges those
axes, so an expert axis sharded over "ep" (or a layer axis) stays sharded and each device orthogonalises only
the experts it holds.

The momentum, its bias correction, Nesterov, the Newton-Schulz iteration (Frobenius pre-scaling, the quintic
coefficients, iterating on the wide orientation) are optax.contrib.muon's. The update scale is the one of
"Muon is Scalable for LLM Training" (Moonlight), `consistent_rms * sqrt(max(O, I))` (optax's `consistent_rms`):
it gives Muon's updates AdamW's RMS, so both parts share one learning rate and weight decay. It does not depend
on which of the two matrix axes is the input, so the [E, I, O] expert layouts (gpt-oss, Llama 4) get the same
scale as [E, O, I]. `consistent_rms=None` is optax's default width scaling `sqrt(max(1, O / I))` instead, which
reads the last two axes as [O, I] (HF's Linear layout); it usually wants a larger learning rate than AdamW's,
so pass `adamw_learning_rate` with it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from ..models.layer_stack import LAYERS_PREFIX, module_path, stack_rows

LearningRate = float | Callable[[int], float]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # optax.contrib.muon's (Keller Jordan's quintic iteration)

# Parameters AdamW takes although they are matrices in the decoder layers, by module path: lookups and output
# heads (MTP layers hold their own), norms, routers and gates (a few rows: per-row scales, not a projection),
# biases. Whatever these miss but is a vector per layer still goes to AdamW by its rank.
ADAMW_NAMES = tuple(re.compile(pattern) for pattern in (
    r"(^|\.)embed_tokens\.",
    r"(^|\.)(lm_head|shared_head)\.",
    r"norm\.",
    r"\.(gate|router|shared_expert_gate)\.weight$",
    r"bias$",
))


def muon_label(name: str, value) -> str:
    """"muon" for a weight matrix of the decoder layers (per layer: rank >= 2, so [O, I] or [E, O, I]),
    "adamw" for everything else."""
    if not name.startswith(LAYERS_PREFIX + ".") or any(p.search(module_path(name)) for p in ADAMW_NAMES):
        return "adamw"
    per_layer_rank = getattr(value, "ndim", 0) - stack_rows(name)   # a scanned run's leading layer axis
    return "muon" if per_layer_rank >= 2 else "adamw"


def muon_labels(params: dict) -> dict[str, str]:
    """Storage name -> "muon" or "adamw" (`muon_label`); an optax.multi_transform label function."""
    return {name: muon_label(name, value) for name, value in params.items()}


def newton_schulz(x: jax.Array, steps: int = 5, coefficients=NS_COEFFICIENTS, eps: float = 1e-8) -> jax.Array:
    """x: [O, I] -> [O, I], about U V^T of x = U S V^T (singular values near 1, not exactly: the quintic
    trades exactness for fewer steps); float32."""
    x = x.astype(jnp.float32)
    transposed = x.shape[0] > x.shape[1]        # iterate on the wide orientation: the smaller Gram matrix
    if transposed:
        x = x.T
    x = x / (jnp.linalg.norm(x) + eps)          # spectral norm <= Frobenius norm <= 1: inside the convergence range
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def orthogonalize(x: jax.Array, steps: int = 5, coefficients=NS_COEFFICIENTS) -> jax.Array:
    """x: [..., O, I] -> [..., O, I] float32, each trailing [O, I] matrix orthogonalised on its own
    (`newton_schulz` vmapped once per leading axis: [E, O, I] experts, [L, E, O, I] scanned experts)."""
    per_matrix = functools.partial(newton_schulz, steps=steps, coefficients=coefficients)
    for _ in range(x.ndim - 2):
        per_matrix = jax.vmap(per_matrix)
    return per_matrix(x)


def shape_scale(shape: tuple[int, ...], consistent_rms: float | None) -> float:
    """The factor on an orthogonalised [..., O, I] update: consistent_rms * sqrt(max(O, I)), or with
    consistent_rms None, sqrt(max(1, O / I))."""
    rows, columns = shape[-2:]
    if consistent_rms is None:
        return max(1.0, rows / columns) ** 0.5
    return consistent_rms * max(rows, columns) ** 0.5


class ScaleByMuonState(NamedTuple):
    count: jax.Array    # int32 []: updates applied
    mu: dict            # the momentum, shaped (and sharded) like the parameters


def scale_by_muon(beta: float = 0.95, nesterov: bool = True, ns_steps: int = 5, ns_coefficients=NS_COEFFICIENTS,
                  consistent_rms: float | None = 0.2) -> optax.GradientTransformation:
    """Muon's direction for parameters of rank >= 2: momentum (optax.contrib.scale_by_muon's, bias-corrected,
    Nesterov), each trailing matrix orthogonalised (`orthogonalize`), scaled by `shape_scale`."""

    def init(params):
        return ScaleByMuonState(count=jnp.zeros([], jnp.int32), mu=optax.tree.zeros_like(params))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                                  optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                                  optax.tree.bias_correction(updates, beta, count))
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        directions = jax.tree.map(
            lambda m, g: (orthogonalize(m, ns_steps, ns_coefficients)
                          * shape_scale(m.shape, consistent_rms)).astype(g.dtype), mu_hat, updates)
        return directions, ScaleByMuonState(count=count, mu=mu)

    return optax.GradientTransformation(init, update)


def muon(learning_rate: LearningRate, weight_decay: float | None = None, *,
         adamw_learning_rate: LearningRate | None = None, beta: float = 0.95, nesterov: bool = True,
         ns_steps: int = 5, ns_coefficients=NS_COEFFICIENTS, consistent_rms: float | None = 0.2
         ) -> optax.GradientTransformation:
    """Muon at `learning_rate` on the parameters `muon_labels` marks, AdamW (PyTorch's defaults, as
    `build_optimizer("adamw")`) at `adamw_learning_rate` (default `learning_rate`) on the others; decoupled
    `weight_decay` (times the learning rate, as torch) on both."""
    decay = 0.0 if weight_decay is None else weight_decay
    return optax.multi_transform({
        "muon": optax.chain(
            scale_by_muon(beta, nesterov, ns_steps, ns_coefficients, consistent_rms),
            optax.add_decayed_weights(decay),
            optax.scale_by_learning_rate(learning_rate),
        ),
        "adamw": optax.adamw(learning_rate if adamw_learning_rate is None else adamw_learning_rate,
                             b1=0.9, b2=0.999, eps=1e-8, weight_decay=decay),
    }, muon_labels)
