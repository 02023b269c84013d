"""`rms_norm` against the RMSNorm modules of Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from nn_reference import max_abs_diff, params_of, randomize_, to_jax

from moe_jax.nn.norms import rms_norm

NORM_CLASSES = [
    ("qwen3_moe", "Qwen3MoeRMSNorm"),
    ("qwen2_moe", "Qwen2MoeRMSNorm"),
    ("olmoe", "OlmoeRMSNorm"),
    ("mixtral", "MixtralRMSNorm"),
]


def _norm_module(model_type, class_name, width, eps):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    modeling = getattr(transformers.models, model_type)
    module_file = getattr(modeling, f"modeling_{model_type}")
    return getattr(module_file, class_name)(width, eps=eps)


@pytest.mark.reference
@pytest.mark.parametrize("model_type, class_name", NORM_CLASSES)
def test_rms_norm_matches_hf_fp32(model_type, class_name):
    torch = pytest.importorskip("torch")
    module = _norm_module(model_type, class_name, 48, eps=1e-6)
    randomize_(module, seed=1)
    x = 3.0 * torch.randn(2, 11, 48, generator=torch.Generator().manual_seed(2))

    out = rms_norm(params_of(module), to_jax(x), 1e-6)
    diff = max_abs_diff(out, module(x))
    print(f"{class_name} fp32: max abs diff {diff:.2e}")
    assert out.dtype == jnp.float32
    assert diff <= 1e-5


@pytest.mark.reference
@pytest.mark.parametrize("model_type, class_name", NORM_CLASSES)
def test_rms_norm_matches_hf_bf16(model_type, class_name):
    """bf16 weight and input: cast back to bf16 *before* the weight multiply, exactly as HF rounds."""
    torch = pytest.importorskip("torch")
    module = _norm_module(model_type, class_name, 48, eps=1e-5)
    randomize_(module, seed=3)
    module = module.to(torch.bfloat16)
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    out = rms_norm(params_of(module), to_jax(x), 1e-5)
    assert out.dtype == jnp.bfloat16
    diff = max_abs_diff(out, module(x))
    print(f"{class_name} bf16: max abs diff {diff:.2e}")
    assert diff <= 1e-2  # one bf16 ulp at |y| ~ 2


def test_rms_norm_fp32_master_weight_applies_in_input_dtype():
    """A float32 weight on bf16 input is a mixed-precision master: the output equals the bf16 weight's, and
    the weight's gradient is the float32 sum (not a bf16 one)."""
    weight = jax.random.normal(jax.random.key(5), (16,), jnp.float32)
    x = jax.random.normal(jax.random.key(6), (64, 16), jnp.float32).astype(jnp.bfloat16)
    out = rms_norm({"weight": weight}, x, 1e-6)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, rms_norm({"weight": weight.astype(jnp.bfloat16)}, x, 1e-6))

    def loss(w):
        return jnp.sum(rms_norm({"weight": w}, x, 1e-6).astype(jnp.float32) * jnp.arange(16.0))

    grad = jax.grad(loss)(weight)
    assert grad.dtype == jnp.float32
    normalized = (x.astype(jnp.float32) * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1,
                                                                   keepdims=True) + 1e-6)).astype(jnp.bfloat16)
    expected = jnp.sum(normalized.astype(jnp.float32) * jnp.arange(16.0), axis=0)
    np.testing.assert_allclose(grad, expected, rtol=1e-6)


def test_rms_norm_normalises_the_last_axis_only():
    x = jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4) + 1.0
    y = rms_norm({"weight": jnp.ones(4)}, x, 0.0)
    np.testing.assert_allclose(np.mean(np.asarray(y) ** 2, axis=-1), 1.0, rtol=1e-6)


def test_rms_norm_rejects_wrong_width():
    with pytest.raises(ValueError, match="head_dim"):
        rms_norm({"weight": jnp.ones(8)}, jnp.ones((2, 16)), 1e-6)
