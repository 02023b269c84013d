"""Multi-head latent attention (MLA) of DeepSeek-V3, over HF-named parameters (`DeepseekV3Attention`).

    q        = q_b_proj(rms_norm(q_a_proj(x)))     (q_proj(x) when q_lora_rank is None)   [B, S, N, Dn + R]
    latent, k_rot = split(kv_a_proj_with_mqa(x), [C, R]);  latent = kv_a_layernorm(latent)  [B, S, C], [B, S, R]
    q[..., Dn:], k_rot = rope(q[..., Dn:]), rope(k_rot)        (k_rot is one head shared by all N)
    k_nope, v = split(kv_b_proj(latent) per head, [Dn, Dv]);  k = cat(k_nope, k_rot)     [B, T, N, Dn + R]
    out      = o_proj(softmax(q k^T * scale + mask) v)                                   [B, S, H]

Shapes: C = kv_lora_rank, R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim. A cache stores what
HF's does, the compressed pair (normed latent [B, T, 1, C], rotated shared key [B, T, 1, R]); keys and values
are expanded from the whole cache at each step, as the reference does (the "absorbed" form that attends in
the latent space is a decode optimisation not made here).

The attention core is `attention_core.attend` (masks, fused kernels); when Dv differs from Dn + R the values are
zero-padded to the key width and the output cut back, which leaves the result unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .attention_core import attend
from .linear import Constrain, linear, no_constraint
from .norms import rms_norm
from .rotary import rotate_heads

# DeepseekV3RMSNorm's default: q_a_layernorm and kv_a_layernorm are built without the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class LatentDims:
    """The sizes of one MLA layer (HF's config fields) and its logit scale."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def latent_query(params: Mapping, hidden: jax.Array, dims: LatentDims, cos: jax.Array, sin: jax.Array,
                 constrain: Constrain = no_constraint) -> jax.Array:
    """hidden: [B, S, H]; cos, sin: [B, S, R] -> rotated queries [B, S, N, Dn + R]."""
    if dims.q_lora_rank is None:
        q = constrain(linear(params["q_proj"], hidden), ("batch", "length", "heads"))
    else:
        compressed = constrain(linear(params["q_a_proj"], hidden), ("batch", "length", "q_lora"))
        compressed = rms_norm(params["q_a_layernorm"], compressed, LATENT_NORM_EPS)
        q = constrain(linear(params["q_b_proj"], compressed), ("batch", "length", "heads"))
    batch, seq = hidden.shape[:2]
    q = q.reshape(batch, seq, dims.num_heads, dims.qk_head_dim)
    q_pass, q_rot = q[..., :dims.qk_nope_head_dim], q[..., dims.qk_nope_head_dim:]
    q_rot = rotate_heads(q_rot, cos, sin, interleaved=dims.rope_interleave)
    return jnp.concatenate([q_pass, q_rot.astype(q_pass.dtype)], axis=-1)


def latent_compression(params: Mapping, hidden: jax.Array, dims: LatentDims, cos: jax.Array, sin: jax.Array,
                       constrain: Constrain = no_constraint) -> tuple[jax.Array, jax.Array]:
    """hidden: [B, S, H] -> (normed latent [B, S, 1, C], rotated shared key [B, S, 1, R]): what a cache keeps."""
    compressed = constrain(linear(params["kv_a_proj_with_mqa"], hidden), ("batch", "length", "kv_lora"))
    latent, k_rot = compressed[..., :dims.kv_lora_rank], compressed[..., dims.kv_lora_rank:]
    latent = rms_norm(params["kv_a_layernorm"], latent, LATENT_NORM_EPS)
    k_rot = rotate_heads(k_rot[:, :, None, :], cos, sin, interleaved=dims.rope_interleave)
    return latent[:, :, None, :], k_rot.astype(latent.dtype)


def expand_latent(params: Mapping, latent: jax.Array, k_rot: jax.Array, dims: LatentDims,
                  constrain: Constrain = no_constraint) -> tuple[jax.Array, jax.Array]:
    """latent: [B, T, 1, C], k_rot: [B, T, 1, R] -> keys [B, T, N, Dn + R], values [B, T, N, Dv]."""
    batch, length = latent.shape[:2]
    expanded = constrain(linear(params["kv_b_proj"], latent[:, :, 0]), ("batch", "length", "heads"))
    expanded = expanded.reshape(batch, length, dims.num_heads, dims.qk_nope_head_dim + dims.v_head_dim)
    k_nope, values = expanded[..., :dims.qk_nope_head_dim], expanded[..., dims.qk_nope_head_dim:]
    shared = jnp.broadcast_to(k_rot.astype(k_nope.dtype), (batch, length, dims.num_heads, dims.qk_rope_head_dim))
    return jnp.concatenate([k_nope, shared], axis=-1), values


def attend_latent(q: jax.Array, keys: jax.Array, values: jax.Array, dims: LatentDims,
                  core: Callable | None = None, **mask_options) -> jax.Array:
    """q: [B, S, N, Dq]; keys: [B, T, N, Dq]; values: [B, T, N, Dv] -> [B, S, N, Dv] (`attend`'s masking; core:
    None for `attend`, or its context-parallel form)."""
    width = max(q.shape[-1], values.shape[-1])
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])  # noqa: E731
    values = values.astype(q.dtype)
    out = (core or attend)(pad(q), pad(keys.astype(q.dtype)), pad(values), scale=dims.scale, **mask_options)
    return out[..., :dims.v_head_dim]


def latent_attention(params: Mapping, hidden: jax.Array, cos: jax.Array, sin: jax.Array, *, dims: LatentDims,
                     attention_mask: jax.Array | None = None, constrain: Constrain = no_constraint,
                     segment_ids: jax.Array | None = None, core: Callable | None = None) -> jax.Array:
    """Causal MLA over a full sequence (prefill / training).

    params: HF names (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj`; `kv_a_proj_with_mqa`,
    `kv_a_layernorm`, `kv_b_proj`, `o_proj`); hidden: [B, S, H]; cos, sin: [B, S, R]; attention_mask: [B, S]
    padding mask (1 = real token); segment_ids: [B, S] packed rows' document ids (`attention_core.attend`) -> [B, S, H]
    """
    batch, seq, _ = hidden.shape
    q = latent_query(params, hidden, dims, cos, sin, constrain)
    latent, k_rot = latent_compression(params, hidden, dims, cos, sin, constrain)
    keys, values = expand_latent(params, latent, k_rot, dims, constrain)
    out = attend_latent(q, keys, values, dims, core, key_padding_mask=attention_mask, segment_ids=segment_ids)
    return constrain(linear(params["o_proj"], out.reshape(batch, seq, -1)), ("batch", "sequence", "embed"))


def cached_latent_attention(params: Mapping, hidden: jax.Array, cos: jax.Array, sin: jax.Array, layer_kv, *,
                            dims: LatentDims, constrain: Constrain = no_constraint
                            ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """`latent_attention` for S new tokens against a cache (prefill into an empty cache, decode, or a prompt chunk).

    layer_kv: the layer's storage of (latents [.., 1, C], rotated keys [.., 1, R]) (`moe_jax.kv_cache`): it stores the new
        pair and runs the attention core (the stored pairs expanded to keys and values) over those each query sees
    -> (out [B, S, H], the stored arrays with the new tokens)
    """
    batch, seq, _ = hidden.shape
    q = latent_query(params, hidden, dims, cos, sin, constrain)
    latent, k_rot = latent_compression(params, hidden, dims, cos, sin, constrain)

    def core(q, latents, rotated_keys, **mask_options):
        keys, values = expand_latent(params, latents.astype(latent.dtype), rotated_keys, dims, constrain)
        return attend_latent(q, keys, values, dims, **mask_options)

    out, stored = layer_kv.attend(core, q, latent, k_rot)
    out = constrain(linear(params["o_proj"], out.reshape(batch, seq, -1)), ("batch", "sequence", "embed"))
    return out, stored
