"""Token embedding lookup with Hugging Face / PyTorch `nn.Embedding` parameters."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp


def embed(params: Mapping[str, jax.Array], ids: jax.Array, *, padding_idx: int | None = None) -> jax.Array:
    """Rows of `params["weight"]` for each token id, as `torch.nn.Embedding`.

    params: `{"weight": [V, H]}`
    ids: [...] integer token ids in `[0, V)`  ->  [..., H]

    `padding_idx` mirrors `nn.Embedding(padding_idx=...)`: the forward value is the stored row, but that row
    receives no gradient, so training matches PyTorch (HF passes `config.pad_token_id` here).
    Ids outside `[0, V)`, negative ones included, give NaN rows where PyTorch raises: a jitted lookup cannot
    raise, and NaN makes a bad id visible downstream instead of silently reading a clamped or wrapped row.
    """
    weight = params["weight"]
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"embed: token ids must be integers, got dtype {ids.dtype}; cast with ids.astype(jnp.int32)"
        )
    # jnp.take would wrap negative ids numpy-style; map them past the end so they fill with NaN too.
    ids_in_range = jnp.where(ids < 0, weight.shape[0], ids)
    rows = jnp.take(weight, ids_in_range, axis=0, mode="fill", fill_value=jnp.nan)
    if padding_idx is not None:
        is_padding = (ids == padding_idx)[..., None]
        rows = jnp.where(is_padding, jax.lax.stop_gradient(rows), rows)
    return rows
