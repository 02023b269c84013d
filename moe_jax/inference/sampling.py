"""Choosing the next token from logits, as Transformers' `generate` does (greedy, or sampling after its
temperature -> top-k -> top-p warpers, in that order). Sampling draws from JAX's generator: reproducible
for a seed, not the same draws as torch."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

# Below this temperature sampling is greedy (vLLM's rule): logits / 1e-40 overflow float32, and the draw of a
# distribution that sharp is the argmax anyway.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Sampling:
    """Static choice of the next-token rule (hashable: one compilation per rule).

    do_sample=False is greedy (argmax, lowest id on ties, as torch.argmax), and so is a temperature below
    `MIN_TEMPERATURE`. top_k: 0 or None = off; top_p: 1.0 = off; temperature: 1.0 = off."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0

    def __post_init__(self):
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature={self.temperature} must be > 0 when sampling (do_sample=True); "
                                 "use do_sample=False for greedy decoding.")
            if self.top_k is not None and self.top_k < 0:
                raise ValueError(f"top_k={self.top_k} must be >= 0 (0 or None: no top-k filter).")
            if not 0 < self.top_p <= 1:
                raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1.0: no nucleus filter).")


def warp(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """logits: [B, V] float32 -> the same with filtered entries at -inf (HF's warpers, in HF's order). A warper
    that is off is not traced (`warp_per_row` runs each row's settings in one program)."""
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_k:
        k = min(sampling.top_k, logits.shape[-1])
        logits = _drop_below(logits, jax.lax.top_k(logits, k)[0][..., -1:])
    if sampling.top_p < 1.0:
        logits = jnp.where(_outside_nucleus(logits, jnp.full(logits.shape[:1], sampling.top_p)), -jnp.inf, logits)
    return logits


def _drop_below(logits: jax.Array, kth: jax.Array) -> jax.Array:
    """logits: [B, V]; kth: [B, 1] each row's k-th largest -> entries below it at -inf (ties with it stay, as in
    HF's top-k)."""
    return jnp.where(logits < kth, -jnp.inf, logits)


def _outside_nucleus(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits: [B, V]; top_p: [B] -> [B, V] bool, the entries HF's top-p drops: in ascending order, those whose
    cumulative probability is <= 1 - top_p, never the top token."""
    order = jnp.argsort(logits, axis=-1)
    ascending = jnp.take_along_axis(logits, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    drop_sorted = (cumulative <= (1 - top_p)[:, None]).at[:, -1].set(False)
    return jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)


def next_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """logits: [B, V] -> token ids [B] int32."""
    logits = logits.astype(jnp.float32)
    if not sampling.do_sample or sampling.temperature < MIN_TEMPERATURE:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp(logits, sampling), axis=-1).astype(jnp.int32)


def warp_per_row(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`warp` with each row's own settings (traced, so one program serves every request's).

    logits: [B, V]; temperature: [B] float (> 0); top_k: [B] int (0: off); top_p: [B] float (1.0: off)
    -> [B, V] float32 with the filtered entries at -inf, Transformers' order (temperature, top-k, top-p)."""
    logits = logits.astype(jnp.float32) / temperature[:, None]
    vocab = logits.shape[-1]
    descending = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(descending, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    logits = jnp.where(top_k[:, None] > 0, _drop_below(logits, kth), logits)
    return jnp.where(_outside_nucleus(logits, top_p) & (top_p[:, None] < 1.0), -jnp.inf, logits)


def next_tokens_per_row(logits: jax.Array, keys: jax.Array, do_sample: jax.Array, temperature: jax.Array,
                        top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Each row its own rule (continuous batching: one compiled program for every request's settings).

    logits: [B, V]; keys: [B] typed PRNG keys; do_sample: [B] bool (False: greedy, as `next_tokens`); temperature,
    top_k, top_p: [B] as `warp_per_row` -> token ids [B] int32. A row sampling below `MIN_TEMPERATURE` is greedy."""
    do_sample = do_sample & (temperature >= MIN_TEMPERATURE)
    greedy = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    warped = warp_per_row(logits, jnp.where(do_sample, temperature, 1.0), top_k, top_p)
    sampled = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, warped).astype(jnp.int32)
    return jnp.where(do_sample, sampled, greedy)


def add_bias(logits: jax.Array, bias_ids: jax.Array, bias: jax.Array) -> jax.Array:
    """logits: [R, V]; bias_ids: [R, B] token ids; bias: [R, B] -> logits with each row's biases added at its ids
    (a repeated id adds each; an unused pair is id 0 with bias 0; -inf masks the id)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.astype(jnp.float32).at[rows, bias_ids].add(bias, mode="drop")


def allowed_only(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits: [R, V]; allowed: [R, ceil(V / 32)] int32 bitmasks (bit v % 32 of word v // 32: token v; -1 words:
    every token) -> logits with each row's disallowed tokens at -inf (a grammar's mask, `grammar`)."""
    ids = jnp.arange(logits.shape[-1])
    bits = (allowed[:, ids // 32] >> (ids % 32)) & 1
    return jnp.where(bits > 0, logits, -jnp.inf)


def penalize(logits: jax.Array, generated: jax.Array, in_prompt: jax.Array, presence: jax.Array,
             frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM's penalties in its order. logits: [R, V]; generated: [R, V] int each id's count among the row's generated
    tokens; in_prompt: [R, V] bool the ids of its prompt; presence, frequency, repetition: [R] (0, 0, 1.0: off)
    -> [R, V] float32. Repetition (Transformers / vLLM): a positive logit of an id in the prompt or generated is
    divided by the penalty, any other multiplied; then OpenAI's frequency (times the id's count) and presence
    (once, if generated) penalties are subtracted."""
    logits = logits.astype(jnp.float32)
    seen = in_prompt | (generated > 0)
    repetition = repetition[:, None]
    logits = jnp.where(seen & (repetition != 1.0),
                       jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency[:, None] * generated - presence[:, None] * (generated > 0)


def token_logprobs(logits: jax.Array, tokens: jax.Array, top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits: [R, V] (the model's raw logits); tokens: [R] the chosen ids -> (their log probabilities [R], the
    `top` likeliest ids [R, top] int32 and theirs [R, top], most likely first), under log_softmax(logits)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logprobs, min(top, logprobs.shape[-1]))
    return chosen, top_ids.astype(jnp.int32), top_values
