"""Qwen3-MoE logits equal the PyTorch reference's on one device and on 8-device layouts."""

import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import Qwen3MoeForCausalLM

from .hf_reference import LOGITS_ATOL, TINY_QWEN3_MOE, hf_logits, hf_state_dict, tiny_hf_model

# Live comparisons with PyTorch on one device and one mixed layout; the other layouts are compared with
# committed PyTorch logits in test_fixture_parity.py (no torch needed there).
# Live against torch on one device; sharded layouts are compared with the committed reference fixtures
# (tests/models/test_fixture_parity.py) and, every layout, by scripts/checks/check_all_layouts.py.
LAYOUTS = [None]


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torch")
    model = tiny_hf_model("qwen3_moe", TINY_QWEN3_MOE)
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, TINY_QWEN3_MOE["vocab_size"], (8, 11))
    return hf_state_dict(model), input_ids, hf_logits(model, input_ids)


def test_tree_names_and_shapes_match_hf(reference):
    state, _, _ = reference
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE)
    assert {name: spec.shape for name, spec in model.module_tree.named_parameters()} == {
        name: tuple(array.shape) for name, array in state.items()
    }


@pytest.mark.reference
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "single" if layout is None else
                         "-".join(f"{k.split('_')[0]}{v}" for k, v in layout.items()))
def test_logits_match_pytorch(reference, layout):
    state, input_ids, expected = reference
    config = DistributedConfig(**layout) if layout else None
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, config)
    model.set_params(state)
    logits = np.asarray(model(input_ids))
    np.testing.assert_allclose(logits, expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.reference
def test_batch_not_divisible_by_data_parallel_size_is_padded(reference):
    state, input_ids, expected = reference
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(fsdp_size=8, ep_size=8))
    model.set_params(state)
    np.testing.assert_allclose(np.asarray(model(input_ids[:3])), expected[:3], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.reference
def test_from_pretrained_on_8_devices_and_save_round_trip(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file

    import moe_jax

    hf_model = tiny_hf_model("qwen3_moe", TINY_QWEN3_MOE)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    rng = np.random.default_rng(5)
    input_ids = rng.integers(0, TINY_QWEN3_MOE["vocab_size"], (4, 7))
    expected = hf_logits(hf_model, input_ids)

    model = moe_jax.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4), progress=False
    )
    assert model.params["model.layers.1.mlp.experts.gate_up_proj"].sharding.spec == \
        model.named_shardings()["model.layers.1.mlp.experts.gate_up_proj"].spec
    np.testing.assert_allclose(np.asarray(model(input_ids)), expected, atol=LOGITS_ATOL, rtol=0)

    model.save_pretrained(tmp_path / "out", progress=False)

    def tensors(directory):
        out = {}
        for file in sorted(directory.glob("*.safetensors")):
            out.update(load_file(file))
        return out

    original, exported = tensors(tmp_path / "hf"), tensors(tmp_path / "out")
    assert original.keys() == exported.keys()
    for key in original:
        assert original[key].dtype == exported[key].dtype and np.array_equal(original[key], exported[key]), key

    import transformers

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(reloaded, input_ids), expected)


@pytest.mark.reference
@pytest.mark.parametrize("layout", [None, dict(fsdp_size=8, ep_size=8)], ids=["single", "fsdp8-ep8"])
def test_router_aux_loss_matches_pytorch(reference, layout):
    torch = pytest.importorskip("torch")
    state, input_ids, _ = reference
    hf_model = tiny_hf_model("qwen3_moe", TINY_QWEN3_MOE)
    mask = np.ones_like(input_ids)
    mask[:3, :4] = 0  # left padding on some rows
    with torch.no_grad():
        expected = hf_model(input_ids=torch.as_tensor(input_ids), attention_mask=torch.as_tensor(mask),
                            output_router_logits=True).aux_loss.item()
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(**layout) if layout else None)
    model.set_params(state)
    assert abs(float(model.forward(input_ids, mask).aux_loss) - expected) < 1e-5
