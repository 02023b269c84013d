"""RoPE tables and rotation against HF's rotary modules, `ROPE_INIT_FUNCTIONS` and `apply_rotary_pos_emb`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from nn_reference import max_abs_diff, to_jax

from moe_jax.nn.rotary import (
    RopeParameters,
    apply_rotary,
    dynamic_ntk_inverse_frequencies,
    rope_inverse_frequencies,
    rope_parameters_from_config,
    rotary_cos_sin,
    rotate_half,
)

# Our inv_freq rounds base ** (i / dim) correctly; torch's float32 pow is within ~1 ulp of that, and the llama3
# smoothing band amplifies it slightly. A few ulps of inv_freq is ~1e-7 of angle per unit of position.
INV_FREQ_RTOL = 6e-7

SCALED_ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1e6},
    "yarn_mscale_untruncated": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "beta_fast": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 500000.0,
    },
}


def _hf_model_file(model_type):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return getattr(getattr(transformers.models, model_type), f"modeling_{model_type}")


def _tiny_config(model_type, **overrides):
    transformers = pytest.importorskip("transformers")
    config_class = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "olmoe": transformers.OlmoeConfig,
        "mixtral": transformers.MixtralConfig,
    }[model_type]
    values = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    values.update(overrides)
    return config_class(**values)


def _hf_rotary(model_type, config):
    prefix = {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "olmoe": "Olmoe", "mixtral": "Mixtral"}[
        model_type
    ]
    return getattr(_hf_model_file(model_type), f"{prefix}RotaryEmbedding")(config)


@pytest.mark.reference
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_default_rope_matches_each_model(model_type):
    """Default theta per config class (Mixtral's is 1e6), head_dim derived or explicit (Qwen3: explicit)."""
    torch = pytest.importorskip("torch")
    overrides = {"head_dim": 32} if model_type in ("qwen3_moe", "mixtral") else {}
    config = _tiny_config(model_type, **overrides)
    module = _hf_rotary(model_type, config)

    rope = rope_parameters_from_config(config)
    assert rope.head_dim == (32 if overrides else 16)
    assert rope.rope_theta == (1e6 if model_type == "mixtral" else 1e4)
    inv_freq, scaling = rope_inverse_frequencies(rope)
    np.testing.assert_allclose(inv_freq, module.inv_freq.numpy(), rtol=INV_FREQ_RTOL, atol=0)
    assert scaling == module.attention_scaling

    # Per-row positions, as with left padding: row 1 starts late.
    positions = torch.stack([torch.arange(37), torch.clamp(torch.arange(37) - 5, min=0)])
    cos_ref, sin_ref = module(torch.zeros(1), positions)
    cos, sin = rotary_cos_sin(to_jax(positions, jnp.int32), inv_freq, scaling)
    diff = max(max_abs_diff(cos, cos_ref), max_abs_diff(sin, sin_ref))
    print(f"{model_type} default rope cos/sin (positions < 37): max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.reference
@pytest.mark.parametrize("name", sorted(SCALED_ROPE))
def test_scaled_rope_types_match_hf(name):
    torch = pytest.importorskip("torch")
    config = _tiny_config("qwen3_moe", head_dim=64, rope_parameters=dict(SCALED_ROPE[name]))
    module = _hf_rotary("qwen3_moe", config)
    inv_freq, scaling = rope_inverse_frequencies(rope_parameters_from_config(config))
    np.testing.assert_allclose(inv_freq, module.inv_freq.numpy(), rtol=INV_FREQ_RTOL, atol=0)
    assert scaling == pytest.approx(module.attention_scaling, rel=1e-12)

    positions = torch.arange(64)[None]  # within max_position_embeddings: no dynamic update
    cos_ref, sin_ref = module(torch.zeros(1), positions)
    cos, sin = rotary_cos_sin(to_jax(positions, jnp.int32), inv_freq, scaling)
    diff = max(max_abs_diff(cos, cos_ref), max_abs_diff(sin, sin_ref))
    print(f"{name} rope cos/sin: max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.reference
def test_cos_sin_match_hf_at_long_positions_given_the_same_inv_freq():
    """With identical frequencies, the float32 angle/cos/sin path is exact to rounding even at 32k."""
    torch = pytest.importorskip("torch")
    config = _tiny_config(
        "qwen3_moe",
        head_dim=128,
        max_position_embeddings=32768,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 1e6,
        },
    )
    module = _hf_rotary("qwen3_moe", config)
    positions = torch.arange(0, 32768, 97)[None]
    cos_ref, sin_ref = module(torch.zeros(1), positions)
    cos, sin = rotary_cos_sin(to_jax(positions, jnp.int32), module.inv_freq.numpy(), module.attention_scaling)
    diff = max(max_abs_diff(cos, cos_ref), max_abs_diff(sin, sin_ref))
    print(f"cos/sin at positions < 32768 from HF's inv_freq: max abs diff {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.reference
def test_dynamic_rope_grows_past_max_position_embeddings_like_hf():
    torch = pytest.importorskip("torch")
    config = _tiny_config(
        "olmoe",
        max_position_embeddings=32,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    rope = rope_parameters_from_config(config)
    for seq_len in (20, 32, 33, 57):
        module = _hf_rotary("olmoe", config)  # fresh: HF's dynamic rope keeps state between calls
        positions = torch.arange(seq_len)[None]
        cos_ref, sin_ref = module(torch.zeros(1), positions)
        inv_freq = jax.jit(lambda n: dynamic_ntk_inverse_frequencies(rope, n))(seq_len)
        np.testing.assert_allclose(np.asarray(inv_freq), module.inv_freq.numpy(), rtol=2e-6, atol=0)
        cos, sin = rotary_cos_sin(to_jax(positions, jnp.int32), inv_freq)
        diff = max(max_abs_diff(cos, cos_ref), max_abs_diff(sin, sin_ref))
        print(f"dynamic rope seq_len={seq_len}: max abs diff {diff:.2e}")
        assert diff <= 1e-5


@pytest.mark.reference
def test_rope_parameters_from_config_object_dict_and_legacy_json_agree():
    pytest.importorskip("torch")
    config = _tiny_config(
        "mixtral", head_dim=None, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    )
    from_object = rope_parameters_from_config(config)
    from_dict = rope_parameters_from_config(config.to_dict())
    legacy_json = {
        "model_type": "mixtral",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 1024,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    from_legacy = rope_parameters_from_config(legacy_json)
    assert from_object == from_dict == from_legacy
    assert from_object.head_dim == 16 and from_object.factor == 2.0


def test_rope_parameters_defaults_for_a_bare_dict():
    mixtral = {
        "model_type": "mixtral",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "max_position_embeddings": 8,
    }
    assert rope_parameters_from_config(mixtral).rope_theta == 1e6
    assert rope_parameters_from_config({**mixtral, "model_type": "olmoe"}).rope_theta == 1e4
    yarn = {**mixtral, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    assert rope_parameters_from_config(yarn).original_max_position_embeddings == 8


def test_unsupported_rope_settings_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="longrope"):
        RopeParameters(rope_type="longrope", rope_theta=1e4, head_dim=16, max_position_embeddings=8)
    with pytest.raises(ValueError, match="factor"):
        RopeParameters(rope_type="linear", rope_theta=1e4, head_dim=16, max_position_embeddings=8)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        RopeParameters(
            rope_type="linear",
            rope_theta=1e4,
            head_dim=16,
            max_position_embeddings=8,
            factor=2.0,
            partial_rotary_factor=0.5,
        )


@pytest.mark.reference
def test_apply_rotary_matches_hf_apply_rotary_pos_emb():
    torch = pytest.importorskip("torch")
    hf = _hf_model_file("qwen3_moe")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 16, generator=generator)  # HF layout [B, N, S, D]
    k = torch.randn(2, 2, 9, 16, generator=generator)
    positions = torch.stack([torch.arange(9), torch.arange(9) + 100])
    inv_freq, _ = rope_inverse_frequencies(
        RopeParameters(rope_type="default", rope_theta=1e4, head_dim=16, max_position_embeddings=128)
    )
    cos, sin = rotary_cos_sin(to_jax(positions, jnp.int32), inv_freq)
    q_ref, k_ref = hf.apply_rotary_pos_emb(q, k, torch.tensor(np.asarray(cos)), torch.tensor(np.asarray(sin)))

    q_rot, k_rot = apply_rotary(to_jax(q.transpose(1, 2)), to_jax(k.transpose(1, 2)), cos, sin)
    diff = max(max_abs_diff(q_rot, q_ref.transpose(1, 2)), max_abs_diff(k_rot, k_ref.transpose(1, 2)))
    print(f"apply_rotary: max abs diff {diff:.2e}")
    assert diff <= 1e-6


def test_rotate_half_convention():
    np.testing.assert_array_equal(rotate_half(jnp.array([1.0, 2.0, 3.0, 4.0])), [-3.0, -4.0, 1.0, 2.0])


def test_rotation_preserves_norms_and_relative_positions():
    """A pure rotation: norms unchanged, and q.k depends only on the position difference."""
    inv_freq, _ = rope_inverse_frequencies(
        RopeParameters(rope_type="default", rope_theta=1e4, head_dim=8, max_position_embeddings=64)
    )
    key = jax.random.PRNGKey(0)
    q = jnp.broadcast_to(jax.random.normal(key, (1, 1, 1, 8)), (1, 2, 1, 8))
    k = jnp.broadcast_to(jax.random.normal(jax.random.PRNGKey(1), (1, 1, 1, 8)), (1, 2, 1, 8))
    cos_a, sin_a = rotary_cos_sin(jnp.array([[3, 5]]), inv_freq)
    cos_b, sin_b = rotary_cos_sin(jnp.array([[13, 15]]), inv_freq)
    qa, ka = apply_rotary(q, k, cos_a, sin_a)
    qb, kb = apply_rotary(q, k, cos_b, sin_b)
    np.testing.assert_allclose(jnp.linalg.norm(qa, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-6)
    dot_a = jnp.sum(qa[:, 1] * ka[:, 0])
    dot_b = jnp.sum(qb[:, 1] * kb[:, 0])
    np.testing.assert_allclose(dot_a, dot_b, rtol=1e-5)


def test_rotary_cos_sin_dtype_and_shape():
    inv_freq = np.ones(4, np.float32)
    cos, sin = rotary_cos_sin(jnp.zeros((2, 3), jnp.int32), inv_freq, 2.0, dtype=jnp.bfloat16)
    assert cos.shape == sin.shape == (2, 3, 8)
    assert cos.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(cos, np.float32), 2.0)
    np.testing.assert_array_equal(np.asarray(sin, np.float32), 0.0)


def test_apply_rotary_rejects_mismatched_tables():
    with pytest.raises(ValueError, match="head_dim=16"):
        apply_rotary(
            jnp.ones((1, 2, 4, 16)), jnp.ones((1, 2, 2, 16)), jnp.ones((1, 2, 8)), jnp.ones((1, 2, 8))
        )
