"""Llama 4 (text): config, declared tree and resolved plans equal HF's, `ep_size > 1` raises the reference's
error; complex-pair RoPE, chunked masks, the temperature and the pre-scaled experts equal straightforward
references; logits and gradients equal PyTorch's with the experts split by TP. Other layouts:
tests/models/test_fixture_parity.py and scripts/checks/check_all_layouts.py; generation: tests/inference."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import MODEL_CLASSES, Llama4ForCausalLM
from moe_jax.models import Llama4TextConfig, llama4
from moe_jax.nn.attention_core import visibility_mask
from moe_jax.nn.rotary import rotate_pairs
from moe_jax.ops.experts import prescaled_swiglu_experts

from .hf_reference import (
    LOGITS_ATOL,
    TINY_LLAMA4,
    assert_config_fields_match_hf,
    assert_loss_gradients_match_pytorch,
    assert_padded_batch_matches_hf,
    assert_plans_match_hf,
    assert_tree_matches_hf,
    hf_logits,
    hf_state_dict,
    perturb_vector_params,
    tiny_hf_model,
)

PLAN_LAYOUTS = [dict(tp_size=2), dict(tp_size=2, fsdp_size=4)]


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torch")
    model = tiny_hf_model("llama4_text", TINY_LLAMA4)
    perturb_vector_params(model)
    input_ids = np.random.default_rng(0).integers(0, TINY_LLAMA4["vocab_size"], (8, 11))
    return model, hf_state_dict(model), input_ids, hf_logits(model, input_ids)


def test_registered_and_config_defaults():
    assert MODEL_CLASSES["llama4_text"] is Llama4ForCausalLM
    config = Llama4TextConfig(num_hidden_layers=8, interleave_moe_layer_step=2)
    assert config.no_rope_layers == (1, 1, 1, 0) * 2 and config.moe_layers == (1, 3, 5, 7)
    assert config.layer_types == ("chunked_attention",) * 3 + ("full_attention",) + ("chunked_attention",) * 3 + (
        "full_attention",)
    with pytest.raises(ValueError, match="Llama 4 layers are one of"):
        Llama4TextConfig(num_hidden_layers=1, layer_types=("sliding_attention",))


def test_expert_parallelism_raises_the_references_error():
    with pytest.raises(ValueError, match=r"^`ep_size=2` was requested, but `Llama4ForCausalLM` has no `ep_plan`"):
        Llama4ForCausalLM(TINY_LLAMA4, DistributedConfig(fsdp_size=8, ep_size=2))


def test_pair_rotation_turns_each_adjacent_pair_in_place():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 2, 1, 4)).astype(np.float32)
    angles = rng.normal(size=(1, 2, 2)).astype(np.float32)
    cos, sin = (jnp.asarray(np.concatenate([f(angles)] * 2, -1)) for f in (np.cos, np.sin))
    out = np.asarray(rotate_pairs(jnp.asarray(x), cos, sin))
    rotated = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * angles[:, :, None, :])
    np.testing.assert_allclose(out[..., 0::2], rotated.real, rtol=1e-6)
    np.testing.assert_allclose(out[..., 1::2], rotated.imag, rtol=1e-6)


def test_chunks_start_at_each_rows_first_real_token():
    padding = jnp.asarray([[1] * 6, [0, 0, 1, 1, 1, 1]], bool)
    mask = np.asarray(visibility_mask(jnp.broadcast_to(jnp.arange(6), (2, 6)), 6, key_padding_mask=padding,
                                      chunk_size=2))[:, 0]
    assert mask[0, 3].tolist() == [False, False, True, True, False, False]   # chunk {2, 3}
    assert mask[1, 4].tolist() == [False, False, False, False, True, False]  # chunks {2, 3}, {4, 5}
    assert mask[1, 3].tolist() == [False, False, True, True, False, False]


def test_temperature_grows_with_the_cache_index():
    model = Llama4ForCausalLM(TINY_LLAMA4, abstract=True)
    scales = np.asarray(llama4.temperature(model.config, jnp.asarray(2), 6))       # indices 2..7, floor_scale 4, attn_scale 0.5
    expected = np.log1p(np.floor((np.arange(2, 8) + 1.0) / 4)) * 0.5 + 1.0
    np.testing.assert_allclose(scales, expected.astype(np.float32), rtol=1e-6)


def test_experts_scale_their_inputs_and_equal_every_expert_on_every_token():
    """The reference's dense form: every expert on every token, inputs scaled (0 for unchosen experts)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 8)).astype(np.float32)
    ids = np.asarray([[0, 3], [1, 2], [3, 1], [2, 0], [1, 4]], np.int32)  # 4: not mine (E = 4)
    weights = rng.uniform(0.1, 1.0, size=(5, 2)).astype(np.float32)
    gate_up, down = rng.normal(size=(4, 8, 12)).astype(np.float32), rng.normal(size=(4, 6, 8)).astype(np.float32)
    ours = np.asarray(prescaled_swiglu_experts(*map(jnp.asarray, (x, ids, weights, gate_up, down))))
    scores = np.zeros((5, 4), np.float32)
    for n, k in np.ndindex(ids.shape):
        if ids[n, k] < 4:
            scores[n, ids[n, k]] += weights[n, k]
    expected = np.zeros_like(x)
    for e in range(4):
        gu = (x * scores[:, e:e + 1]) @ gate_up[e]
        gate, up = gu[:, :6], gu[:, 6:]
        expected += (up * gate / (1 + np.exp(-gate))) @ down[e]
    np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.reference
def test_config_fields_match_hf():
    pytest.importorskip("torch")
    import transformers

    assert_config_fields_match_hf(Llama4TextConfig, transformers.Llama4TextConfig, TINY_LLAMA4)


@pytest.mark.reference
def test_tree_matches_hf_names_shapes_and_order(reference):
    hf_model, state, _, _ = reference
    assert_tree_matches_hf(Llama4ForCausalLM(TINY_LLAMA4), hf_model, state)


@pytest.mark.reference
@pytest.mark.parametrize("layout", PLAN_LAYOUTS, ids=lambda layout: "-".join(f"{k[:2]}{v}" for k, v in layout.items()))
def test_resolved_plans_match_hf(layout):
    pytest.importorskip("torch")
    assert_plans_match_hf(Llama4ForCausalLM, "llama4_text", TINY_LLAMA4, layout)


@pytest.mark.reference
def test_logits_and_padded_batch_match_pytorch(reference):
    hf_model, state, input_ids, expected = reference
    model = Llama4ForCausalLM(TINY_LLAMA4, devices=jax.devices()[:1])
    model.set_params(state)
    np.testing.assert_allclose(np.asarray(model(input_ids)), expected, atol=LOGITS_ATOL, rtol=0)
    assert_padded_batch_matches_hf(model, hf_model, input_ids, real_tokens_only=True)


@pytest.mark.reference
def test_loss_gradients_match_pytorch_with_experts_over_tp(reference):
    """One step's gradients for every parameter with the experts' intermediate dim split over tp=2."""
    hf_model, state, input_ids, _ = reference
    model = Llama4ForCausalLM(TINY_LLAMA4, DistributedConfig(tp_size=2, fsdp_size=4), scan_layers=False)
    assert_loss_gradients_match_pytorch(model, hf_model, state, input_ids)


def test_a_checkpoint_round_trips_bit_for_bit(tmp_path):
    """The fused [E, H, 2I] experts and every other tensor back as they were (experts over tp2, no forward)."""
    from safetensors.numpy import load_file

    from moe_jax import AutoModelForCausalLM

    from .test_fixture_parity import FIXTURES

    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama4_text", DistributedConfig(tp_size=2, fsdp_size=4),
                                                 progress=False)
    model.save_pretrained(tmp_path / "export", progress=False)
    original = load_file(FIXTURES / "llama4_text" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == original.keys()
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key


@pytest.mark.reference
def test_a_multimodal_checkpoint_loads_its_text_model_and_saves_it_as_one(tmp_path):
    """As Transformers' AutoModelForCausalLM: `text_config`, weights under `language_model.`, the vision tower
    skipped; the export is a `llama4_text` checkpoint that Transformers loads with the same logits."""
    torch = pytest.importorskip("torch")
    import transformers

    from moe_jax import AutoModelForCausalLM
    from moe_jax.causal_lm import Llama4ForCausalLMOfMultimodal

    from .hf_reference import fixture_inputs

    vision = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    config = transformers.Llama4Config(text_config=TINY_LLAMA4, vision_config=vision)
    transformers.Llama4ForConditionalGeneration(config).save_pretrained(tmp_path / "multimodal")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "multimodal", dtype=torch.float32).eval()
    input_ids, attention_mask = fixture_inputs(TINY_LLAMA4["vocab_size"])
    real, expected = attention_mask.astype(bool), hf_logits(theirs, input_ids, attention_mask)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "multimodal", progress=False, devices=jax.devices()[:1])
    assert isinstance(model, Llama4ForCausalLMOfMultimodal) and model.config.model_type == "llama4_text"
    np.testing.assert_allclose(np.asarray(model(input_ids, attention_mask))[real], expected[real], atol=LOGITS_ATOL)
    model.save_pretrained(tmp_path / "text", progress=False)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "Llama4ForCausalLM" and reloaded.config.model_type == "llama4_text"
    np.testing.assert_array_equal(hf_logits(reloaded, input_ids, attention_mask), expected)
