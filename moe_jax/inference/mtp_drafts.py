"""Drafting with a checkpoint's multi-token-prediction layer inside each engine step (`speculative="mtp"`).

    drafts, keys, values = mtp_drafts(model, params, adapter, hidden, next_ids, (keys, values), inputs, start, k)

The MTP layer keeps its own paged keys and values (the pools' "mtp" run, on the same page tables). Every step runs
it at the step's real positions i with (the main model's hidden state at i before its final norm, the token after
i: the prompt's next token, a kept draft, or the token the step sampled), which stores its keys and values there,
as DeepSeek-V3's MTP module reads them; then, from the row's last kept position, it drafts the next tokens one after
another (greedy: its argmax, fed back with its own hidden state), writing only inside the row's pages. The drafts
are the next step's to verify (`speculative.accepted_tokens`): its positions' entries are written again then with
the right inputs, so a wrong draft costs nothing but its verification.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..kv_cache import PagedKVCache
from ..models.core import mtp_cache_step


def mtp_drafts(model, params, adapter, hidden: jax.Array, next_ids: jax.Array, pools: tuple, inputs: dict,
               start: jax.Array, count: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """hidden: [R, S, H] the main model's hidden states before its final norm; next_ids: [R, S] the token after
    each position; pools: the MTP layer's (keys, values) [G, 1, pages, P, K, D]; inputs: the step's (mask,
    page_table, lengths, capacity); start: [R] the position (in the row) the drafts follow; count: drafts per row
    -> (drafts [R, count] int32, the pools with this step's positions stored)."""
    core, mask, table = model.core, inputs["mask"], inputs["page_table"]
    cache = PagedKVCache(keys={"mtp": pools[0]}, values={"mtp": pools[1]}, page_table=table,
                         lengths=inputs["lengths"])
    out, logits, cache = mtp_cache_step(core, params, hidden, next_ids, cache=cache, attention_mask=mask,
                                        adapter=adapter)
    rows = jnp.arange(mask.shape[0])
    state = out[rows, start][:, None]                                                   # [R, 1, H]
    draft = jnp.argmax(logits[rows, start].astype(jnp.float32), axis=-1).astype(jnp.int32)
    drafts = [draft]
    page_size = pools[0].shape[3]
    # The tokens the row's pages hold, within the page-table width this step reads.
    room = jnp.minimum(inputs["capacity"], table.shape[1] * page_size)
    real = jnp.sum(mask, axis=1) > 0
    for j in range(1, count):
        position = inputs["lengths"] + start + j                                        # [R]
        chain = PagedKVCache(keys=cache.keys, values=cache.values, page_table=table, lengths=position)
        writes = (real & (position < room)).astype(jnp.int32)[:, None]
        state, logits, cache = mtp_cache_step(core, params, state, draft[:, None], cache=chain, attention_mask=writes,
                                              adapter=adapter)
        draft = jnp.argmax(logits[:, 0].astype(jnp.float32), axis=-1).astype(jnp.int32)
        drafts.append(draft)
    return jnp.stack(drafts, axis=1), cache.keys["mtp"], cache.values["mtp"]


def next_tokens(ids: jax.Array, last: jax.Array, next_id: jax.Array, sampled: jax.Array) -> jax.Array:
    """ids: [R, S] a step's rows; last: [R] each row's last real position; next_id: [R] the token after it when the
    host knows it (else -1); sampled: [R] the token the step sampled -> [R, S] the token after each position."""
    shifted = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    after_last = jnp.where(next_id >= 0, next_id, sampled)
    return jnp.where(jnp.arange(ids.shape[1])[None, :] == last[:, None], after_last[:, None], shifted)
