"""Grouped-query self-attention of Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral, over HF-named parameters.

`attention` is the whole module (`*Attention.forward`); it is three composable steps so a KV-cache decode
path can reuse them unchanged:

    project_qkv   hidden -> q, k, v heads (bias, OLMoE full-width / Qwen3 per-head q/k RMSNorm, OLMoE clip)
    apply_rotary  (rotary.py) rotate q and k by precomputed cos/sin of each token's *position*
    attend        softmax(q k^T * scale) v under the causal / sliding-window / padding mask, where masking
                  uses each token's *index* in the key sequence (its cache slot), as HF's masks do

Positions (for RoPE) and indices (for masking) are separate on purpose: with left padding HF's `generate`
numbers positions from the first real token while masks still compare raw indices.

Masking semantics are those of `transformers.masking_utils`: query at index i sees key j iff `j <= i`,
`j > i - sliding_window` (a window of `sliding_window` keys including itself) and `key_padding_mask[j]`.
A query that sees no key at all (a left-padding row) gets finite, meaningless output, like HF's eager path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp

from ..ops.accumulation import widens_fp16
from .linear import Constrain, linear, no_constraint
from .norms import rms_norm
from .query_blocks import causal_block_attention
from .rotary import apply_rotary

QkNormKind = Literal["per_head", "full_width"]
QK_NORM_KINDS = ("per_head", "full_width")


def _check_projection(params: Mapping, name: str, out_features: int, what: str) -> None:
    if name not in params:
        raise KeyError(f"attention params have no {name!r}; expected HF names q_proj/k_proj/v_proj/o_proj")
    rows = params[name]["weight"].shape[0]
    if rows != out_features:
        raise ValueError(
            f"{name}.weight has {rows} output rows but {what} = {out_features}; "
            "check num_heads / num_kv_heads / head_dim against the checkpoint's config"
        )


def _check_qk_norm(params: Mapping, qk_norm_kind: QkNormKind | None) -> None:
    has_norm = "q_norm" in params or "k_norm" in params
    if qk_norm_kind is None and has_norm:
        raise ValueError(
            "attention params contain q_norm/k_norm but qk_norm_kind is None; pass qk_norm_kind='per_head' "
            "(Qwen3-MoE: RMSNorm over head_dim) or 'full_width' (OLMoE: RMSNorm over the whole projection)"
        )
    if qk_norm_kind is not None:
        if qk_norm_kind not in QK_NORM_KINDS:
            raise ValueError(f"qk_norm_kind must be one of {QK_NORM_KINDS} or None, got {qk_norm_kind!r}")
        if not ("q_norm" in params and "k_norm" in params):
            raise ValueError(
                f"qk_norm_kind={qk_norm_kind!r} needs both q_norm and k_norm in the attention params"
            )


def project_qkv(
    params: Mapping,
    hidden: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm_kind: QkNormKind | None = None,
    rms_norm_eps: float = 1e-6,
    clip_qkv: float | None = None,
    constrain: Constrain = no_constraint,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Query, key and value heads before RoPE.

    hidden: [B, S, H]  ->  q: [B, S, N, D], k: [B, S, K, D], v: [B, S, K, D]

    Order of operations is OLMoE's where they apply: projection (+ bias), full-width q/k RMSNorm, clamp of
    q, k and v to `[-clip_qkv, clip_qkv]`, split into heads, then Qwen3's per-head q/k RMSNorm.
    """
    _check_projection(params, "q_proj", num_heads * head_dim, "num_heads * head_dim")
    _check_projection(params, "k_proj", num_kv_heads * head_dim, "num_kv_heads * head_dim")
    _check_projection(params, "v_proj", num_kv_heads * head_dim, "num_kv_heads * head_dim")
    _check_qk_norm(params, qk_norm_kind)

    q = constrain(linear(params["q_proj"], hidden), ("batch", "length", "heads"))      # [B, S, N*D]
    k = constrain(linear(params["k_proj"], hidden), ("batch", "length", "kv_heads"))   # [B, S, K*D]
    v = constrain(linear(params["v_proj"], hidden), ("batch", "length", "kv_heads"))

    if qk_norm_kind == "full_width":
        q = rms_norm(params["q_norm"], q, rms_norm_eps)
        k = rms_norm(params["k_norm"], k, rms_norm_eps)
    if clip_qkv is not None:
        q = jnp.clip(q, -clip_qkv, clip_qkv)
        k = jnp.clip(k, -clip_qkv, clip_qkv)
        v = jnp.clip(v, -clip_qkv, clip_qkv)

    batch, seq = hidden.shape[:2]
    q = q.reshape(batch, seq, num_heads, head_dim)
    k = k.reshape(batch, seq, num_kv_heads, head_dim)
    v = v.reshape(batch, seq, num_kv_heads, head_dim)

    if qk_norm_kind == "per_head":
        q = rms_norm(params["q_norm"], q, rms_norm_eps)
        k = rms_norm(params["k_norm"], k, rms_norm_eps)
    return q, k, v


def _check_sliding_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(
            f"sliding_window must be a positive int (keys visible per query, itself included) or None, got "
            f"{sliding_window!r}; Qwen2-MoE stores 0 when use_sliding_window=False, which means None here"
        )


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """segment_ids: [B, T] -> [B, T] the index of the first token of each token's segment (packed rows)."""
    index = jnp.arange(segment_ids.shape[1])
    changes = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                              axis=1)
    return jax.lax.cummax(jnp.where(changes, index[None, :], 0), axis=1)


def visibility_mask(
    query_index: jax.Array,
    num_keys: int,
    *,
    key_padding_mask: jax.Array | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
    segments: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Which keys each query may attend to.

    query_index: [B, S] index of each query's own token among the keys
    key_padding_mask: [B, T] bool, True for real tokens
    chunk_size: Llama 4's chunked attention: a query sees only keys of its own chunk of `chunk_size` tokens,
        chunks counted from each row's first real token (HF's `chunked_overlay` with its left padding), or from
        its document's first token in a packed row
    segments: (query segment ids [B, S], key segment ids [B, T]) of packed rows: a query sees only keys of its
        own document (equal ids; 0 is padding)
    -> [B, 1, S, T] bool (broadcast over heads)
    """
    key_index = jnp.arange(num_keys)
    visible = key_index[None, None, :] <= query_index[:, :, None]
    if sliding_window is not None:
        visible &= key_index[None, None, :] > query_index[:, :, None] - sliding_window
    if segments is not None:
        query_segments, key_segments = segments
        visible &= query_segments[:, :, None] == key_segments[:, None, :]
    if chunk_size is not None:
        if segments is not None:   # chunks from each document's first token
            starts = segment_starts(segments[1])
            key_start = starts[:, None, :]
            query_start = jnp.take_along_axis(starts, jnp.clip(query_index, 0, num_keys - 1), axis=1)[:, :, None]
        else:
            left_padding = (jnp.zeros((query_index.shape[0],), jnp.int32) if key_padding_mask is None else
                            jnp.sum(jnp.cumsum(key_padding_mask.astype(jnp.int32), axis=1) == 0, axis=1))
            key_start = query_start = left_padding[:, None, None]
        key_chunk = (key_index[None, None, :] - key_start) // chunk_size
        visible &= key_chunk == (query_index[:, :, None] - query_start) // chunk_size
    if key_padding_mask is not None:
        visible &= key_padding_mask[:, None, :]
    return visible[:, None, :, :]


def _attend_query_chunks(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    query_index: jax.Array,
    key_padding_mask: jax.Array | None,
    sliding_window: int | None,
    scale: float,
    implementation: str | None,
    chunk_size: int,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """`attend` one block of queries at a time: the score matrix in flight is [B, N, chunk, T], not [B, N, S, T].

    Each block is rematerialised in the backward pass, so its scores are not kept for the gradient either.
    """
    batch, seq, heads, dim = q.shape
    num_chunks = -(-seq // chunk_size)
    pad = num_chunks * chunk_size - seq
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    # Index -1 sees no key; these filler rows are dropped below.
    query_index = jnp.pad(query_index, ((0, 0), (0, pad)), constant_values=-1)
    q_chunks = q.reshape(batch, num_chunks, chunk_size, heads, dim).swapaxes(0, 1)
    index_chunks = query_index.reshape(batch, num_chunks, chunk_size).swapaxes(0, 1)
    # Segment -1 matches no key: the filler rows see nothing.
    query_segments = (jnp.zeros_like(query_index) if segment_ids is None else
                      jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1))
    segment_chunks = query_segments.reshape(batch, num_chunks, chunk_size).swapaxes(0, 1)

    @jax.checkpoint
    def attend_chunk(chunk: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        q_chunk, index_chunk, segment_chunk = chunk
        mask = visibility_mask(
            index_chunk, k.shape[1], key_padding_mask=key_padding_mask, sliding_window=sliding_window,
            segments=None if segment_ids is None else (segment_chunk, segment_ids),
        )
        return _masked_attention(q_chunk, k, v, mask=mask, scale=scale, implementation=implementation)

    out = jax.lax.map(attend_chunk, (q_chunks, index_chunks, segment_chunks))
    return out.swapaxes(0, 1).reshape(batch, num_chunks * chunk_size, heads, dim)[:, :seq]


def _dot_product_attention(q, k, v, *, implementation, **options) -> jax.Array:
    """`jax.nn.dot_product_attention`, also for fp16 on XLA:CPU (`_widening_fp16`); "blocked" (query blocks,
    where a mask rules them out) is its XLA path."""
    implementation = "xla" if implementation == "blocked" else implementation
    return _widening_fp16(jax.nn.dot_product_attention, q, k, v, implementation=implementation, **options)


def _masked_attention(q, k, v, *, mask, scale, implementation) -> jax.Array:
    """Attention under an explicit [B, 1, S, T] mask: `grouped_masked_attention` where no fused kernel was asked
    for (None on CPU, or "blocked"; the same numerics as jax's XLA path, without its per-query-head layout
    copies), else `jax.nn.dot_product_attention`."""
    if _takes_own_cpu_core(implementation):
        return _widening_fp16(grouped_masked_attention, q, k, v, mask=mask, scale=scale)
    return _dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)


MASKED_LOGIT = -0.7 * float(jnp.finfo(jnp.float32).max)   # jax's XLA path's: finite, so no NaN for unseen rows


def grouped_masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array, scale: float,
                             sinks: jax.Array | None = None) -> jax.Array:
    """Attention under an explicit mask, a key/value head's G query heads in one dot.

    q: [B, S, N, D]; k, v: [B, T, K, D] (query head n reads key/value head n // G, G = N / K); mask: [B, 1, S, T]
    bool; sinks: [N] gpt-oss's per-head sink logits (one more softmax column that takes probability and no value)
    or None -> [B, S, N, D] in v's dtype

    Numerics of `jax.nn.dot_product_attention`'s XLA path: logits in float32 (or wider), masked logits
    -0.7 * float32 max (a query that sees no key gets equal weights on every key), softmax in float32, the weights
    cast to the keys' dtype for the value sum. That path takes each query head against its own key/value copy
    (a vmap over G whose layouts XLA:CPU transposes: a serving decode program is slower with it than with this;
    docs/benchmarks.md, "Attention").
    """
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    logits_dtype = jnp.promote_types(q.dtype, jnp.float32)
    grouped = q.reshape(batch, seq, kv_heads, groups, dim)
    logits = jnp.einsum("bskgd,btkd->bkgst", grouped, k, preferred_element_type=logits_dtype)
    logits = logits * jnp.asarray(scale, logits_dtype)
    logits = jnp.where(mask[:, :, None], logits, MASKED_LOGIT).astype(jnp.float32)          # [B, K, G, S, T]
    if sinks is None:
        weights = jax.nn.softmax(logits, axis=-1)
    else:
        if sinks.shape != (heads,):
            raise ValueError(f"sinks must be [num_heads] = [{heads}], got shape {tuple(sinks.shape)}.")
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1, 1),
                                (*logits.shape[:-1], 1))
        weights = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    # Summed into [B, K, G, S, D] (the dot's natural layout) and transposed after: asking the einsum for
    # [B, S, K, G, D] directly made XLA:CPU transpose the gathered values instead (twice the time of a decode layer).
    out = jnp.einsum("bkgst,btkd->bkgsd", weights.astype(k.dtype), v)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, heads, dim)


def _widening_fp16(core, q, k, v, **options) -> jax.Array:
    """core(q, k, v, **options), with fp16 operands widened to fp32 on XLA:CPU.

    The cores compute fp16 logits as an fp16 x fp16 -> fp32 dot, which XLA:CPU does not implement. fp16
    operands are widened to fp32 there (exact, and fp16 products are exact in fp32, so the logits are the same);
    the softmax weights then stay fp32 for the value sum, and the output returns in fp16. Elsewhere fp16 goes in
    as is.
    """
    if q.dtype != jnp.float16 or not widens_fp16():
        return core(q, k, v, **options)
    q, k, v = (array.astype(jnp.float32) for array in (q, k, v))
    return core(q, k, v, **options).astype(jnp.float16)


def _takes_own_cpu_core(implementation: str | None) -> bool:
    """Whether attention takes this module's own cores (query blocks for a whole causal sequence,
    `grouped_masked_attention` under an explicit mask) rather than `jax.nn.dot_product_attention`: "blocked", or no
    choice on CPU, where no fused kernel exists (elsewhere None lets jax pick one)."""
    return implementation == "blocked" or (implementation is None and jax.default_backend() == "cpu")


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None = None,
    key_padding_mask: jax.Array | None = None,
    query_index: jax.Array | None = None,
    sliding_window: int | None = None,
    implementation: Literal["xla", "cudnn", "blocked"] | None = None,
    query_chunk_size: int | None = None,
    sinks: jax.Array | None = None,
    attention_chunk_size: int | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-query attention core (softmax in float32), via `jax.nn.dot_product_attention`.

    q: [B, S, N, D]; k, v: [B, T, K, D] with N a multiple of K (query head n reads key/value head n // (N/K),
    HF's `repeat_kv` grouping)  ->  [B, S, N, D]
    scale: logit scale, default `D ** -0.5`
    key_padding_mask: [B, T], nonzero / True for real tokens
    query_index: [B, S] or [S] index of each query among the keys; default `T - S + arange(S)` (the queries
        are the last S keys: prefill when T == S, or decode against a cache holding exactly T keys)
    sliding_window: keys visible per query, itself included (HF semantics), or None for full causal
    implementation: "blocked" = `query_blocks.causal_block_attention` for a whole causal sequence (None picks it on
        CPU); otherwise passed to `jax.nn.dot_product_attention` ("cudnn" = fused flash
        attention on GPU, "xla" = its XLA path, None = its own choice)
    query_chunk_size: attend this many queries at a time to bound the score memory of the XLA path
    sinks: [N] gpt-oss's learned per-head sink logits: one more softmax column per head that takes
        probability and no value (`attend_with_sinks`; chunking and fused kernels do not apply)
    attention_chunk_size: Llama 4's chunked attention (`visibility_mask`'s `chunk_size`; the mask is explicit)
    segment_ids: [B, S] packed rows' document ids (0: padding; S == T, no cache): a query sees only its own
        document's keys, and chunks count from each document's first token (the mask is explicit)

    When `T == S` and no `query_index` is given (and no chunking happens), the mask is expressed as `is_causal` and
    `local_window_size` so fused kernels can skip masked blocks instead of reading an [S, T] mask.
    """
    _check_sliding_window(sliding_window)
    batch, seq = q.shape[:2]
    num_keys = k.shape[1]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, num_keys):
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected [B, T] = {(batch, num_keys)} "
                "(HF's 2D attention_mask covering every key, cached ones included)"
            )
        key_padding_mask = key_padding_mask.astype(bool)
    if query_chunk_size is not None and query_chunk_size < 1:
        raise ValueError(f"query_chunk_size must be a positive int or None, got {query_chunk_size}")
    in_chunks = (query_chunk_size is not None and query_chunk_size < seq and sinks is None
                 and attention_chunk_size is None)

    if segment_ids is not None and segment_ids.shape != (batch, num_keys):
        raise ValueError(f"segment_ids has shape {tuple(segment_ids.shape)}, expected [B, T] = {(batch, num_keys)}: "
                         "packed rows attend within themselves (no cache).")
    if (query_index is None and not in_chunks and seq == num_keys and sinks is None and attention_chunk_size is None
            and segment_ids is None):
        if _takes_own_cpu_core(implementation):
            return _widening_fp16(causal_block_attention, q, k, v, scale=scale, sliding_window=sliding_window,
                                  key_padding_mask=key_padding_mask)
        padding = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
        window = None if sliding_window is None else (sliding_window - 1, 0)
        return _dot_product_attention(
            q,
            k,
            v,
            mask=padding,
            scale=scale,
            is_causal=True,
            local_window_size=window,
            implementation=implementation,
        )

    if query_index is None:
        query_index = jnp.arange(num_keys - seq, num_keys)
    query_index = jnp.broadcast_to(jnp.asarray(query_index), (batch, seq))

    if in_chunks:
        return _attend_query_chunks(
            q,
            k,
            v,
            query_index=query_index,
            key_padding_mask=key_padding_mask,
            sliding_window=sliding_window,
            scale=scale,
            implementation=implementation,
            chunk_size=query_chunk_size,
            segment_ids=segment_ids,
        )
    mask = visibility_mask(
        query_index, num_keys, key_padding_mask=key_padding_mask, sliding_window=sliding_window,
        chunk_size=attention_chunk_size, segments=None if segment_ids is None else (segment_ids, segment_ids),
    )
    if sinks is not None:
        return attend_with_sinks(q, k, v, mask, sinks, scale)
    return _masked_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)


def attend_with_sinks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sinks: jax.Array,
                      scale: float) -> jax.Array:
    """Attention whose softmax has one extra column per head, the learned sink logit, dropped after the
    softmax (HF's gpt-oss eager attention): the sink absorbs probability, so a head may attend to little.

    q: [B, S, N, D]; k, v: [B, T, K, D]; mask: [B, 1, S, T] bool; sinks: [N] -> [B, S, N, D]
    (`grouped_masked_attention`'s numerics; fp16 operands are widened to fp32 first on CPU).
    """
    return _widening_fp16(grouped_masked_attention, q, k, v, mask=mask, scale=scale, sinks=sinks)


def attention(
    params: Mapping,
    hidden: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    attention_mask: jax.Array | None = None,
    sliding_window: int | None = None,
    qk_norm_kind: QkNormKind | None = None,
    rms_norm_eps: float = 1e-6,
    clip_qkv: float | None = None,
    implementation: Literal["xla", "cudnn", "blocked"] | None = None,
    query_chunk_size: int | None = None,
    constrain: Constrain = no_constraint,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention over a full sequence (prefill / training), as HF's `*Attention.forward`.

    params: `{"q_proj", "k_proj", "v_proj", "o_proj": {"weight": [out, in], "bias"?: [out]},
              "q_norm"?, "k_norm"?: {"weight": [D] per_head | [N*D], [K*D] full_width}, "sinks"?: [N]}`
    hidden: [B, S, H]; cos, sin: [B, S, D] from `rotary_cos_sin` (positions may be arbitrary, e.g. offset)
    attention_mask: [B, S] padding mask, 1 = real token, 0 = padding (left or right)
    sliding_window: Mixtral / Qwen2-MoE / Qwen3-MoE window (keys per query, itself included), None for full
    qk_norm_kind: "per_head" (Qwen3-MoE), "full_width" (OLMoE) or None (Qwen2-MoE, Mixtral)
    clip_qkv: OLMoE's `config.clip_qkv`
    constrain: lays out each projection's output by its dims' logical axes (`moe_jax.nn.linear.Constrain`)
    segment_ids: [B, S] packed rows' document ids (`attend`)
    -> [B, S, H]

    The logit scale is `head_dim ** -0.5`, as in all four models.
    """
    batch, seq, _ = hidden.shape
    q, k, v = project_qkv(
        params,
        hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        qk_norm_kind=qk_norm_kind,
        rms_norm_eps=rms_norm_eps,
        clip_qkv=clip_qkv,
        constrain=constrain,
    )
    q, k = apply_rotary(q, k, cos, sin)
    # A float32 norm weight or rope table would promote q/k alone (HF would fail on the mixed-dtype matmul);
    # attention runs in the value projection's dtype.
    q, k = q.astype(v.dtype), k.astype(v.dtype)
    out = attend(
        q,
        k,
        v,
        scale=head_dim**-0.5,
        key_padding_mask=attention_mask,
        sliding_window=sliding_window,
        implementation=implementation,
        query_chunk_size=query_chunk_size,
        sinks=params.get("sinks"),
        segment_ids=segment_ids,
    )
    out = out.reshape(batch, seq, num_heads * head_dim)
    return constrain(linear(params["o_proj"], out), ("batch", "length", "embed"))


def cached_attention(
    params: Mapping,
    hidden: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    layer_kv,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None = None,
    qk_norm_kind: QkNormKind | None = None,
    rms_norm_eps: float = 1e-6,
    clip_qkv: float | None = None,
    implementation: Literal["xla", "cudnn", "blocked"] | None = None,
    constrain: Constrain = no_constraint,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """`attention` for S new tokens against a KV cache (prefill into an empty cache, decode, or a chunk of a
    prompt joining a continuous batch).

    hidden: [B, S, H]; cos, sin: [B, S, D] at the new tokens' positions
    layer_kv: the layer's storage (`moe_jax.kv_cache`): it stores the new keys and values and runs the attention core
        over the keys each query sees
    -> (out [B, S, H], the layer's stored arrays with the new tokens)

    Masking is `attend`'s (causal by key index, sliding window, padding). A ring of `sliding_window - 1`
    tokens is all a query can see besides itself and the other new tokens.
    """
    batch, seq, _ = hidden.shape
    q, k, v = project_qkv(
        params, hidden, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        qk_norm_kind=qk_norm_kind, rms_norm_eps=rms_norm_eps, clip_qkv=clip_qkv, constrain=constrain,
    )
    q, k = apply_rotary(q, k, cos, sin)
    q, k = q.astype(v.dtype), k.astype(v.dtype)

    def core(q, keys, values, **mask_options):
        return attend(q, keys.astype(v.dtype), values.astype(v.dtype), scale=head_dim**-0.5,
                      sliding_window=sliding_window, implementation=implementation, sinks=params.get("sinks"),
                      **mask_options)

    out, stored = layer_kv.attend(core, q, k, v)
    out = constrain(linear(params["o_proj"], out.reshape(batch, seq, num_heads * head_dim)),
                    ("batch", "length", "embed"))
    return out, stored
