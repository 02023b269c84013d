"""`attention` against the attention modules of Qwen3-MoE, OLMoE, Qwen2-MoE and Mixtral (eager and sdpa).

The HF module gets exactly what its model would give it: cos/sin from the model's rotary module and the
mask from `create_causal_mask` / `create_sliding_window_causal_mask` for that config and layer.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from nn_reference import max_abs_diff, params_of, randomize_, to_jax

from moe_jax.nn.attention import attention
from moe_jax.nn.attention_core import attend, visibility_mask
from moe_jax.nn.rotary import rope_inverse_frequencies, rope_parameters_from_config, rotary_cos_sin

HF_PREFIX = {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "olmoe": "Olmoe", "mixtral": "Mixtral"}
QK_NORM_KIND = {"qwen3_moe": "per_head", "olmoe": "full_width", "qwen2_moe": None, "mixtral": None}

# (model_type, config overrides): every attention feature of the four models.
CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_sliding": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4}),
    "olmoe": ("olmoe", {}),
    "olmoe_clip_qkv": ("olmoe", {"clip_qkv": 0.3}),
    "qwen2_moe_bias": ("qwen2_moe", {}),
    "qwen2_moe_bias_sliding": (
        "qwen2_moe",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    ),
    "mixtral": ("mixtral", {}),
    "mixtral_sliding": ("mixtral", {"sliding_window": 5}),
}


def _build(model_type, attn_implementation="sdpa", seed=0, **overrides):
    """A tiny HF config, its layer-0 attention module (random weights) and rotary module."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    prefix = HF_PREFIX[model_type]
    values = dict(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    if model_type in ("qwen3_moe", "mixtral"):
        values["head_dim"] = 16  # != hidden_size / heads, so the two cannot be confused
    values.update(overrides)
    config = getattr(transformers, f"{prefix}Config")(**values)
    config._attn_implementation = attn_implementation
    modeling = getattr(getattr(transformers.models, model_type), f"modeling_{model_type}")
    module = getattr(modeling, f"{prefix}Attention")(config, layer_idx=0).eval()
    randomize_(module, seed)
    rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(config)
    torch.manual_seed(seed)
    return config, module, rotary


def _layer0_sliding_window(model_type, config):
    """The window HF's model applies to layer 0 (None = full causal), read the way each model reads it."""
    if model_type == "qwen2_moe":
        return config.sliding_window if config.layer_types[0] == "sliding_attention" else None
    if model_type == "olmoe":
        return None
    return config.sliding_window


def _hf_attention(model_type, config, module, rotary, hidden, attention_mask, positions):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    sliding = _layer0_sliding_window(model_type, config) is not None
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    mask = make_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        past_key_values=None,
        position_ids=positions,
    )
    out, _ = module(hidden, rotary(hidden, positions), mask)
    return out


def _ours(model_type, config, params, hidden, attention_mask, positions, **kwargs):
    rope = rope_parameters_from_config(config)
    inv_freq, scaling = rope_inverse_frequencies(rope)

    @jax.jit  # one compilation per test instead of one dispatch per primitive
    def forward(params, hidden, attention_mask, positions):
        cos, sin = rotary_cos_sin(positions, inv_freq, scaling, dtype=hidden.dtype)
        return attention(
            params,
            hidden,
            cos,
            sin,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=rope.head_dim,
            attention_mask=attention_mask,
            sliding_window=_layer0_sliding_window(model_type, config),
            qk_norm_kind=QK_NORM_KIND[model_type],
            rms_norm_eps=config.rms_norm_eps,
            clip_qkv=getattr(config, "clip_qkv", None),
            **kwargs,
        )

    return forward(params, hidden, attention_mask, positions)


def _inputs(batch, seq, hidden_size, num_pad, seed=0):
    """Hidden states, a left-padding mask (row 1 padded by `num_pad`) and generate-style positions."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if num_pad:
        mask[1, :num_pad] = 0
    positions = torch.clamp(mask.cumsum(-1) - 1, min=0)  # positions count real tokens only, like generate()
    return hidden, mask, positions


def _compare(case, attn_implementation, batch, seq, num_pad, **kwargs):
    torch = pytest.importorskip("torch")
    model_type, overrides = CASES[case]
    config, module, rotary = _build(model_type, attn_implementation, **overrides)
    hidden, mask, positions = _inputs(batch, seq, config.hidden_size, num_pad)
    with torch.no_grad():
        expected = _hf_attention(
            model_type, config, module, rotary, hidden, mask if num_pad else None, positions
        )
    ours = _ours(
        model_type,
        config,
        params_of(module),
        to_jax(hidden),
        to_jax(mask, jnp.int32) if num_pad else None,
        to_jax(positions, jnp.int32),
        **kwargs,
    )
    assert ours.shape == expected.shape
    assert bool(jnp.isfinite(ours).all())
    real_tokens = mask.numpy().astype(bool)[..., None]  # padding rows carry no meaning in either
    return max_abs_diff(ours, expected, where=real_tokens)


@pytest.mark.reference
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_hf(case, attn_implementation):
    pytest.importorskip("torch")
    diff = _compare(case, attn_implementation, batch=2, seq=13, num_pad=0)
    print(f"attention {case} vs HF {attn_implementation}, S=13: max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.reference
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_with_left_padding_matches_hf(case):
    pytest.importorskip("torch")
    diff = _compare(case, "sdpa", batch=2, seq=11, num_pad=5)
    print(f"attention {case} vs HF, left padding: max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.reference
@pytest.mark.parametrize("case", ["qwen3_moe", "olmoe_clip_qkv", "qwen2_moe_bias_sliding", "mixtral_sliding"])
def test_attention_single_token_matches_hf(case):
    pytest.importorskip("torch")
    diff = _compare(case, "eager", batch=2, seq=1, num_pad=0)
    print(f"attention {case} vs HF, S=1: max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.reference
@pytest.mark.parametrize("case", ["qwen2_moe_bias_sliding", "qwen3_moe"])
def test_attention_in_query_chunks_matches_hf(case):
    pytest.importorskip("torch")
    diff = _compare(case, "sdpa", batch=2, seq=11, num_pad=3, query_chunk_size=4)
    print(f"attention {case} vs HF, query chunks of 4: max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.reference
def test_olmoe_clip_qkv_is_active_in_the_test():
    """Guard for the clip case above: with clip 0.3 the result must differ from the unclipped one."""
    pytest.importorskip("torch")
    clipped = _compare("olmoe_clip_qkv", "sdpa", batch=1, seq=6, num_pad=0)
    config, module, _ = _build("olmoe", clip_qkv=0.3)
    hidden, _, positions = _inputs(1, 6, config.hidden_size, 0)
    params, h, p = params_of(module), to_jax(hidden), to_jax(positions, jnp.int32)
    with_clip = _ours("olmoe", config, params, h, None, p)
    config.clip_qkv = None
    without_clip = _ours("olmoe", config, params, h, None, p)
    assert clipped <= 1e-5
    assert max_abs_diff(with_clip, without_clip) > 1e-2


@pytest.mark.reference
def test_decode_step_against_hf_kv_cache():
    """One new token attending to a cache: `attend` with T > S keys equals HF's cached forward."""
    torch = pytest.importorskip("torch")
    from transformers import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask

    config, module, rotary = _build("mixtral", "sdpa", sliding_window=4)
    hidden, _, positions = _inputs(1, 9, config.hidden_size, 0)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        for start, stop in ((0, 8), (8, 9)):
            step_hidden, step_positions = hidden[:, start:stop], positions[:, start:stop]
            mask = create_sliding_window_causal_mask(
                config=config,
                inputs_embeds=step_hidden,
                attention_mask=None,
                past_key_values=cache,
                position_ids=step_positions,
            )
            expected, _ = module(
                step_hidden, rotary(step_hidden, step_positions), mask, past_key_values=cache
            )

    from moe_jax.nn.attention import project_qkv
    from moe_jax.nn.linear import linear
    from moe_jax.nn.rotary import apply_rotary

    params = params_of(module)
    inv_freq, _ = rope_inverse_frequencies(rope_parameters_from_config(config))
    cos, sin = rotary_cos_sin(to_jax(positions, jnp.int32), inv_freq)
    q, k, v = project_qkv(params, to_jax(hidden), num_heads=4, num_kv_heads=2, head_dim=16)
    q, k = apply_rotary(q, k, cos, sin)
    out = attend(q[:, -1:], k, v, scale=16**-0.5, sliding_window=4)  # the cache holds all 9 keys
    ours = linear(params["o_proj"], out.reshape(1, 1, 64))
    diff = max_abs_diff(ours, expected)
    print(f"decode step vs HF DynamicCache (sliding window 4): max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.reference
@pytest.mark.parametrize("case", ["qwen3_moe", "olmoe_clip_qkv", "qwen2_moe_bias_sliding"])
def test_attention_bf16_smoke(case):
    """bf16 end to end: dtype kept, finite, and close to HF's bf16 sdpa (roundings differ in places)."""
    torch = pytest.importorskip("torch")
    model_type, overrides = CASES[case]
    config, module, rotary = _build(model_type, "sdpa", **overrides)
    module = module.to(torch.bfloat16)
    hidden, mask, positions = _inputs(2, 10, config.hidden_size, 3)
    hidden = hidden.to(torch.bfloat16)
    with torch.no_grad():
        expected = _hf_attention(model_type, config, module, rotary, hidden, mask, positions)
    ours = _ours(
        model_type,
        config,
        params_of(module),
        to_jax(hidden),
        to_jax(mask, jnp.int32),
        to_jax(positions, jnp.int32),
    )
    assert ours.dtype == jnp.bfloat16
    assert bool(jnp.isfinite(ours).all())
    scale = float(np.abs(expected.float().numpy()).max())
    diff = max_abs_diff(ours, expected, where=mask.numpy().astype(bool)[..., None])
    print(f"attention {case} bf16 vs HF bf16: max abs diff {diff:.2e} (output scale {scale:.2f})")
    assert diff <= 0.03 * scale


# -- pure-JAX properties of the masking paths (no reference needed) --------------------------------------------


def _random_qkv(batch=2, seq=11, heads=4, kv_heads=2, dim=8, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, dim))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dim))
    padding = jnp.ones((batch, seq), bool).at[1, :3].set(False)
    return q, k, v, padding


@pytest.mark.parametrize("sliding_window, chunk", [(None, 4), (3, 5), (1, 1)])
def test_query_chunks_equal_one_pass_with_gradients(sliding_window, chunk):
    q, k, v, padding = _random_qkv()
    real = np.asarray(padding)[..., None, None]

    def loss(q, k, v, chunk_size):
        out = attend(
            q, k, v, key_padding_mask=padding, sliding_window=sliding_window, query_chunk_size=chunk_size
        )
        return jnp.sum(jnp.where(real, out, 0.0) ** 2), out

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, whole), grads_whole = jax.jit(partial(value_and_grad, chunk_size=None))(q, k, v)
    (_, chunked), grads_chunked = jax.jit(partial(value_and_grad, chunk_size=chunk))(q, k, v)
    assert max_abs_diff(whole, chunked, where=real) <= 1e-6
    for g_whole, g_chunked in zip(grads_whole, grads_chunked, strict=True):
        assert max_abs_diff(g_whole, g_chunked) <= 1e-5


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_queries_against_more_keys_are_the_last_rows_of_full_attention(sliding_window):
    """Decode shape: the last S queries against all T keys equal rows T-S.. of the full pass."""
    q, k, v, padding = _random_qkv()
    run = jax.jit(partial(attend, key_padding_mask=padding, sliding_window=sliding_window))
    whole = run(q, k, v)
    tail = run(q[:, -3:], k, v)
    assert max_abs_diff(tail, whole[:, -3:]) <= 1e-6


def test_explicit_query_index_ignores_unwritten_cache_slots():
    """A static cache longer than what is filled: slots after the query are masked by causality alone."""
    q, k, v, _ = _random_qkv(batch=1)
    filled = 7
    garbage = jnp.full_like(k[:, filled:], 1e3)
    k_cache = k.at[:, filled:].set(garbage)
    v_cache = v.at[:, filled:].set(garbage)
    index = jnp.array([[filled - 2, filled - 1]])
    run = jax.jit(partial(attend, sliding_window=4))
    out = run(q[:, filled - 2 : filled], k_cache, v_cache, query_index=index)
    reference = run(q[:, :filled], k[:, :filled], v[:, :filled])[:, -2:]
    assert max_abs_diff(out, reference) <= 1e-6


def test_visibility_mask_matches_hf_sliding_window_semantics():
    """Window W keeps keys (i - W, i]: W keys including the query itself."""
    mask = visibility_mask(jnp.arange(6)[None], 6, sliding_window=3)[0, 0]
    expected = np.array([[j <= i and j > i - 3 for j in range(6)] for i in range(6)])
    np.testing.assert_array_equal(mask, expected)


def test_attention_jits_and_keeps_shapes():
    params = {
        name: {"weight": jax.random.normal(jax.random.PRNGKey(i), shape) * 0.1}
        for i, (name, shape) in enumerate(
            [("q_proj", (32, 24)), ("k_proj", (16, 24)), ("v_proj", (16, 24)), ("o_proj", (24, 32))]
        )
    }
    hidden = jax.random.normal(jax.random.PRNGKey(9), (2, 7, 24))
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, 8, 2, dtype=np.float32) / 8))
    cos, sin = rotary_cos_sin(jnp.broadcast_to(jnp.arange(7), (2, 7)), inv_freq)
    fn = jax.jit(partial(attention, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=3))
    out = fn(params, hidden, cos, sin, attention_mask=jnp.ones((2, 7), jnp.int32))
    assert out.shape == (2, 7, 24)
    np.testing.assert_allclose(out, fn(params, hidden, cos, sin), atol=1e-6)  # all-ones mask == no mask


def test_projections_name_the_logical_axes_of_their_outputs():
    """`constrain` gets one logical axis per dim: q's heads, k's and v's kv_heads, o_proj's residual width."""
    params = {name: {"weight": jnp.zeros(shape)} for name, shape in
              [("q_proj", (32, 24)), ("k_proj", (16, 24)), ("v_proj", (16, 24)), ("o_proj", (24, 32))]}
    cos = sin = jnp.ones((2, 7, 8))
    calls = []
    attention(params, jnp.ones((2, 7, 24)), cos, sin, num_heads=4, num_kv_heads=2, head_dim=8,
              constrain=lambda y, axes: calls.append((y.shape, axes)) or y)
    assert calls == [((2, 7, 32), ("batch", "length", "heads")), ((2, 7, 16), ("batch", "length", "kv_heads")),
                     ((2, 7, 16), ("batch", "length", "kv_heads")), ((2, 7, 24), ("batch", "sequence", "embed"))]


@pytest.mark.parametrize("bad_window", [0, -2, 2.5])
def test_bad_sliding_window_is_rejected_with_the_fix(bad_window):
    q, k, v, _ = _random_qkv()
    with pytest.raises(ValueError, match="use_sliding_window=False"):
        attend(q, k, v, sliding_window=bad_window)


def test_qk_norm_kind_must_match_the_params():
    params = {name: {"weight": jnp.zeros((8, 8))} for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    params["q_norm"] = params["k_norm"] = {"weight": jnp.ones(4)}
    cos = sin = jnp.ones((1, 3, 4))
    kwargs = dict(num_heads=2, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="qk_norm_kind='per_head'"):
        attention(params, jnp.ones((1, 3, 8)), cos, sin, **kwargs)
    with pytest.raises(ValueError, match="one of"):
        attention(params, jnp.ones((1, 3, 8)), cos, sin, qk_norm_kind="per_layer", **kwargs)


def test_head_counts_are_checked_against_the_weights():
    params = {name: {"weight": jnp.zeros((8, 8))} for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    cos = sin = jnp.ones((1, 3, 4))
    with pytest.raises(ValueError, match="num_kv_heads"):
        attention(params, jnp.ones((1, 3, 8)), cos, sin, num_heads=2, num_kv_heads=1, head_dim=4)


def test_padding_mask_shape_is_checked():
    q, k, v, _ = _random_qkv()
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        attend(q, k, v, key_padding_mask=jnp.ones((2, 5), bool))
