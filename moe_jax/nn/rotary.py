"""Rotary position embeddings (RoPE) as Hugging Face Transformers computes them.

Three steps, split so a model can compute the tables once per forward and every layer reuses them:

1. `rope_parameters_from_config(config)` reads a transformers config (object or dict) into `RopeParameters`.
2. `rope_inverse_frequencies(rope)` -> `(inv_freq [D/2], attention_scaling)`, per rope type, like
   `ROPE_INIT_FUNCTIONS` (`dynamic_ntk_inverse_frequencies` is the runtime update of the "dynamic" type).
3. `rotary_cos_sin(positions, inv_freq, attention_scaling)` -> cos, sin `[B, S, D]`, and
   `apply_rotary(q, k, cos, sin)` with HF's rotate-half convention (the two halves of each head are the
   real/imaginary parts, not interleaved pairs).

The inverse frequencies are static configuration, so they are computed on the host with numpy. HF computes
`base ** (i / dim)` with a float32 `torch.pow` that is not correctly rounded; we compute that power in float64
and round it once, then follow HF's remaining float32 steps operation by operation. `inv_freq` is therefore
identical on every backend and within a few float32 ulps of torch's (measured: 2 ulps for the plain table,
4 in llama3's smoothing band), an angle error of about 1e-7 per unit of position.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

# HF's `RotaryEmbeddingConfigMixin.default_theta` is 10000 except where a config class overrides it. Only
# needed for a raw dict (e.g. config.json) that states no `rope_theta` at all.
_DEFAULT_THETA_BY_MODEL_TYPE = {"mixtral": 1_000_000.0, "gpt_oss": 150_000.0, "llama4_text": 500_000.0}
_DEFAULT_THETA = 10_000.0


@dataclass(frozen=True)
class RopeParameters:
    """Everything the rotary tables depend on. Frozen and hashable, so it can be a static jit argument.

    Field names follow HF's `config.rope_parameters` keys; `head_dim` and `max_position_embeddings` come from
    the top level of the config.
    """

    rope_type: str
    rope_theta: float
    head_dim: int
    max_position_embeddings: int
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}. "
                "Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral checkpoints use 'default' (or 'yarn'/'linear'/'dynamic' "
                "when extended)."
            )
        if self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        needs_factor = self.rope_type in ("linear", "dynamic", "llama3")
        if needs_factor and self.factor is None:
            raise ValueError(
                f"rope_type {self.rope_type!r} needs rope_parameters['factor'], which is missing"
            )
        if self.rope_type == "llama3" and (self.low_freq_factor is None or self.high_freq_factor is None):
            raise ValueError(
                "rope_type 'llama3' needs rope_parameters['low_freq_factor'] and ['high_freq_factor']"
            )
        # HF's "default" init ignores partial_rotary_factor; the scaled types honour it, and then the tables no
        # longer cover the whole head, which these models' full-head `apply_rotary_pos_emb` cannot consume.
        if self.rope_type != "default" and self.partial_rotary_factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} with rope_type {self.rope_type!r} rotates only "
                "part of each head, which Qwen3-MoE/Qwen2-MoE/OLMoE/Mixtral attention does not support; remove it"
            )

    @property
    def rotary_dim(self) -> int:
        """Width of the rotated part of each head (all of it for these models)."""
        if self.rope_type == "default":
            return self.head_dim
        return int(self.head_dim * self.partial_rotary_factor)


def _config_values(config: Any) -> dict[str, Any]:
    """The config fields RoPE depends on, from a config object or a dict (missing fields are absent)."""
    names = (
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "partial_rotary_factor",
        "model_type",
        "head_dim",
        "hidden_size",
        "num_attention_heads",
        "max_position_embeddings",
        "original_max_position_embeddings",
    )
    if isinstance(config, Mapping):
        return {name: config[name] for name in names if name in config}
    if hasattr(config, "num_attention_heads"):
        return {name: getattr(config, name) for name in names if hasattr(config, name)}
    raise TypeError(
        f"expected a transformers config or its dict, got {type(config).__name__}; "
        "pass `AutoConfig.from_pretrained(...)` or the parsed config.json"
    )


def rope_parameters_from_config(config: Any) -> RopeParameters:
    """Read the RoPE settings of a transformers config object, `config.to_dict()`, or a parsed config.json.

    Follows transformers 5.x: `rope_parameters` is the source of truth; legacy `rope_scaling` (with `type`
    or `rope_type`) and a top-level `rope_theta` are accepted as HF's `standardize_rope_params` accepts them.
    `head_dim` falls back to `hidden_size // num_attention_heads` when absent or None, as HF's modules do.
    """
    values = _config_values(config)
    missing = [
        name
        for name in ("hidden_size", "num_attention_heads", "max_position_embeddings")
        if name not in values
    ]
    if missing:
        raise KeyError(f"the config has no {missing}; pass the model's full config (config.json / to_dict())")
    rope = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    if any(isinstance(v, Mapping) for v in rope.values()):
        raise ValueError(
            f"rope_parameters is nested per layer type ({sorted(rope)}); these models use one global RoPE. "
            "Pass a dict whose 'rope_parameters' is the entry for the layer type you need."
        )
    model_type = values.get("model_type")
    rope.setdefault(
        "rope_theta", values.get("rope_theta") or _DEFAULT_THETA_BY_MODEL_TYPE.get(model_type, _DEFAULT_THETA)
    )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", values.get("partial_rotary_factor")) or 1.0

    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    max_position_embeddings = values["max_position_embeddings"]
    original_max = rope.get("original_max_position_embeddings")
    if rope_type in ("yarn", "llama3"):
        # HF's standardisation: a top-level value wins, else the current maximum.
        original_max = (
            values.get("original_max_position_embeddings") or original_max or max_position_embeddings
        )

    # HF reads `rope_parameters.get("truncate", True)`: only a missing key means True.
    truncate = rope.get("truncate", True)
    return RopeParameters(
        rope_type=rope_type,
        rope_theta=float(rope["rope_theta"]),
        head_dim=int(head_dim),
        max_position_embeddings=int(max_position_embeddings),
        factor=rope.get("factor"),
        original_max_position_embeddings=original_max,
        attention_factor=rope.get("attention_factor"),
        beta_fast=rope.get("beta_fast"),
        beta_slow=rope.get("beta_slow"),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        truncate=bool(truncate),
        low_freq_factor=rope.get("low_freq_factor"),
        high_freq_factor=rope.get("high_freq_factor"),
        partial_rotary_factor=float(partial),
    )


def _frequency_exponents(dim: int) -> np.ndarray:
    """`arange(0, dim, 2) / dim` in float32, as HF builds it. [D/2]"""
    return np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)


def _base_powers(base: float, dim: int) -> np.ndarray:
    """`base ** (arange(0, dim, 2) / dim)` rounded to float32. [D/2]"""
    exponents = _frequency_exponents(dim).astype(np.float64)
    return np.power(np.float64(base), exponents).astype(np.float32)


def _default_inverse_frequencies(rope: RopeParameters) -> np.ndarray:
    return np.float32(1.0) / _base_powers(rope.rope_theta, rope.rotary_dim)


def _linear_inverse_frequencies(rope: RopeParameters) -> np.ndarray:
    # Scaling positions by 1/factor equals scaling the frequencies by 1/factor.
    return _default_inverse_frequencies(rope) / np.float32(rope.factor)


def _reciprocal_times(scalar: float, values: np.ndarray) -> np.ndarray:
    """`scalar / values` rounded as torch rounds it: `Tensor.__rtruediv__` is `reciprocal(values) * scalar`."""
    return (np.float32(1.0) / values) * np.float32(scalar)


def _llama3_inverse_frequencies(rope: RopeParameters) -> np.ndarray:
    inv_freq = _default_inverse_frequencies(rope)
    factor = np.float32(rope.factor)
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = np.float32(old_context_len / rope.low_freq_factor)
    high_freq_wavelen = np.float32(old_context_len / rope.high_freq_factor)

    wavelen = _reciprocal_times(2 * math.pi, inv_freq)
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated smoothly.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (_reciprocal_times(old_context_len, wavelen) - np.float32(rope.low_freq_factor)) / np.float32(
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (np.float32(1.0) - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_scale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inverse_frequencies(rope: RopeParameters) -> tuple[np.ndarray, float]:
    base = rope.rope_theta
    dim = rope.rotary_dim
    original_max = rope.original_max_position_embeddings
    factor = rope.factor
    if factor is None:
        factor = rope.max_position_embeddings / original_max

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(
                _yarn_scale(factor, rope.mscale) / _yarn_scale(factor, rope.mscale_all_dim)
            )
        else:
            attention_factor = _yarn_scale(factor)

    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times into the original context.
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp

    pos_freqs = _base_powers(base, dim)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    extrapolation_weight = np.float32(1.0) - np.clip(ramp, 0, 1)
    inv_freq = interpolation * (np.float32(1.0) - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_inverse_frequencies(rope: RopeParameters) -> tuple[np.ndarray, float]:
    """`(inv_freq [D/2] float32, attention_scaling)` as HF's rotary module holds them after `__init__`.

    For "dynamic" this is the table for sequences up to `max_position_embeddings` (HF's initial state); use
    `dynamic_ntk_inverse_frequencies` for longer sequences.
    """
    if rope.rope_type in ("default", "dynamic"):
        return _default_inverse_frequencies(rope), 1.0
    if rope.rope_type == "linear":
        return _linear_inverse_frequencies(rope), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inverse_frequencies(rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope)
    raise AssertionError(f"unreachable: rope_type {rope.rope_type!r} passed validation")


def dynamic_ntk_inverse_frequencies(rope: RopeParameters, seq_len: jax.Array | int) -> jax.Array:
    """Dynamic-NTK `inv_freq [D/2]` for a forward whose largest position is `seq_len - 1` (traceable).

    HF's "dynamic" rope grows the rotary base once `seq_len = max(position_ids) + 1` exceeds
    `max_position_embeddings` and keeps the original table otherwise. HF caches the grown table on the module
    and keeps using it for later calls that are shorter but still beyond `max_position_embeddings`; this
    function is stateless and always uses the current `seq_len`, which is what HF does for a fresh module and
    for step-by-step generation (where `seq_len` only grows).
    """
    if rope.rope_type != "dynamic":
        raise ValueError(f"dynamic_ntk_inverse_frequencies needs rope_type 'dynamic', got {rope.rope_type!r}")
    dim = rope.rotary_dim
    max_pos = rope.max_position_embeddings
    seq_len = jnp.asarray(seq_len)
    grown_len = jnp.maximum(seq_len, max_pos).astype(jnp.float32)
    factor = jnp.float32(rope.factor)
    growth = (factor * grown_len / jnp.float32(max_pos)) - (factor - 1)
    base = jnp.float32(rope.rope_theta) * growth ** jnp.float32(dim / (dim - 2))
    grown = 1.0 / (base ** jnp.asarray(_frequency_exponents(dim)))
    original = jnp.asarray(_default_inverse_frequencies(rope))
    return jnp.where(seq_len > max_pos, grown, original)


def rotary_cos_sin(
    positions: jax.Array,
    inv_freq: jax.Array | np.ndarray,
    attention_scaling: float = 1.0,
    *,
    dtype: jnp.dtype = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """The cos/sin tables for token positions, as HF's `*RotaryEmbedding.forward`.

    positions: [B, S] integer positions (HF's `position_ids`)
    inv_freq: [D/2] float32
    -> cos, sin: [B, S, D] in `dtype` (HF casts to the hidden states' dtype), scaled by `attention_scaling`.

    Angles and their cos/sin are computed in float32 whatever `dtype` is, as HF does.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    # Both halves of the head share the frequencies (rotate-half layout).
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos = jnp.cos(angles) * attention_scaling
    sin = jnp.sin(angles) * attention_scaling
    return cos.astype(dtype), sin.astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    """`[x1, x2] -> [-x2, x1]` over the last axis. x: [..., D]"""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotate queries and keys by their positions' angles, as HF's `apply_rotary_pos_emb`.

    q: [B, S, N, D], k: [B, S, K, D] (heads-after-sequence layout, unlike HF's [B, N, S, D])
    cos, sin: [B, S, D] from `rotary_cos_sin`
    -> q, k with their input shapes; dtype follows `promote(q.dtype, cos.dtype)` as in torch.
    """
    if cos.shape[-1] != q.shape[-1] or sin.shape != cos.shape:
        raise ValueError(
            f"apply_rotary: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [B, S, head_dim] with "
            f"head_dim={q.shape[-1]} (q is {tuple(q.shape)}); build them with rotary_cos_sin for this head_dim"
        )
    # Broadcast over the head axis.
    cos = cos[:, :, None, :]
    sin = sin[:, :, None, :]
    q_rotated = q * cos + rotate_half(q) * sin
    k_rotated = k * cos + rotate_half(k) * sin
    return q_rotated, k_rotated


def rotate_heads(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleaved: bool = False) -> jax.Array:
    """Rotate every head of x by its token's angles.

    x: [B, S, N, D]; cos, sin: [B, S, D] from `rotary_cos_sin` -> [B, S, N, D]
    interleaved=False: HF's rotate-half convention (`apply_rotary`). interleaved=True: DeepSeek's
    `apply_rotary_pos_emb_interleave`: pairs (x0, x1), (x2, x3), ... each turn by one frequency, and the
    result is laid out de-interleaved, `[x_even * cos - x_odd * sin, x_odd * cos + x_even * sin]` (queries
    and keys get the same permutation, so their dot products are those of the interleaved rotation).
    """
    if cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"rotate_heads: cos {tuple(cos.shape)} must be [B, S, {x.shape[-1]}] for x {tuple(x.shape)}")
    if not interleaved:
        return x * cos[:, :, None, :] + rotate_half(x) * sin[:, :, None, :]
    half = x.shape[-1] // 2
    cos, sin = cos[:, :, None, :half], sin[:, :, None, :half]  # tables are cat(freqs, freqs)
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


def rotate_pairs(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Llama 4's complex RoPE (`apply_rotary_emb`): each pair (x[2i], x[2i+1]) is a complex number turned by
    frequency i, and stays in place. x: [B, S, N, D]; cos, sin: [B, S, D] from `rotary_cos_sin` (whose halves
    repeat the D/2 frequencies) -> [B, S, N, D], computed in float32 and cast back."""
    half = x.shape[-1] // 2
    if cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"rotate_pairs: cos {tuple(cos.shape)} must be [B, S, {x.shape[-1]}] for x {tuple(x.shape)}")
    cos = cos[:, :, None, :half].astype(jnp.float32)
    sin = sin[:, :, None, :half].astype(jnp.float32)
    real, imag = x[..., 0::2].astype(jnp.float32), x[..., 1::2].astype(jnp.float32)
    rotated = jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)
