"""`mlp` against the dense MLPs of Qwen3-MoE, Qwen2-MoE and OLMoE; `ACTIVATIONS` against HF's `ACT2FN`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from nn_reference import max_abs_diff, params_of, randomize_, to_jax

from moe_jax.nn.activations import get_activation
from moe_jax.nn.mlp import ACTIVATIONS, mlp

MLP_CLASSES = [("qwen3_moe", "Qwen3MoeMLP"), ("qwen2_moe", "Qwen2MoeMLP"), ("olmoe", "OlmoeMLP")]


def _hf_mlp(model_type, class_name, hidden_act):
    """The model's dense MLP with seeded random weights, from a tiny config."""
    transformers = pytest.importorskip("transformers")
    prefix = class_name.removesuffix("MLP")
    config = getattr(transformers, f"{prefix}Config")(
        hidden_size=40, intermediate_size=72, hidden_act=hidden_act
    )
    modeling = getattr(getattr(transformers.models, model_type), f"modeling_{model_type}")
    module = getattr(modeling, class_name)(config)
    randomize_(module, seed=0)
    return module


@pytest.mark.reference
@pytest.mark.parametrize("model_type, class_name", MLP_CLASSES)
@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
def test_mlp_matches_hf(model_type, class_name, hidden_act):
    torch = pytest.importorskip("torch")
    module = _hf_mlp(model_type, class_name, hidden_act)
    x = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(1))
    out = jax.jit(mlp, static_argnums=2)(params_of(module), to_jax(x), hidden_act)
    with torch.no_grad():
        expected = module(x)
    diff = max_abs_diff(out, expected)
    print(f"{class_name} ({hidden_act}) fp32: max abs diff {diff:.2e}")
    assert diff <= 1e-5


def test_projections_name_the_logical_axes_of_their_outputs():
    params = {name: {"weight": jnp.zeros(shape)} for name, shape in
              [("gate_proj", (12, 8)), ("up_proj", (12, 8)), ("down_proj", (8, 12))]}
    calls = []
    mlp(params, jnp.ones((2, 3, 8)), "silu", constrain=lambda y, axes: calls.append((y.shape, axes)) or y)
    assert calls == [((2, 3, 12), ("batch", "length", "mlp")), ((2, 3, 12), ("batch", "length", "mlp")),
                     ((2, 3, 8), ("batch", "sequence", "embed"))]


@pytest.mark.reference
def test_mlp_bf16_smoke():
    torch = pytest.importorskip("torch")
    module = _hf_mlp("qwen3_moe", "Qwen3MoeMLP", "silu").to(torch.bfloat16)
    x = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        expected = module(x)
    out = mlp(params_of(module), to_jax(x), "silu")
    assert out.dtype == jnp.bfloat16
    scale = float(expected.float().abs().max())
    diff = max_abs_diff(out, expected)
    print(f"Qwen3MoeMLP bf16: max abs diff {diff:.2e} (output scale {scale:.2f})")
    assert diff <= 0.02 * scale


@pytest.mark.reference
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_matches_hf_act2fn(name):
    torch = pytest.importorskip("torch")
    from transformers.activations import ACT2FN

    x = torch.linspace(-12.0, 12.0, 2001)
    expected = ACT2FN[name](x)
    ours = ACTIVATIONS[name](to_jax(x))
    diff = max_abs_diff(ours, expected)
    scale = max(1.0, float(expected.abs().max()))
    assert diff <= 2e-6 * scale, f"{name}: max abs diff {diff:.2e}"


@pytest.mark.reference
def test_every_hf_parameter_free_activation_is_registered():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.activations import ACT2CLS

    with_parameters = {"prelu", "xielu"}
    assert set(ACT2CLS) - with_parameters == set(ACTIVATIONS), "transformers changed its activation list"


def test_unknown_activation_names_the_known_ones():
    with pytest.raises(ValueError, match="silu"):
        get_activation("swishy")
    assert get_activation(jnp.tanh) is jnp.tanh


def test_mlp_accepts_a_callable_and_checks_shapes():
    params = {
        "gate_proj": {"weight": jnp.ones((6, 4))},
        "up_proj": {"weight": jnp.ones((6, 4))},
        "down_proj": {"weight": jnp.ones((4, 6))},
    }
    out = mlp(params, jnp.ones((3, 4)), lambda x: x)
    np.testing.assert_allclose(out, 6 * 4 * 4, rtol=0)
