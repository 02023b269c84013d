"""DeepSeek-V3: config, declared tree and resolved plans equal HF's; interleaved RoPE and the MLA cache equal
straightforward references; logits and gradients equal PyTorch's; the router bias is a frozen float32 buffer.
Sharded layouts: tests/models/test_fixture_parity.py and scripts/checks/check_all_layouts.py; FP8 hub weights and
the skipped MTP layer: tests/converters/test_fp8.py."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import MODEL_CLASSES, DeepseekV3ForCausalLM
from moe_jax.inference import init_cache
from moe_jax.models import DeepseekV3Config
from moe_jax.nn.rotary import rotate_heads
from moe_jax.training import make_train_step

from .hf_reference import (
    LOGITS_ATOL,
    TINY_DEEPSEEK_V3,
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

PLAN_LAYOUTS = [dict(tp_size=2), dict(tp_size=2, fsdp_size=4, ep_size=4)]
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
# No q LoRA (q_proj), rope applied in rotate-half layout, values as wide as keys, two shared experts.
TINY_VARIANT = {**TINY_DEEPSEEK_V3, "q_lora_rank": None, "rope_interleave": False, "v_head_dim": 16,
                "n_shared_experts": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torch")
    model = tiny_hf_model("deepseek_v3", TINY_DEEPSEEK_V3)
    perturb_vector_params(model)
    input_ids = np.random.default_rng(0).integers(0, TINY_DEEPSEEK_V3["vocab_size"], (8, 11))
    return model, hf_state_dict(model), input_ids, hf_logits(model, input_ids)


def test_registered_and_config_defaults_and_aliases():
    assert MODEL_CLASSES["deepseek_v3"] is DeepseekV3ForCausalLM
    config = DeepseekV3Config()
    assert (config.num_experts, config.head_dim, config.qk_head_dim, config.num_nextn_predict_layers) == (256, 64, 192, 1)
    assert config.softmax_scale == 192 ** -0.5 and config.weight_block_size == (128, 128)
    aliased = DeepseekV3Config.from_dict({"num_local_experts": 16, "num_mtp_layers": 0})
    assert (aliased.n_routed_experts, aliased.num_nextn_predict_layers) == (16, 0)
    yarn = DeepseekV3Config(rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0})
    assert yarn.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40.0) + 1) ** 2)


def test_interleaved_rotation_turns_each_pair_by_its_frequency():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 2, 1, 4)).astype(np.float32)
    angles = rng.normal(size=(1, 2, 2)).astype(np.float32)                   # one angle per pair
    cos, sin = (jnp.asarray(np.concatenate([f(angles)] * 2, -1)) for f in (np.cos, np.sin))
    out = np.asarray(rotate_heads(jnp.asarray(x), cos, sin, interleaved=True))
    for pair in range(2):
        re, im = x[..., 2 * pair], x[..., 2 * pair + 1]
        rotated = (re + 1j * im) * np.exp(1j * angles[:, :, None, pair])
        np.testing.assert_allclose(out[..., pair], rotated.real, rtol=1e-6)      # layout: real parts first,
        np.testing.assert_allclose(out[..., 2 + pair], rotated.imag, rtol=1e-6)  # then imaginary parts


def test_the_cache_holds_the_compressed_latent_and_scanned_decoding_equals_transformers():
    """Layers 1-2 scanned with their latent cache [L, B, T, 1, C] / [L, B, T, 1, R]: greedy tokens equal
    Transformers' (the committed generation fixture; the unrolled model: tests/inference/test_generate.py)."""
    from moe_jax import AutoModelForCausalLM
    from tests.inference.hf_generation import FIXTURES as GENERATION
    from tests.inference.hf_generation import MODELS, NEW_TOKENS

    model = AutoModelForCausalLM.from_pretrained(MODELS / "deepseek_v3", progress=False, devices=jax.devices()[:1],
                                                 scan_layers=True)
    cache = init_cache(model, batch=2, max_length=8)
    assert {array.shape for array in cache.keys.values()} == {(1, 2, 8, 1, 16), (2, 2, 8, 1, 16)}   # C = 16
    assert {array.shape for array in cache.values.values()} == {(1, 2, 8, 1, 8), (2, 2, 8, 1, 8)}   # R = 8
    expected = np.load(GENERATION / "deepseek_v3.npz")
    tokens = model.generate(expected["input_ids"], expected["attention_mask"], max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(tokens, expected["greedy"])


def test_the_router_bias_is_a_frozen_replicated_float32_buffer():
    """Float32 in a bfloat16 model, whole on every device, and `make_train_step`'s optimizer leaves it as it is
    (no update, no decay, no optimizer state) while it moves the router weight."""
    model = DeepseekV3ForCausalLM(TINY_DEEPSEEK_V3, DistributedConfig(fsdp_size=4, tp_size=2), abstract=True)
    assert model.module_tree.buffers() == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]
    assert {model.param_layouts[name].spec for name in model.module_tree.buffers()} == {jax.sharding.PartitionSpec(None)}
    from moe_jax import AutoModelForCausalLM
    from tests.inference.hf_generation import MODELS

    model = AutoModelForCausalLM.from_pretrained(MODELS / "deepseek_v3", dtype="bfloat16", progress=False,
                                                 devices=jax.devices()[:1])
    params = model.params
    assert params[BIAS].dtype == jnp.float32 and params["model.layers.1.mlp.gate.weight"].dtype == jnp.bfloat16
    params = {**params, BIAS: jnp.linspace(-0.5, 0.5, 8)}
    optimizer = make_train_step(model, optax.adamw(1e-2, weight_decay=0.1)).optimizer
    grads = jax.tree.map(jnp.ones_like, params)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(2):
        params, state = step(params, state)
    np.testing.assert_array_equal(np.asarray(params[BIAS]), np.asarray(jnp.linspace(-0.5, 0.5, 8)))
    assert not np.array_equal(np.asarray(params["model.layers.1.mlp.gate.weight"], np.float32),
                              np.asarray(model.params["model.layers.1.mlp.gate.weight"], np.float32))
    assert not any(BIAS in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(state))


@pytest.mark.reference
def test_config_fields_match_hf():
    pytest.importorskip("torch")
    import transformers

    assert_config_fields_match_hf(DeepseekV3Config, transformers.DeepseekV3Config, TINY_DEEPSEEK_V3)


@pytest.mark.reference
def test_tree_matches_hf_names_shapes_and_order(reference):
    hf_model, state, _, _ = reference
    assert_tree_matches_hf(DeepseekV3ForCausalLM(TINY_DEEPSEEK_V3), hf_model, state)


@pytest.mark.reference
@pytest.mark.parametrize("layout", PLAN_LAYOUTS, ids=lambda layout: "-".join(f"{k[:2]}{v}" for k, v in layout.items()))
def test_resolved_plans_match_hf(layout):
    pytest.importorskip("torch")
    assert_plans_match_hf(DeepseekV3ForCausalLM, "deepseek_v3", TINY_DEEPSEEK_V3, layout)


@pytest.mark.reference
def test_logits_and_padded_batch_match_pytorch(reference):
    hf_model, state, input_ids, expected = reference
    model = DeepseekV3ForCausalLM(TINY_DEEPSEEK_V3, devices=jax.devices()[:1])
    model.set_params(state)
    np.testing.assert_allclose(np.asarray(model(input_ids)), expected, atol=LOGITS_ATOL, rtol=0)
    assert_padded_batch_matches_hf(model, hf_model, input_ids, real_tokens_only=True)


@pytest.mark.reference
def test_logits_match_pytorch_without_q_lora_or_interleaving():
    hf_model = tiny_hf_model("deepseek_v3", TINY_VARIANT)
    perturb_vector_params(hf_model)
    input_ids = np.random.default_rng(1).integers(0, 128, (2, 9))
    model = DeepseekV3ForCausalLM(TINY_VARIANT, devices=jax.devices()[:1])
    model.set_params(hf_state_dict(hf_model))
    output = model.forward(input_ids)
    np.testing.assert_allclose(np.asarray(output.logits), hf_logits(hf_model, input_ids), atol=LOGITS_ATOL, rtol=0)
    assert float(output.aux_loss) == 0.0  # the reference reports no router loss for DeepSeek-V3


@pytest.mark.reference
def test_loss_gradients_match_pytorch_with_experts_over_8_devices(reference):
    """One step's gradients (shifted cross-entropy, as HF's loss with labels) for every parameter, with the
    experts dispatched over ep=8; the router bias (a torch buffer) gets none."""
    hf_model, state, input_ids, _ = reference
    model = DeepseekV3ForCausalLM(TINY_DEEPSEEK_V3, DistributedConfig(fsdp_size=8, ep_size=8), scan_layers=True)
    assert_loss_gradients_match_pytorch(model, hf_model, state, input_ids)


def test_a_plain_checkpoint_round_trips_bit_for_bit(tmp_path):
    """Per-expert hub keys, the float32 router bias and every layer back as they were (fsdp8/ep8, no forward)."""
    from safetensors.numpy import load_file

    from moe_jax import AutoModelForCausalLM

    from .test_fixture_parity import FIXTURES

    model = AutoModelForCausalLM.from_pretrained(FIXTURES / "deepseek_v3", DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False)
    model.save_pretrained(tmp_path / "export", progress=False)
    original = load_file(FIXTURES / "deepseek_v3" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert exported.keys() == original.keys() and "model.layers.1.mlp.experts.7.up_proj.weight" in exported
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
