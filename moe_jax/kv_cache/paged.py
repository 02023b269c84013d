"""The paged KV cache of continuous batching: its device page pools (the host's book of who holds which page is
page_book.py's).

    pools = init_page_pools(model, pages_per_group=256, page_size=16)   # zeros, sharded

Every layer run keeps keys and values [G, L, pages, P, K, D]: G data-parallel groups (the pool's group axis is
split over the batch's mesh axes, so a row's pages sit on its own devices; it leads, so a group's pools are one
contiguous block and the batched page writes keep the default layout), L layers, `pages` pages of P tokens, the
KV heads split over tp as the k/v projections' outputs are (replicated when tp does not divide them). DeepSeek's
latent attention pages its latent and rotated key (`model.cache_heads()`). Sliding-window layers keep every page
of a sequence (their window is a mask), so one page table serves every layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..distributed.mesh import spec_entry


def pool_sharding(model, heads: int) -> NamedSharding:
    """The sharding of one run's pool [G, L, pages, P, heads, D]."""
    layout = model.layout
    heads_entry = spec_entry(layout.tp_axes) if heads % layout.tp_size == 0 else None
    return NamedSharding(model.mesh, P(spec_entry(layout.batch_axes), None, None, None, heads_entry, None))


def init_page_pools(model, *, pages_per_group: int, page_size: int, dtype=None, abstract: bool = False,
                    entries: list[tuple[str, int | None, int]] | None = None) -> tuple[dict, dict]:
    """Zeroed (keys, values) pools per layer run: [G, L, pages_per_group, page_size, K, D], G the model's
    data-parallel size, in the model's dtype (or `dtype`), placed by `pool_sharding`. abstract: their shapes in
    their shardings, nothing allocated (a model on abstract target devices, compiled but not run). entries: (key,
    a layer, rows) of the pools to make (default: the layer runs', `cache_entries`; e.g. the MTP layer's)."""
    if model.layer_stack.pipeline is not None:
        raise ValueError("continuous batching needs pp_size=1 (a paged cache does not run through pipeline "
                         "stages); serve with tp / ep / fsdp / dp_replicate, or use generate().")
    if page_size < 1 or pages_per_group < 1:
        raise ValueError(f"page_size={page_size} and pages_per_group={pages_per_group} must be >= 1.")
    groups = model.data_parallel_size
    dtype = jnp.dtype(dtype or model.dtype)
    (key_heads, key_dim), (value_heads, value_dim) = model.cache_heads()

    def pool(rows: int, heads: int, dim: int):
        shape = (groups, rows, pages_per_group, page_size, heads, dim)
        if abstract:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=pool_sharding(model, heads))
        return jnp.zeros(shape, dtype, device=pool_sharding(model, heads))

    entries = model.layer_stack.cache_entries() if entries is None else entries
    return ({key: pool(rows, key_heads, key_dim) for key, _, rows in entries},
            {key: pool(rows, value_heads, value_dim) for key, _, rows in entries})


def pool_bytes(model, *, pages_per_group: int, page_size: int, dtype=None) -> int:
    """Bytes of every pool together (all groups), before any is made."""
    (key_heads, key_dim), (value_heads, value_dim) = model.cache_heads()
    layers = sum(rows for _, _, rows in model.layer_stack.cache_entries())
    per_token = layers * (key_heads * key_dim + value_heads * value_dim) * jnp.dtype(dtype or model.dtype).itemsize
    return per_token * model.data_parallel_size * pages_per_group * page_size
