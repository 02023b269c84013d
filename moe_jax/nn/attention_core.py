"""The attention core, after projection and rotation: softmax(q k^T * scale) v under the causal /
sliding-window / padding / document mask, and the variants the families need (grouped-query heads without
repeating keys, sinks, query chunks, fp16 widening, the query-block path for long prompts).

Masking semantics are those of `transformers.masking_utils`: query at index i sees key j iff `j <= i`,
`j > i - sliding_window` (a window of `sliding_window` keys including itself) and `key_padding_mask[j]`.
Masks compare each token's *index* in the key sequence (its cache slot), not its position.
A query that sees no key at all (a left-padding row) gets finite, meaningless output, like HF's eager path.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from ..ops.accumulation import widens_fp16
from .query_blocks import causal_block_attention


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
    where a mask rules them out) and "fused" under a mask cuDNN's kernel does not take are its XLA path."""
    implementation = "xla" if implementation in ("blocked", "fused") else implementation
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


def attention_for_device(device) -> str | None:
    """The `attend` implementation a model's step asks for on `device` (its mesh's first device, abstract target
    GPUs included, so a program compiled for GPUs on a CPU host is the one a GPU runs): "fused" on NVIDIA GPUs of
    compute capability >= 8.0 (cuDNN's fused flash attention where it takes the heads), "blocked" on a CPU (this
    module's own cores), None elsewhere or without a device (jax's choice on the host's default backend)."""
    if device is None:
        return None
    if device.platform == "cpu":
        return "blocked"
    capability = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and capability and int(str(capability).split(".")[0]) >= 8:
        return "fused"
    return None


def fused_kernel(q: jax.Array, padding: jax.Array | None) -> str:
    """What "fused" runs a whole causal sequence with: "cudnn" where cuDNN's fused flash attention takes these
    heads (fp16 / bf16, width <= 128 and a multiple of 8, no key-padding mask), else "xla". jax does not pick
    cuDNN by itself (its None is the XLA path); on an H100 the fused kernel ran Qwen3-30B-A3B's causal heads
    several times faster, forward and backward (docs/benchmarks.md, "GPU check").
    q: [B, S, N, D]; padding: the [B, 1, 1, T] key mask or None."""
    takes = (padding is None and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] % 8 == 0
             and q.shape[-1] <= 128)
    return "cudnn" if takes else "xla"


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None = None,
    key_padding_mask: jax.Array | None = None,
    query_index: jax.Array | None = None,
    sliding_window: int | None = None,
    implementation: Literal["xla", "cudnn", "blocked", "fused"] | None = None,
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
        CPU); "fused" = cuDNN's kernel for a whole causal sequence where it takes the heads (`fused_kernel`), else
        XLA's path (a model's step on a GPU: `attention_for_device`); otherwise passed to
        `jax.nn.dot_product_attention` ("cudnn" = fused flash attention on GPU, "xla" = its XLA path, None = its
        own choice)
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
        if implementation == "fused":
            implementation = fused_kernel(q, padding)
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
