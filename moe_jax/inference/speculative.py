"""Speculative decoding in continuous batching: drafts proposed on the host, verified on the device in one step.

    drafts = ngram_drafts(context, k=4, ngram_min=2, ngram_max=4)      # host: prompt lookup
    tokens, counts = accepted_tokens(logits, drafts, draft_counts, ...)  # device: [R, K + 1], [R]

Prompt lookup ("ngram", vLLM's n-gram proposer): a request's drafts are the tokens that followed the latest earlier
occurrence of its last n tokens in its own context (prompt and output), for the longest n in [ngram_min,
ngram_max] that occurs: code edits, quotes and resent context copy long spans, and there the drafts are right.

A verification step runs each decoding row as [its last token, its drafts] (`ContinuousBatchingConfig.
num_speculative_tokens` drafts at most) and scores every position at once: position j's logits predict the token
after draft j. At each position the step draws the token plain decoding would draw there (greedy: the argmax;
sampling: the warped categorical under the request's key for that output index, `fold_in(key(seed), index)`), and
a row keeps its drafts while each equals the token drawn before it, then the token drawn after the last one kept.
So the output is plain decoding's, token for token, greedy or sampled. For a draft that is one token with
certainty (prompt lookup; greedy drafters) this is Leviathan et al.'s rejection sampling with the randomness
shared: draft d is kept with probability p(d), and when it is not, the token drawn is distributed as the target
without d, renormalised (the Gumbel-max draw conditioned on not being d). A row gains its kept drafts and one
token more, so a step never yields fewer tokens than a plain decode step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..speculative_limits import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, check_speculative  # noqa: F401
from .sampling import next_tokens_per_row


def ngram_drafts(context, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """context: a request's tokens so far (prompt, then output) -> up to `k` drafts: what followed the latest
    earlier occurrence of its last n tokens, for the longest n in [ngram_min, ngram_max] found (none: [])."""
    tokens = np.asarray(context, np.int64)
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)    # every earlier n tokens
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return tokens[follow:follow + k].tolist()
    return []


def request_drafts(request, config) -> list[int]:
    """Up to `config.num_speculative_tokens` drafts for a request's (`requests.Request`) next tokens, as many as
    its output and the context have room for with one token after them (so its pages hold every token a step
    writes)."""
    generated = len(request.output.generated_tokens)
    room = min(request.settings.max_new_tokens - generated,
               config.max_model_len - len(request.prompt_ids) - generated) - 1
    count = min(config.num_speculative_tokens, room)
    if count < 1:
        return []
    if config.speculative == "mtp":   # what the MTP layer drafted in the request's last step
        return request.drafts[:count]
    return ngram_drafts(request.prompt_ids + request.output.generated_tokens, count, config.ngram_min,
                        config.ngram_max)


def accepted_tokens(logits: jax.Array, ids: jax.Array, mask: jax.Array, keys: jax.Array, do_sample: jax.Array,
                    temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One verification step's acceptance, each row by its own settings.

    logits: [R, T, V] the target's logits at each of the row's tokens; ids: [R, T] the row's last token then its
    drafts; mask: [R, T] its real tokens (1 + its drafts; an idle row: none); keys: [R, T] typed PRNG keys, the
    row's key for each output index (as plain decoding keys it); do_sample, temperature, top_k, top_p: [R] as
    `next_tokens_per_row` -> (tokens [R, T] int32: the accepted drafts then the target's token, -1 after;
    counts [R] int32: how many)."""
    rows, length, vocab = logits.shape
    repeat = lambda values: jnp.repeat(values, length)   # noqa: E731 - a row's settings at each of its positions
    # Every position's token as plain decoding draws it at that output index (greedy: the argmax); a draft is
    # accepted while it equals them.
    flat = logits.reshape(rows * length, vocab)
    # The warpers sort every position's logits: only when some row samples (a greedy step takes the argmax).
    drawn = jax.lax.cond(
        jnp.any(do_sample),
        lambda: next_tokens_per_row(flat, keys.reshape(-1), repeat(do_sample), repeat(temperature), repeat(top_k),
                                    repeat(top_p)),
        lambda: jnp.argmax(flat.astype(jnp.float32), axis=-1).astype(jnp.int32)).reshape(rows, length)
    drafts, draft_counts = ids[:, 1:], jnp.sum(mask, axis=1) - 1
    accept = (drafts == drawn[:, :-1]) & (jnp.arange(length - 1)[None, :] < draft_counts[:, None])
    accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1)
    tokens = jnp.where(jnp.arange(length)[None, :] <= accepted[:, None], drawn, -1)
    return tokens.astype(jnp.int32), (accepted + 1).astype(jnp.int32)
