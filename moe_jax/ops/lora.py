"""LoRA's low-rank update, PEFT's math, as array ops: the factors of one adapted weight and what they add.

Shape letters: r rank, E (local) experts, M rows sorted by expert, I in features, O out features (PEFT's
`in_features` / `out_features` of the adapted weight).

A dense weight W [O, I] (PEFT's `lora.Linear` on a `torch.nn.Linear`):

    y = x W^T + scaling * (x A^T) B^T                A [r, I], B [O, r]

A fused expert weight (PEFT's `lora.ParamWrapper`, `target_parameters`): each expert e is adapted on its own,

    W_e + scaling * B_e A_e                          A [E, r, I], B [E, O, r]

where HF's [E, O, I] layout (`[experts, out, in]`) has I = its last dim, and a layout PEFT is told is
transposed (gpt-oss's `is_transposed=True`: [E, I, O]) adds the transpose. PEFT's files flatten the experts
into the rank axis (`moe_jax.lora.peft_files`). scaling = lora_alpha / r, or lora_alpha / sqrt(r) (rsLoRA).

The experts' update runs on the rows the grouped matmul already sorted by expert, as two more grouped matmuls
through rank r, so no [E, O, I] delta is formed in a step and a frozen base weight needs no gradient.

Several adapters at once (K, index 0 the base's zeros; serving's `moe_jax.lora.AdapterSet`): `AdapterRows` holds a
dense weight's factors stacked [K, ...] and each token's adapter, `per_token_low_rank` adds each token its own
update; `ExpertAdapterRows` holds an expert weight's with the K ranks side by side and each sorted row's adapter,
`grouped_adapter_rows` zeroes all but the row's rank columns between the two grouped matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .grouped_matmul import grouped_matmul


@dataclass(frozen=True)
class LoraFactors:
    """The two factors of one adapted weight, and the static scaling their product is added with.

    a: [r, I] (dense) or [E, r, I] (experts); b: [O, r] or [E, O, r]. Inside a scanned run of layers both carry
    a leading layer axis; `scaling` is static (part of the pytree structure), so scans and vmaps slice only
    the arrays."""

    a: jax.Array
    b: jax.Array
    scaling: float

    def astype(self, dtype) -> LoraFactors:
        return LoraFactors(self.a.astype(dtype), self.b.astype(dtype), self.scaling)


jax.tree_util.register_dataclass(LoraFactors, data_fields=["a", "b"], meta_fields=["scaling"])


def grouped_low_rank(x: jax.Array, factors: LoraFactors, group_sizes: jax.Array, *,
                     backend: str | None = None) -> jax.Array:
    """The experts' update on rows sorted by expert: out[m] = scaling * B_e A_e x[m], e the expert of row m.

    x: [M, I] (rows past sum(group_sizes) give 0); factors: a [E, r, I], b [E, O, r]; group_sizes: [E]
    returns [M, O] in the promoted dtype of x and the factors
    """
    rank_rows = grouped_matmul(x, factors.a, group_sizes, backend=backend)                  # [M, r]
    out = grouped_matmul(rank_rows, factors.b, group_sizes, backend=backend)
    return out * jnp.asarray(factors.scaling, out.dtype)


def low_rank_delta(factors: LoraFactors, *, transposed: bool = False) -> jax.Array:
    """scaling * B A as the adapted weight holds it: [O, I] (dense), [E, O, I] (experts), or [E, I, O] with
    `transposed` (PEFT's `is_transposed` experts); float32 or wider."""
    dtype = jnp.promote_types(jnp.result_type(factors.a, factors.b), jnp.float32)
    a, b = factors.a.astype(dtype), factors.b.astype(dtype)
    if a.ndim == 2:
        delta = b @ a
    else:
        delta = jnp.einsum("eor,eri->eio" if transposed else "eor,eri->eoi", b, a)
    return delta * jnp.asarray(factors.scaling, dtype)


def merged_weight(weight: jax.Array, factors: LoraFactors, *, transposed: bool = False) -> jax.Array:
    """weight + scaling * B A (`low_rank_delta`), summed in float32 or wider and returned in weight's dtype."""
    delta = low_rank_delta(factors, transposed=transposed)
    return (weight.astype(delta.dtype) + delta).astype(weight.dtype)


def adapted_grouped_matmul(x: jax.Array, weight: jax.Array, group_sizes: jax.Array, factors: LoraFactors | None,
                           *, backend: str | None = None) -> jax.Array:
    """`grouped_matmul(x, weight, group_sizes)` plus the weight's LoRA update (`grouped_low_rank`), if any.

    x: [M, I] rows sorted by expert; weight: [E, O, I] as grouped_matmul takes it -> [M, O] in its dtype."""
    out = grouped_matmul(x, weight, group_sizes, backend=backend)
    if factors is None:
        return out
    low_rank = grouped_adapter_rows if isinstance(factors, ExpertAdapterRows) else grouped_low_rank
    update = low_rank(x, factors, group_sizes, backend=backend)
    return out + update.astype(out.dtype)


# An adapter set's entry for each token's adapter index ([B, S] int32; 0: the base, k: the set's k-th name).
ADAPTER_INDEX = "adapter_index"


@dataclass(frozen=True)
class AdapterRows:
    """Several adapters' factors of one dense weight, stacked, and which adapter each token takes (many adapters
    in one batch, `moe_jax.lora.AdapterSet`). Shape letters: K adapters (index 0: none, zero factors), r the
    largest rank (smaller ones zero-padded), I, O as above, T... the tokens' dims.

    a: [K, r, I]; b: [K, O, r]; index: [T...] each token's adapter (None: every token index 0); scales: K static
    scalings (PEFT's, one per adapter). Inside a scanned run of layers the arrays, index included, carry a
    leading layer axis."""

    a: jax.Array
    b: jax.Array
    index: jax.Array | None
    scales: tuple[float, ...]


jax.tree_util.register_dataclass(AdapterRows, data_fields=["a", "b", "index"], meta_fields=["scales"])


def per_token_low_rank(factors: AdapterRows, x: jax.Array) -> jax.Array | None:
    """Each token's adapter's update, scaling_k * (x A_k^T) B_k^T with k its index: x [T..., I] -> [T..., O], or
    None when no index is given (the base). Every adapter's rank features are formed and all but the token's
    zeroed (K small: a few r-wide projections, no gathered [T, r, I] factors)."""
    if factors.index is None:
        return None
    index = factors.index.reshape(x.shape[:-1])      # a caller may flatten [B, S] into rows
    count = factors.a.shape[0]
    rank = jnp.einsum("...i,kri->...kr", x, factors.a.astype(x.dtype))
    rank = rank * jax.nn.one_hot(index, count, dtype=x.dtype)[..., None]
    out = jnp.einsum("...kr,kor->...o", rank, factors.b.astype(x.dtype))
    return out * jnp.asarray(factors.scales, x.dtype)[index][..., None]


@dataclass(frozen=True)
class ExpertAdapterRows:
    """Several adapters' factors of one fused expert weight, their ranks side by side, and which adapter each row
    takes (`moe_jax.lora.AdapterSet`): a [E, K*r, I] and b [E, O, K*r], adapter k's r columns at k*r (zero for
    index 0, the base); index: [N] each token's adapter, or, once rows are sorted by expert, each row's ([M]);
    scales: the K static scalings."""

    a: jax.Array
    b: jax.Array
    index: jax.Array
    scales: tuple[float, ...]

    @classmethod
    def folded(cls, rows: AdapterRows, tokens: int) -> ExpertAdapterRows:
        """An `AdapterRows` of an expert weight (a [K, E, r, I], b [K, E, O, r], index [B, S]) -> its ranks
        folded side by side and the index one per token ([N], N = `tokens`, as the experts see them)."""
        count, experts, rank, features = rows.a.shape
        a = jnp.moveaxis(rows.a, 0, 1).reshape(experts, count * rank, features)
        b = jnp.moveaxis(rows.b, 0, 2).reshape(experts, rows.b.shape[2], count * rank)
        return cls(a, b, rows.index.reshape(tokens), rows.scales)

    def sorted_rows(self, order: jax.Array, top_k: int) -> ExpertAdapterRows:
        """The index of each sorted pair's token (`order` from `sort_by_expert`, [M] = N * K)."""
        return ExpertAdapterRows(self.a, self.b, self.index[order // top_k], self.scales)


jax.tree_util.register_dataclass(ExpertAdapterRows, data_fields=["a", "b", "index"], meta_fields=["scales"])


def grouped_adapter_rows(x: jax.Array, factors: ExpertAdapterRows, group_sizes: jax.Array, *,
                         backend: str | None = None) -> jax.Array:
    """Each sorted row's adapter's update on its expert: x [M, I] -> [M, O], every adapter's rank features formed
    in one grouped matmul and all but the row's zeroed before the second."""
    count = len(factors.scales)
    rank_rows = grouped_matmul(x, factors.a, group_sizes, backend=backend)                # [M, K*r]
    mask = jax.nn.one_hot(factors.index, count, dtype=rank_rows.dtype)
    mask = jnp.repeat(mask, rank_rows.shape[-1] // count, axis=-1)
    out = grouped_matmul(rank_rows * mask, factors.b, group_sizes, backend=backend)
    return out * jnp.asarray(factors.scales, out.dtype)[factors.index][:, None]
