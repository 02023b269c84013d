"""The experts computation of HF's MoE blocks (gate/up projection, SwiGLU, down projection).

Shape letters: N tokens, K top-k, E (local) experts, H hidden, I intermediate,
M = N * K (token, choice) pairs.

Contract, as transformers' `*Experts.forward(hidden_states, top_k_index, top_k_weights)`:

    out[n] = sum_k weights[n, k] * down[e] @ (act(gate[e] @ x[n]) * (up[e] @ x[n])),  e = expert_ids[n, k]
    gate = gate_up_proj[e, :I], up = gate_up_proj[e, I:]

Expert ids are local to this shard. The id E (the number of local experts) is
the expert-parallel "not mine" sentinel: such a choice adds nothing and gets no
gradient, neither into x, the expert weights, nor its routing weight. Ids above
E are treated the same way; negative ids are invalid.

The weighted sum over K runs in the promoted dtype of (hidden, weights), then
the result is cast to the hidden dtype, like transformers' grouped_mm path:
Mixtral's fp32 routing weights with bf16 hidden states are summed in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from .accumulation import accumulating_einsum, accumulation_dtype
from .grouped_matmul_backends.tiled_swiglu import gated
from .grouped_matmul import experts_scope
from .grouped_swiglu import grouped_swiglu
from .lora import ExpertAdapterRows, LoraFactors, adapted_grouped_matmul
from .permute import count_at_most, gather_rows, sort_by_expert, unpermute
from .quantized import is_quantized
from .varying import vary_like

Activation = Callable[[jax.Array], jax.Array]
# A LoRA adapter on the experts: weight name ("gate_up_proj", "down_proj") -> its factors (`moe_jax.ops.lora`).
ExpertsLora = Mapping[str, LoraFactors]


def _check_experts_operands(hidden, expert_ids, weights, gate_up_proj, down_proj) -> None:
    if hidden.ndim != 2:
        raise ValueError(
            f"hidden must be [N, H], got shape {hidden.shape}; flatten batch and sequence first."
        )
    if expert_ids.ndim != 2 or expert_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"expert_ids must be [N, K] with N={hidden.shape[0]}, got shape {expert_ids.shape}.")
    if weights.shape != expert_ids.shape:
        raise ValueError(
            f"weights {weights.shape} must match expert_ids {expert_ids.shape}: one routing weight per choice."
        )
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids must be integers, got dtype {expert_ids.dtype}.")
    hidden_size = hidden.shape[1]
    if gate_up_proj.ndim != 3 or gate_up_proj.shape[2] != hidden_size or gate_up_proj.shape[1] % 2:
        raise ValueError(
            f"gate_up_proj must be [E, 2I, H] with H={hidden_size}, got shape {gate_up_proj.shape}; "
            "it is HF's fused [gate; up] weight in [experts, out, in] layout."
        )
    num_experts, two_i, _ = gate_up_proj.shape
    if down_proj.shape != (num_experts, hidden_size, two_i // 2):
        raise ValueError(
            f"down_proj must be [E, H, I] = [{num_experts}, {hidden_size}, {two_i // 2}] to match "
            f"gate_up_proj {gate_up_proj.shape}, got {down_proj.shape}."
        )


def _varying_like(lora: ExpertsLora | None, like: jax.Array) -> dict:
    """The adapter's factors marked varying like `like` (already varying with every operand); {} for None."""
    return {} if not lora else {name: jax.tree.map(lambda array: vary_like(array, like), factors)
                                for name, factors in lora.items()}


def _sorted_adapter_rows(lora: dict, order: jax.Array, top_k: int) -> dict:
    """Several adapters' factors (`ExpertAdapterRows`) with each sorted row's adapter (order: `sort_by_expert`'s)."""
    return {name: factors.sorted_rows(order, top_k) if isinstance(factors, ExpertAdapterRows) else factors
            for name, factors in lora.items()}


def _oriented(factors: LoraFactors | ExpertAdapterRows) -> LoraFactors | ExpertAdapterRows:
    """Factors of an [E, in, out] weight in the [E, out, in] chain's orientation: swapaxes(W + s B A) =
    swapaxes(W) + s swapaxes(A) swapaxes(B) (several adapters' ranks stay side by side)."""
    a, b = jnp.swapaxes(factors.b, 1, 2), jnp.swapaxes(factors.a, 1, 2)
    if isinstance(factors, ExpertAdapterRows):
        return ExpertAdapterRows(a, b, factors.index, factors.scales)
    return LoraFactors(a, b, factors.scaling)


def _varying_together(*operands):
    """The operands (arrays, or quantised stand-ins: every leaf), each marked as varying over every mesh axis any
    of them varies over.

    Inside shard_map the custom-VJP ops of the experts need operands that vary over the same mesh axes; marking
    them lets JAX sum the gradients of replicated operands (the transpose of the mark is a psum). A no-op
    outside shard_map."""
    return [jax.tree.map(lambda leaf: vary_like(leaf, *operands), operand) for operand in operands]


def _out_in(weight):
    """An [E, in, out] experts weight as grouped_matmul's [E, out, in]; a quantised one is stored that way."""
    return weight if is_quantized(weight) else jnp.swapaxes(weight, 1, 2)


def swiglu_experts(
    hidden: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    act: Activation = jax.nn.silu,
    backend: str | None = None,
    lora: ExpertsLora | None = None,
) -> jax.Array:
    """Dropless SwiGLU experts via sort -> grouped matmul -> unsort.

    hidden: [N, H]
    expert_ids: [N, K] int, local ids in [0, E]; E means "not mine"
    weights: [N, K] routing weights
    gate_up_proj: [E, 2I, H]
    down_proj: [E, H, I]
    returns [N, H] in hidden's dtype

    backend: grouped_matmul backend name, None for the platform default. A decode step's few tokens skip the sort
    and the backend (`gathers_experts`: each pair's expert weights gathered, `_gathered_swiglu`; thresholds measured
    on CPU).
    lora: LoRA factors of gate_up_proj and / or down_proj (a [E, r, H] / b [E, 2I, r], a [E, r, I] / b [E, H, r]):
    their updates join the chain between its grouped matmuls, on the sorted rows (`moe_jax.ops.lora`).
    """
    _check_experts_operands(hidden, expert_ids, weights, gate_up_proj, down_proj)
    num_experts = gate_up_proj.shape[0]
    top_k = expert_ids.shape[1]
    hidden, expert_ids, weights, gate_up_proj, down_proj = _varying_together(
        hidden, expert_ids, weights, gate_up_proj, down_proj)
    lora = _varying_like(lora, hidden)

    if not lora and gathers_experts(hidden.shape[0], top_k, gate_up_proj, down_proj):
        with experts_scope(GATHERED):
            return _gathered_swiglu(hidden, expert_ids, weights, gate_up_proj, down_proj, act)
    # Sentinel pairs sort to the tail and are outside group_sizes, so the grouped
    # matmuls treat them as padding rows: zero output, zero gradient.
    order, group_sizes = sort_by_expert(expert_ids, num_experts)
    x_sorted = gather_rows(hidden, order, top_k)  # [M, H]
    if lora:   # several adapters: each sorted row takes its token's
        lora = _sorted_adapter_rows(lora, order, top_k)
    y_sorted = grouped_swiglu(x_sorted, gate_up_proj, down_proj, group_sizes, act=act, backend=backend,
                              lora=lora)  # [M, H]

    # The expert output is already 0 there; masking the weight as well keeps a
    # non-finite sentinel weight out of the sum and its gradient exactly 0.
    mine = expert_ids < num_experts
    weights = jnp.where(mine, weights, jnp.zeros_like(weights))
    return unpermute(y_sorted, order, weights).astype(hidden.dtype)


# A few tokens' experts are gathered (each (token, choice) pair's weights, `_gathered_swiglu`) while those weights
# take at most this many bytes; past it the tile loop is as fast or faster: it copies one expert at a time, which
# its dots then read from cache, where the gathered experts spill to memory, and it copies an expert chosen twice
# once. Measured on CPU (forward, gathered bytes against gather / loop time): the gather wins below about 20 MB
# of gathered weights and loses from about 25 MB, whatever the expert count and sizes (docs/benchmarks.md,
# "Grouped matmul").
GATHERED_EXPERTS_MAX_BYTES = 24 << 20
# ... and while there are at most this many pairs (a decode step's, not a prompt's: 16 experts at H = I = 256, the
# gather was 0.72x the loop's time at 24 pairs, 1.07x at 32).
GATHERED_EXPERTS_MAX_PAIRS = 24


def gathers_experts(num_tokens: int, top_k: int, gate_up_proj: jax.Array, down_proj: jax.Array) -> bool:
    """Whether `swiglu_experts` runs `num_tokens` tokens by gathering each pair's expert weights (at most
    `GATHERED_EXPERTS_MAX_PAIRS` pairs and `GATHERED_EXPERTS_MAX_BYTES`) instead of sorting them through the tile
    loop."""
    if is_quantized(gate_up_proj) or is_quantized(down_proj):
        return False   # kept-quantised weights are decoded in the tile loop, one expert per visit
    pairs = num_tokens * top_k
    expert_bytes = sum(math.prod(w.shape[1:]) * jnp.dtype(w.dtype).itemsize for w in (gate_up_proj, down_proj))
    return pairs <= GATHERED_EXPERTS_MAX_PAIRS and pairs * expert_bytes <= GATHERED_EXPERTS_MAX_BYTES


GATHERED = "gathered"   # the experts' scope name of the per-pair path (a compiled program's HLO names it)


def _gathered_swiglu(hidden, expert_ids, weights, gate_up_proj, down_proj, act: Activation) -> jax.Array:
    """`swiglu_experts` for a few tokens (decoding): each (token, choice) pair's expert weights gathered and applied
    as M batched products, no sort and no tile loop. hidden: [N, H]; expert_ids, weights: [N, K] -> [N, H].

    What it saves is the loop's per-expert and per-visit work (one token's experts: about half the forward's
    time); what it pays is reading every pair's weights, an expert chosen
    twice twice (`gathers_experts` keeps it to few bytes). Dtypes as the tiled path's: h and the activation in
    result_type(hidden, gate_up), the down projection in result_type(that, down), dots summed in the accumulation
    dtype, the weighted sum over K in at least fp32."""
    num_experts = gate_up_proj.shape[0]
    num_tokens, top_k = expert_ids.shape
    inner = jnp.result_type(hidden.dtype, gate_up_proj.dtype)
    outer = jnp.result_type(inner, down_proj.dtype)
    pair_expert = expert_ids.reshape(-1)                                                        # [M]
    # A sentinel id (E, "not mine") gathers zero weights: a zero output, and its routing weight is masked below.
    w_gate_up = jnp.take(gate_up_proj, pair_expert, axis=0, mode="fill", fill_value=0).astype(inner)  # [M, 2I, H]
    w_down = jnp.take(down_proj, pair_expert, axis=0, mode="fill", fill_value=0).astype(outer)        # [M, H, I]
    # Batched products over the pairs, each token repeated per choice: the form XLA:CPU runs fastest (one token as
    # a matrix-vector contraction of its K gathered experts ran at twice the loop's time).
    x = jnp.repeat(hidden.astype(inner), top_k, axis=0)                                         # [M, H]
    h = jnp.einsum("mh,moh->mo", x, w_gate_up,
                   preferred_element_type=accumulation_dtype(inner)).astype(inner)               # [M, 2I]
    a = gated(h, act).astype(outer)                                                              # [M, I]
    y = jnp.einsum("mi,mhi->mh", a, w_down, preferred_element_type=accumulation_dtype(outer)).astype(outer)
    weights = jnp.where(expert_ids < num_experts, weights, jnp.zeros_like(weights))
    return accumulating_einsum("tkh,tk->th", y.reshape(num_tokens, top_k, y.shape[-1]), weights).astype(hidden.dtype)


def clamped_swiglu(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's activation. gate_up: [M, 2I], gate and up interleaved (gate = [:, 0::2], up = [:, 1::2])
    -> (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit): [M, I]."""
    gate = jnp.minimum(gate_up[:, 0::2], limit)
    up = jnp.clip(gate_up[:, 1::2], -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _bias_rows(bias: jax.Array, row_expert: jax.Array) -> jax.Array:
    """bias: [E, O], row_expert: [M] in [0, E] -> [M, O], zero for rows of expert E (padding)."""
    return jnp.take(bias, row_expert, axis=0, mode="fill", fill_value=0)


def biased_clamped_swiglu_experts(
    hidden: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate_up_proj: jax.Array,
    gate_up_proj_bias: jax.Array,
    down_proj: jax.Array,
    down_proj_bias: jax.Array,
    *,
    alpha: float = 1.702,
    limit: float = 7.0,
    backend: str | None = None,
    lora: ExpertsLora | None = None,
) -> jax.Array:
    """gpt-oss's experts (HF's `GptOssExperts`), dropless via sort -> grouped matmul -> unsort.

    hidden: [N, H]
    expert_ids: [N, K] int, local ids in [0, E]; E means "not mine"
    weights: [N, K] routing weights
    gate_up_proj: [E, H, 2I]  ([in, out] per expert, gate/up interleaved on the last dim), or kept quantised
        (`ops.quantized.MXFP4Experts`, stored [E, 2I, H] as the hub's blocks are)
    gate_up_proj_bias: [E, 2I]
    down_proj: [E, I, H], or kept quantised ([E, H, I])
    down_proj_bias: [E, H]
    returns [N, H] in hidden's dtype:
        out[n] = sum_k w[n, k] * ((clamped_swiglu(x[n] @ gate_up[e] + b[e]) @ down[e]) + db[e])
    lora: LoRA factors of gate_up_proj / down_proj; PEFT reads these weights as transposed (`is_transposed`), so
    a [E, r, H] / b [E, 2I, r] and a [E, r, I] / b [E, H, r] meet the rows as the other families' do.
    """
    # grouped_matmul takes HF's usual [E, out, in]; gpt-oss stores [E, in, out] (its quantised blocks: [E, out, in]).
    gate_up_proj, down_proj = _out_in(gate_up_proj), _out_in(down_proj)
    num_experts, two_i, hidden_size = gate_up_proj.shape
    if (hidden.ndim != 2 or hidden.shape[1] != hidden_size or two_i % 2
            or down_proj.shape != (num_experts, hidden_size, two_i // 2)
            or gate_up_proj_bias.shape != (num_experts, two_i) or down_proj_bias.shape != (num_experts, hidden_size)):
        raise ValueError(
            f"gpt-oss experts need hidden [N, H], gate_up_proj [E, 2I, H], gate_up_proj_bias [E, 2I], down_proj "
            f"[E, H, I], down_proj_bias [E, H] (out, in; HF stores the dense ones transposed); got {hidden.shape}, "
            f"{gate_up_proj.shape}, "
            f"{gate_up_proj_bias.shape}, {down_proj.shape}, {down_proj_bias.shape}."
        )
    top_k = expert_ids.shape[1]
    hidden, expert_ids, weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias = _varying_together(
        hidden, expert_ids, weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias)
    lora = _varying_like(lora, hidden)

    order, group_sizes = sort_by_expert(expert_ids, num_experts)
    x_sorted = gather_rows(hidden, order, top_k)  # [M, H]
    lora = _sorted_adapter_rows(lora, order, top_k)   # several adapters: each sorted row takes its token's
    # Expert of each sorted row; E for the sentinel rows past sum(group_sizes), which get no bias.
    row_expert = count_at_most(jnp.cumsum(group_sizes), jnp.arange(x_sorted.shape[0], dtype=jnp.int32))
    gate_up = adapted_grouped_matmul(x_sorted, gate_up_proj, group_sizes, lora.get("gate_up_proj"), backend=backend)
    gate_up = gate_up + _bias_rows(gate_up_proj_bias, row_expert)
    activated = clamped_swiglu(gate_up, alpha, limit)
    y_sorted = adapted_grouped_matmul(activated, down_proj, group_sizes, lora.get("down_proj"), backend=backend)
    y_sorted = y_sorted + _bias_rows(down_proj_bias, row_expert)

    mine = expert_ids < num_experts
    weights = jnp.where(mine, weights, jnp.zeros_like(weights))
    return unpermute(y_sorted, order, weights).astype(hidden.dtype)


def prescaled_swiglu_experts(
    hidden: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    act: Activation = jax.nn.silu,
    backend: str | None = None,
    lora: ExpertsLora | None = None,
) -> jax.Array:
    """Llama 4's experts (HF's `Llama4TextExperts`): the routing weight scales each expert's *input*.

    hidden: [N, H]; expert_ids: [N, K] local ids in [0, E] (E: "not mine"); weights: [N, K]
    gate_up_proj: [E, H, 2I] ([in, out], gate then up on the last dim); down_proj: [E, I, H]
    returns [N, H] in hidden's dtype:
        out[n] = sum_k down[e] (act(gate[e] (w[n, k] x[n])) * up[e] (w[n, k] x[n])),  e = expert_ids[n, k]

    The reference runs every expert on every token, the unchosen ones on zero inputs (which give exactly zero
    with SiLU); only the K chosen experts are computed here, the same sum at K/E of the FLOPs.

    lora: LoRA factors of gate_up_proj / down_proj. PEFT reads these [E, in, out] weights as [E, out, in] (HF does
    not mark them transposed), so its A holds the last dim: a [E, r, 2I] / b [E, H, r], a [E, r, H] / b [E, I, r],
    and the rows, meeting the weights as [E, out, in] = swapaxes(W), meet swapaxes(b) then swapaxes(a).
    """
    num_experts, hidden_size, two_i = gate_up_proj.shape
    if (hidden.ndim != 2 or hidden.shape[1] != hidden_size or two_i % 2
            or down_proj.shape != (num_experts, two_i // 2, hidden_size) or weights.shape != expert_ids.shape):
        raise ValueError(
            f"Llama 4 experts need hidden [N, H], expert_ids and weights [N, K], gate_up_proj [E, H, 2I], down_proj "
            f"[E, I, H]; got {hidden.shape}, {expert_ids.shape}, {weights.shape}, {gate_up_proj.shape}, "
            f"{down_proj.shape}."
        )
    top_k = expert_ids.shape[1]
    hidden, expert_ids, weights, gate_up_proj, down_proj = _varying_together(
        hidden, expert_ids, weights, gate_up_proj, down_proj)
    lora = _varying_like(lora, hidden)

    mine = expert_ids < num_experts
    weights = jnp.where(mine, weights, jnp.zeros_like(weights))
    order, group_sizes = sort_by_expert(expert_ids, num_experts)
    x_sorted = gather_rows(hidden, order, top_k)                                        # [M, H]
    row_weights = jnp.take(weights.reshape(-1), order)[:, None]                          # [M, 1]
    x_sorted = (x_sorted * row_weights).astype(hidden.dtype)
    oriented = _sorted_adapter_rows({name: _oriented(factors) for name, factors in lora.items()}, order, top_k)
    y_sorted = grouped_swiglu(x_sorted, jnp.swapaxes(gate_up_proj, 1, 2), jnp.swapaxes(down_proj, 1, 2),
                              group_sizes, act=act, backend=backend, lora=oriented)
    return unpermute(y_sorted, order, mine.astype(y_sorted.dtype)).astype(hidden.dtype)
