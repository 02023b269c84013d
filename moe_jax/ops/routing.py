"""Top-k routers and the auxiliary load-balancing loss of Hugging Face's MoE models.

Shape letters: T tokens, K top-k, E experts, L layers.

Routing replay: every router takes `replay`, [T, K] expert ids recorded by an earlier forward (a sampler's), or
None. A token whose row holds ids (all >= 0) runs those experts instead of its own top-k; its weights are the
router's values at them, by the router's own rule (so gradients still reach the router). A row with a -1
(padding, an unrecorded token) routes as without replay.

Ties: every router here picks experts with `jax.lax.top_k`, which returns equal
probabilities in ascending expert order (the lower expert id wins). `torch.topk`
does not document its tie order; on CPU it agrees with this in the cases the
tests cover, so exact ties are the one place where a routing may legitimately
differ from the PyTorch reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k={top_k} must be between 1 and the number of experts ({num_experts}); "
            "pass the model config's num_experts_per_tok."
        )


def _check_logits(router_logits: jax.Array) -> None:
    if router_logits.ndim != 2:
        raise ValueError(
            f"router_logits must be [T, E], got shape {router_logits.shape}; "
            "flatten batch and sequence first (logits.reshape(-1, num_experts))."
        )


def replayed_choice(top_k_index: jax.Array, replay: jax.Array | None) -> jax.Array:
    """top_k_index: [T, K] the router's own choice; replay: [T, K] recorded ids or None -> [T, K] int32, each
    recorded row (all ids >= 0) in place of the router's."""
    if replay is None:
        return top_k_index
    if replay.shape != top_k_index.shape:
        raise ValueError(f"replayed routing must be [T, K] = {tuple(top_k_index.shape)} per layer, got "
                         f"{tuple(replay.shape)}; record it from a forward of the same batch and top_k.")
    replay = replay.astype(jnp.int32)
    return jnp.where(jnp.all(replay >= 0, axis=-1, keepdims=True), replay, top_k_index.astype(jnp.int32))


def _top_k_of(scores: jax.Array, top_k: int, replay: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(scores, top_k)` with `replay`'s rows in place of the choice: (scores at the chosen ids
    [T, K], ids [T, K]). Without replay exactly top_k's values, so a run without a record is unchanged."""
    values, index = jax.lax.top_k(scores, top_k)
    if replay is None:
        return values, index
    index = replayed_choice(index, replay)
    return jnp.take_along_axis(scores, index, axis=-1), index


def softmax_top_k(router_logits: jax.Array, top_k: int, normalize: bool,
                  replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Qwen2-MoE / Qwen3-MoE / OLMoE router: softmax in fp32, top-k, optional renormalisation.

    router_logits: [T, E]
    returns (top_k_weights: [T, K] in router_logits' dtype, top_k_index: [T, K] int32)

    `normalize` is the config's `norm_topk_prob`: divide the K kept probabilities
    by their sum. The weights are cast back to the logits' dtype, as the reference
    does, so bf16 logits give bf16 weights.
    """
    _check_logits(router_logits)
    _check_top_k(top_k, router_logits.shape[-1])
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_k_weights, top_k_index = _top_k_of(probs, top_k, replay)
    if normalize:
        top_k_weights = top_k_weights / jnp.sum(top_k_weights, axis=-1, keepdims=True)
    return top_k_weights.astype(router_logits.dtype), top_k_index.astype(jnp.int32)


def mixtral_top_k(router_logits: jax.Array, top_k: int,
                  replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Mixtral router: softmax in fp32, top-k, always renormalised, weights kept in fp32.

    router_logits: [T, E]
    returns (top_k_weights: [T, K] float32, top_k_index: [T, K] int32)

    Unlike `softmax_top_k` the weights are not cast back: Mixtral hands fp32
    weights to its experts even when the hidden states are bf16, so the expert
    outputs are summed in fp32.
    """
    _check_logits(router_logits)
    _check_top_k(top_k, router_logits.shape[-1])
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    top_k_weights, top_k_index = _top_k_of(probs, top_k, replay)
    top_k_weights = top_k_weights / jnp.sum(top_k_weights, axis=-1, keepdims=True)
    return top_k_weights, top_k_index.astype(jnp.int32)


def top_k_softmax(router_logits: jax.Array, top_k: int,
                  replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """gpt-oss router: top-k of the (biased) logits, then softmax over the K kept values.

    router_logits: [T, E]
    returns (top_k_weights: [T, K] in router_logits' dtype, top_k_index: [T, K] int32)

    The softmax runs in the logits' dtype, as the reference's `softmax(top_values, dtype=top_values.dtype)`.
    """
    _check_logits(router_logits)
    _check_top_k(top_k, router_logits.shape[-1])
    top_values, top_k_index = _top_k_of(router_logits, top_k, replay)
    return jax.nn.softmax(top_values, axis=-1), top_k_index.astype(jnp.int32)


def group_limited_sigmoid_top_k(router_logits: jax.Array, correction_bias: jax.Array, top_k: int, *,
                                num_groups: int, top_k_groups: int, normalize: bool, scaling: float,
                                replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3 router (HF's `DeepseekV3TopkRouter` after its fp32 linear): sigmoid scores, expert choice
    biased by `e_score_correction_bias` and limited to the best groups, weights from the unbiased scores.

    router_logits: [T, E] (the reference computes them in float32); correction_bias: [E]
    returns (top_k_weights: [T, K] float32, top_k_index: [T, K] int32)

        s = sigmoid(logits); c = s + bias
        group score = sum of the two largest c in each of `num_groups` groups of E / num_groups experts
        keep the `top_k_groups` best groups (others' c = -inf); idx = top_k(c); w = s[idx]
        w /= sum(w) + 1e-20 if `normalize` (norm_topk_prob); w *= `scaling` (routed_scaling_factor)

    With `replay` the recorded ids replace idx (the bias and the groups only ever chose); w as above at them.
    """
    _check_logits(router_logits)
    tokens, num_experts = router_logits.shape
    if num_groups < 1 or num_experts % num_groups or num_experts // num_groups < 2:
        raise ValueError(f"n_group={num_groups} must split the {num_experts} experts into equal groups of at least 2 "
                         "(each group is scored by its two best experts).")
    if not 1 <= top_k_groups <= num_groups:
        raise ValueError(f"topk_group={top_k_groups} must be between 1 and n_group={num_groups}.")
    per_group = num_experts // num_groups
    if not 1 <= top_k <= top_k_groups * per_group:
        raise ValueError(f"top_k={top_k} must be between 1 and the {top_k_groups * per_group} experts of the "
                         f"{top_k_groups} kept group(s).")
    if correction_bias.shape != (num_experts,):
        raise ValueError(f"e_score_correction_bias must be [E] = [{num_experts}], got {tuple(correction_bias.shape)}.")
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)
    group_scores = jax.lax.top_k(choice.reshape(tokens, num_groups, per_group), 2)[0].sum(axis=-1)   # [T, G]
    _, kept_groups = jax.lax.top_k(group_scores, top_k_groups)
    kept = jnp.zeros((tokens, num_groups), bool).at[jnp.arange(tokens)[:, None], kept_groups].set(True)
    choice = jnp.where(jnp.repeat(kept, per_group, axis=1), choice, -jnp.inf)
    top_k_index = replayed_choice(jax.lax.top_k(choice, top_k)[1], replay)
    weights = jnp.take_along_axis(scores, top_k_index, axis=1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, top_k_index.astype(jnp.int32)


def _stack_layers(router_logits_per_layer: Sequence[jax.Array] | jax.Array) -> jax.Array:
    """router_logits_per_layer: L arrays of [T, E], or [L, T, E] -> [L, T, E]."""
    if isinstance(router_logits_per_layer, (list, tuple)):
        if not router_logits_per_layer:
            raise ValueError("router_logits_per_layer is empty; pass one [T, E] array per MoE layer.")
        stacked = jnp.stack([jnp.asarray(layer) for layer in router_logits_per_layer])
    else:
        stacked = jnp.asarray(router_logits_per_layer)
    if stacked.ndim != 3:
        raise ValueError(
            f"router logits must be a list of [T, E] arrays or one [L, T, E] array, "
            f"got stacked shape {stacked.shape}."
        )
    return stacked


def _picks_and_probs(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """logits: [T, E] -> (picks [T, E]: 1 where the expert is among the token's top k, probs [T, E] fp32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(logits.dtype)
    _, selected = jax.lax.top_k(probs, top_k)  # [T, K]
    picks = jnp.sum(jax.nn.one_hot(selected, logits.shape[-1], dtype=jnp.float32), axis=-2)
    return picks, probs.astype(jnp.float32)


def load_balancing_loss(
    router_logits_per_layer: Sequence[jax.Array] | jax.Array | None,
    num_experts: int,
    top_k: int,
    attention_mask: jax.Array | None = None,
    *,
    per_token: Callable[[Callable], Callable] = lambda fn: fn,
) -> jax.Array:
    """Switch-Transformer auxiliary loss, as transformers' `load_balancing_loss_func`.

    router_logits_per_layer: L arrays of [T, E] or one [L, T, E] (T = batch * sequence)
    attention_mask: [B, S] with B * S == T, 1 for real tokens, 0 for padding
    returns a float32 scalar

    Per layer: p = softmax(logits), the top-k experts of p are counted; counts and
    p are summed over tokens (weighted by the mask when given) and over layers, and
    both sums are divided by the number of counted rows (L * T, or L * mask.sum()).
    loss = E * sum_e tokens_per_expert[e] * router_prob_per_expert[e].

    The softmax runs in fp32 and is rounded to the logits' dtype before the top-k,
    which is what PyTorch's reduced-precision softmax kernels produce; the sums are
    fp32. `None` gives 0, as the reference does when a model returns no router logits.
    Gradients flow only through the probability sums (the counts are discrete), as
    in the reference. `per_token` wraps the per-token part ([T, E] -> picks, probs),
    e.g. to run it where the tokens live (`ActivationLayouts.token_local`).
    """
    if router_logits_per_layer is None:
        return jnp.zeros((), jnp.float32)
    logits = _stack_layers(router_logits_per_layer)
    num_layers, num_tokens, logit_experts = logits.shape
    if logit_experts != num_experts:
        raise ValueError(
            f"router logits have {logit_experts} experts on their last axis but num_experts={num_experts}; "
            "pass the config's number of routed experts."
        )
    _check_top_k(top_k, num_experts)

    token_terms = per_token(partial(_picks_and_probs, top_k=top_k))
    picks, probs = (jnp.stack(terms) for terms in zip(*(token_terms(layer) for layer in logits)))

    if attention_mask is None:
        token_weight = jnp.ones((num_tokens,), jnp.float32)
    else:
        if attention_mask.size != num_tokens:
            raise ValueError(
                f"attention_mask has {attention_mask.size} entries (shape {attention_mask.shape}) but the "
                f"router logits have T={num_tokens} rows; pass the [batch, sequence] mask of the same batch."
            )
        token_weight = jnp.reshape(attention_mask, (-1,)).astype(jnp.float32)

    tokens_per_expert_sum = jnp.einsum("lte,t->e", picks, token_weight)
    router_prob_sum = jnp.einsum("lte,t->e", probs, token_weight)
    total_rows = num_layers * jnp.sum(token_weight)

    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    return jnp.sum(tokens_per_expert * router_prob_per_expert) * num_experts


def router_z_loss(router_logits_per_layer: Sequence[jax.Array] | jax.Array,
                  attention_mask: jax.Array | None = None) -> jax.Array:
    """ST-MoE's router z-loss: per layer, the mean over the (real) tokens of logsumexp(router logits)^2, averaged
    over the layers; a float32 scalar.

    router_logits_per_layer: L arrays of [T, E] or one [L, T, E]; attention_mask: [B, S] with B * S == T, 1 for
    real tokens, 0 for padding (None: every token counts). It pushes the logits' scale down (large logits make
    the router's softmax or sigmoid saturate and its rounding matter), whatever the router's activation."""
    logits = _stack_layers(router_logits_per_layer)
    num_tokens = logits.shape[1]
    squared = jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))     # [L, T]
    if attention_mask is None:
        return jnp.mean(squared)
    if attention_mask.size != num_tokens:
        raise ValueError(f"attention_mask has {attention_mask.size} entries (shape {attention_mask.shape}) but the "
                         f"router logits have T={num_tokens} rows; pass the [batch, sequence] mask of the same batch.")
    weight = (jnp.reshape(attention_mask, (-1,)) > 0).astype(jnp.float32)
    return jnp.mean(squared @ weight) / jnp.maximum(jnp.sum(weight), 1.0)


def top_k_sigmoid(router_logits: jax.Array, top_k: int,
                  replay: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Llama 4's router (HF's `Llama4Router`): the top-k logits, each through a sigmoid (no normalisation).

    router_logits: [T, E] -> (top_k_weights: [T, K] in the logits' dtype (sigmoid in float32), top_k_index [T, K])
    """
    _check_logits(router_logits)
    values, top_k_index = _top_k_of(router_logits, top_k, replay)
    weights = jax.nn.sigmoid(values.astype(jnp.float32)).astype(router_logits.dtype)
    return weights, top_k_index.astype(jnp.int32)


def expert_load(top_k_index: jax.Array, token_weight: jax.Array, num_experts: int) -> jax.Array:
    """The tokens routed to each expert: top_k_index [T, K], token_weight [T] (1 real, 0 padding) -> [E]
    float32 (a token counts once for each of its K experts)."""
    weights = jnp.broadcast_to(token_weight.astype(jnp.float32)[:, None], top_k_index.shape)
    return jnp.zeros((num_experts,), jnp.float32).at[top_k_index.reshape(-1)].add(weights.reshape(-1))


def load_balancing_sums(router_logits: jax.Array, top_k: int, token_weight: jax.Array, *,
                        per_token: Callable[[Callable], Callable] = lambda fn: fn
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's additive share of `load_balancing_loss`, for callers that see the batch in parts (pipeline
    microbatches): router_logits [T, E], token_weight [T] (the mask) -> (tokens per expert [E], router
    probabilities per expert [E], counted rows), each a weighted sum over the T tokens, float32.
    `load_balancing_from_sums` of their totals over layers and parts is the loss of the whole batch."""
    picks, probs = per_token(partial(_picks_and_probs, top_k=top_k))(router_logits)
    weight = token_weight.astype(jnp.float32)
    return jnp.einsum("te,t->e", picks, weight), jnp.einsum("te,t->e", probs, weight), jnp.sum(weight)


def load_balancing_from_sums(tokens_per_expert_sum: jax.Array, router_prob_sum: jax.Array, rows: jax.Array,
                             num_experts: int) -> jax.Array:
    """`load_balancing_loss` from `load_balancing_sums` totalled over every layer and part of the batch."""
    return jnp.sum((tokens_per_expert_sum / rows) * (router_prob_sum / rows)) * num_experts
