"""Grouped-query self-attention of Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral, over HF-named parameters.

`attention` is the whole module (`*Attention.forward`); it is three composable steps so a KV-cache decode
path can reuse them unchanged:

    project_qkv   hidden -> q, k, v heads (bias, OLMoE full-width / Qwen3 per-head q/k RMSNorm, OLMoE clip)
    apply_rotary  (rotary.py) rotate q and k by precomputed cos/sin of each token's *position*
    attend        (attention_core.py) softmax(q k^T * scale) v under the causal / sliding-window / padding
                  mask, where masking uses each token's *index* in the key sequence (its cache slot), as HF's
                  masks do

Positions (for RoPE) and indices (for masking) are separate on purpose: with left padding HF's `generate`
numbers positions from the first real token while masks still compare raw indices.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import jax
import jax.numpy as jnp

from .attention_core import attend
from .linear import Constrain, linear, no_constraint
from .norms import rms_norm
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
    implementation: Literal["xla", "cudnn", "blocked", "fused"] | None = None,
    query_chunk_size: int | None = None,
    constrain: Constrain = no_constraint,
    segment_ids: jax.Array | None = None,
    core: Callable | None = None,
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
    core: the attention core: None for `attend`, or its context-parallel form (`nn.context_attention`)
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
    out = (core or attend)(
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
    return constrain(linear(params["o_proj"], out), ("batch", "sequence", "embed"))


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
    implementation: Literal["xla", "cudnn", "blocked", "fused"] | None = None,
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
                    ("batch", "sequence", "embed"))
    return out, stored
