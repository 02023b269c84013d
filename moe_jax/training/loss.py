"""Causal-LM loss as the reference computes it, from hidden states in chunks.

HF's `ForCausalLMLoss`: labels are padded with -100 on the right and shifted left by one (position t
predicts labels[t + 1]), logits are upcast to float32, cross entropy ignores -100, and the loss is the
mean over the predicted tokens. MoE models add `router_aux_loss_coef * aux_loss` when the config has
`output_router_logits=True` (and labels are given). Here the cross entropy is a *sum* and a *count* per
call, so the mean can be taken over the global batch of several micro-batches; the `[B, S, V]` logits are
never held at once: `lm_head` runs on `chunk` positions at a time inside a rematerialised scan.

`model_loss` is that loss of one batch under a model's step: the train step (`step.py`) and the NNX
face's `loss` (`moe_jax.nnx`) both call it, so it lives here with the pieces it joins, not in either.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from ..models.mtp import mtp_head_logits, mtp_layer_indices
from ..ops.routing import router_z_loss
from .objectives import CROSS_ENTROPY, TokenObjective

IGNORE_INDEX = -100
# Positions per lm_head call in the loss: the [B, chunk, V] logits are the largest loss buffer.
DEFAULT_LOSS_CHUNK = 512
# A chunk's float32 logits up to this size are kept for the backward pass; larger ones are recomputed there
# (an extra lm_head matmul per chunk: 3% of bench_vs_reference's default train step, whose logits are 16 MiB).
KEPT_LOGITS_BYTES = 64 * 2**20


def default_labels(input_ids: jax.Array, attention_mask: jax.Array | None) -> jax.Array:
    """input_ids, attention_mask: [B, S] -> labels [B, S]: the inputs, -100 where the mask is 0 (padding),
    as a causal-LM data collator makes them."""
    if attention_mask is None:
        return input_ids
    return jnp.where(attention_mask > 0, input_ids, IGNORE_INDEX)


def shift_labels(labels: jax.Array) -> jax.Array:
    """labels: [B, S] -> targets [B, S]: targets[:, t] = labels[:, t + 1], the last position -100."""
    pad = jnp.full((labels.shape[0], 1), IGNORE_INDEX, labels.dtype)
    return jnp.concatenate([labels[:, 1:], pad], axis=1)


def prediction_targets(input_ids: jax.Array, attention_mask: jax.Array | None = None,
                       labels: jax.Array | None = None) -> jax.Array:
    """[B, S] -> the token each position predicts, -100 where nothing is counted: the shifted labels
    (default: the inputs, -100 at padding), and nothing predicted *from* a padding position. attention_mask may
    hold packed rows' document ids (segment ids): the last token of a document predicts nothing.

    The last rule matters only for left padding: the reference counts the prediction of the first real
    token from the last padding position, whose hidden state comes from a fully masked attention row
    (its value depends on the attention kernel); we do not (docs/design.md, "Training")."""
    targets = shift_labels(default_labels(input_ids, attention_mask) if labels is None else labels)
    if attention_mask is None:
        return targets
    # Packed rows (`attention_mask` holding document ids): nothing is predicted across a document's end. With a
    # 0/1 mask this changes nothing: the position before padding already predicts -100.
    following = jnp.concatenate([attention_mask[:, 1:], attention_mask[:, -1:]], axis=1)
    return jnp.where((attention_mask > 0) & (following == attention_mask), targets, IGNORE_INDEX)


def predicted_tokens(targets: jax.Array) -> jax.Array:
    """targets: [B, S] (`prediction_targets`) -> how many positions are counted (float32, at least 1: the
    denominator of the mean loss)."""
    return jnp.maximum(jnp.sum(targets != IGNORE_INDEX), 1).astype(jnp.float32)


def chunked_cross_entropy(hidden: jax.Array, targets: jax.Array, logits_fn: Callable[[jax.Array], jax.Array],
                          chunk: int) -> tuple[jax.Array, jax.Array]:
    """Summed token cross entropy and the number of counted tokens.

    hidden: [B, S, H] (the lm_head's input); targets: [B, S] ints, -100 = not counted; logits_fn: [B, C, H]
    -> [B, C, V]. Runs over ceil(S / chunk) chunks of positions; the backward pass recomputes each chunk's
    logits instead of keeping them when they exceed KEPT_LOGITS_BYTES in float32. Returns (sum, count), float32
    and int32 scalars.
    """
    total, count, _ = chunked_objective(hidden, targets, logits_fn, chunk, CROSS_ENTROPY, {})
    return total, count


def chunked_objective(hidden: jax.Array, targets: jax.Array, logits_fn: Callable[[jax.Array], jax.Array],
                      chunk: int, objective: TokenObjective, extras: dict[str, jax.Array]
                      ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """`objective`'s summed per-token loss over the counted tokens, their count, and its terms' sums.

    hidden: [B, S, H]; targets: [B, S] ints, -100 = not counted; logits_fn: [B, C, H] -> [B, C, V]; extras:
    {key: [B, S]} the objective's batch inputs, aligned with the targets. Runs over ceil(S / chunk) chunks of
    positions (`chunked_cross_entropy`'s memory rule). Returns (sum float32, count int32, {term: sum float32}).
    """
    if chunk < 1:
        raise ValueError(f"loss chunk={chunk} must be >= 1 (positions per lm_head call).")
    batch, sequence, width = hidden.shape
    chunk = min(chunk, sequence)
    padding = -sequence % chunk
    if padding:
        hidden = jnp.pad(hidden, ((0, 0), (0, padding), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, padding)), constant_values=IGNORE_INDEX)
        extras = {key: jnp.pad(value, ((0, 0), (0, padding))) for key, value in extras.items()}
    chunks = (sequence + padding) // chunk

    def by_chunk(array):   # [B, S, ...] -> [N, B, C, ...]
        return array.reshape(batch, chunks, chunk, *array.shape[2:]).swapaxes(0, 1)

    def chunk_loss(hidden_chunk, target_chunk, extra_chunks):
        logits = logits_fn(hidden_chunk).astype(jnp.float32)               # [B, C, V]
        counted = target_chunk != IGNORE_INDEX
        safe = jnp.where(counted, target_chunk, 0)
        picked = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
        losses, terms = objective.token_loss(picked - jax.nn.logsumexp(logits, axis=-1), extra_chunks)
        sums = {name: jnp.sum(jnp.where(counted, value, 0.0)) for name, value in terms.items()}
        return jnp.sum(jnp.where(counted, losses, 0.0)), jnp.sum(counted, dtype=jnp.int32), sums

    logits_shape = jax.eval_shape(logits_fn, by_chunk(hidden)[0])
    if batch * chunk * logits_shape.shape[-1] * 4 > KEPT_LOGITS_BYTES:
        chunk_loss = jax.checkpoint(chunk_loss)

    def body(carry, xs):
        total, count, sums = carry
        chunk_sum, chunk_count, chunk_sums = chunk_loss(*xs)
        return (total + chunk_sum, count + chunk_count, jax.tree.map(jnp.add, sums, chunk_sums)), None

    zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
            {name: jnp.zeros((), jnp.float32) for name in objective.term_names})
    (total, count, sums), _ = jax.lax.scan(
        body, zero, (by_chunk(hidden), by_chunk(targets), {key: by_chunk(value) for key, value in extras.items()}))
    return total, count, sums


def mtp_cross_entropy(model, nested: dict, mtp_hidden: jax.Array, mtp_targets: jax.Array, chunk: int) -> jax.Array:
    """nested: the model's nested weights; mtp_hidden: [D, B, S, H] the MTP layers' shared heads' inputs
    (`ModelOutput.mtp_hidden_states`); mtp_targets: [B, D, S] -> [D] each depth's summed cross entropy."""
    sums = []
    for depth, layer in enumerate(mtp_layer_indices(model.config, model.mtp_layers)):
        head = partial(mtp_head_logits, nested["model"]["layers"][str(layer)])
        sums.append(chunked_cross_entropy(mtp_hidden[depth], mtp_targets[:, depth], head, chunk)[0])
    return jnp.stack(sums)


def adds_aux_loss(config) -> bool:
    """Whether the reference adds the router loss to the LM loss: `output_router_logits` in the config."""
    return bool(getattr(config, "output_router_logits", False))


def aux_loss_coefficient(config) -> float:
    return float(getattr(config, "router_aux_loss_coef", 0.0)) if adds_aux_loss(config) else 0.0


def model_loss(model, params, input_ids, attention_mask, targets, *, total_tokens, aux_weight: float,
               capacity: float | None, rng=None, compute_dtype=None, inference: bool = False,
               loss_chunk: int = DEFAULT_LOSS_CHUNK, step: Callable | None = None, segment_ids=None,
               positions=None, adapter=None, z_weight: float = 0.0, expert_placement=None, mtp_targets=None,
               mtp_weights=None, routing=None, objective: TokenObjective | None = None,
               extras: dict | None = None) -> tuple[jax.Array, dict]:
    """One batch's share of the training loss: (ce_sum / total_tokens + aux_weight * aux_loss [+ z_weight *
    router_z_loss], terms).

    input_ids, attention_mask, targets: [B, S] (`prediction_targets`); total_tokens: the predicted tokens of
    the whole global batch (the denominator of the mean). terms: ce_sum, aux (the unscaled router loss),
    statistics (the call's `DispatchStatistics`), expert_load ([L, E] real tokens per expert per sparse layer, or
    None: `ModelOutput.expert_load`), ep_rank_load ([L, ep] or None: `ModelOutput.ep_rank_load`) and, with `z_weight` (a Python float; 0 leaves the program as without it),
    z (ST-MoE's router z-loss over the real tokens, `ops.routing.router_z_loss`). The train step and the NNX face (`moe_jax.nnx`) share it,
    so both give the same loss for the same parameters and data. step: the model's step to run, by default
    `model.step_math`, traced into the caller's jit (which checked the inputs with `model.check_step`);
    `model.apply` for an eager call. segment_ids, positions: packed rows (the targets come from the caller's
    `prediction_targets(input_ids, segment_ids)`). adapter: a LoRA adapter's arrays, applied beside params.
    expert_placement: with redundant expert slots, the placement to run (None: the identity). mtp_targets: [B, D, S]
    each multi-token-prediction depth's targets and mtp_weights: [D] their sums' weights (`training.mtp_loss`):
    adds sum_k weights[k] * mtp_sums[k] to the loss, mtp_sums ([D] summed cross entropies) to the terms.
    routing: [B, L, S, K] expert ids to replay (`models.routing_replay`), or None. objective: the per-token loss
    (`training.objectives`; None: cross entropy), reading `extras` ({key: [B, S]}, aligned with the targets);
    ce_sum is then its summed loss and terms["objective_sums"] its terms' sums."""
    step = model.step_math if step is None else step
    packed = {} if segment_ids is None else {"segment_ids": segment_ids}
    # Context parallelism: the targets follow the hidden states into the context order (no reordering of [B, S, H]);
    # `apply` (an eager call) returns the natural order.
    context = getattr(model.core, "context", None) if step != model.apply else None
    if context is not None:
        packed["context_order"] = True
        targets = context.to_context_order(targets)
        extras = None if extras is None else {key: context.to_context_order(value) for key, value in extras.items()}
    adapted = ({} if adapter is None else {"adapter": adapter}) | (
        {} if expert_placement is None else {"expert_placement": expert_placement}) | (
        {} if mtp_targets is None else {"return_mtp_logits": True}) | (
        {} if routing is None else {"routing": routing})
    output = step(params, input_ids, attention_mask=attention_mask, capacity=capacity, rng=rng,
                  inference=inference, return_hidden=True, compute_dtype=compute_dtype, positions=positions,
                  **packed, **adapted)
    nested = model.nested_weights(params, adapter)
    head = partial(model.head_logits, nested)
    if objective is None:
        ce_sum, _ = chunked_cross_entropy(output.hidden_states, targets, head, loss_chunk)
        objective_sums = {}
    else:
        ce_sum, _, objective_sums = chunked_objective(output.hidden_states, targets, head, loss_chunk, objective,
                                                      extras or {})
    loss = ce_sum / total_tokens + aux_weight * output.aux_loss
    terms = {"ce_sum": ce_sum, "aux": output.aux_loss, "statistics": output.statistics,
             "expert_load": output.expert_load, "ep_rank_load": output.ep_rank_load, "objective_sums": objective_sums}
    if mtp_targets is not None:
        terms["mtp_sums"] = mtp_cross_entropy(model, nested, output.mtp_hidden_states, mtp_targets, loss_chunk)
        loss = loss + jnp.sum(mtp_weights * terms["mtp_sums"])
    if z_weight:
        if not output.router_logits:
            raise ValueError("the router z-loss needs the router logits, which this step does not return (pipeline "
                             "stages keep them in their stage; a model without sparse layers has none).")
        terms["z"] = router_z_loss(output.router_logits, attention_mask if segment_ids is None else segment_ids)
        loss = loss + z_weight * terms["z"]
    return loss, terms
