"""The facade's adapter verbs (Transformers' names): add_adapter, apply(adapter=), save_adapter / load_adapter,
merge_adapter, and the errors for an adapter that does not fit."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import moe_jax.causal_lm
from moe_jax import DistributedConfig
from moe_jax.lora import LoraConfig

from ..models.hf_reference import TINY_QWEN3_MOE

CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
IDS = np.random.default_rng(0).integers(3, 128, (8, 10)).astype(np.int32)


def qwen3(layout=None, values=TINY_QWEN3_MOE):
    distributed = DistributedConfig(**layout) if layout else None
    model = moe_jax.causal_lm.MODEL_CLASSES["qwen3_moe"](values, distributed,
                                                         devices=jax.devices()[:8 if layout else 1])
    model.init_params(0)
    return model


def random_factors(model, seed=1):
    rng = np.random.default_rng(seed)
    model.set_adapter_params({name: 0.2 * rng.standard_normal(array.shape).astype(np.float32)
                              for name, array in model.adapter.items()})


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(model on fsdp8/ep8 with a random adapter, its base logits, its adapted logits, the saved adapter dir)."""
    model = qwen3(dict(fsdp_size=8, ep_size=8))
    base = np.asarray(model(IDS))
    model.add_adapter(CONFIG)
    np.testing.assert_allclose(np.asarray(model(IDS)), base, atol=1e-6, rtol=0)   # B = 0: the base model
    random_factors(model)
    directory = tmp_path_factory.mktemp("adapter")
    model.save_adapter(directory)
    return model, base, np.asarray(model(IDS)), directory


def test_apply_takes_the_adapter_as_an_argument_and_leaves_the_params_alone(adapted):
    model, base, logits, _ = adapted
    assert np.abs(logits - base).max() > 0.05
    np.testing.assert_allclose(np.asarray(model.apply(model.params, IDS, adapter=model.adapter).logits), logits,
                               atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(model.apply(model.params, IDS).logits), base, atol=1e-6, rtol=0)


def test_a_saved_adapter_loads_on_another_layout_with_the_same_logits(adapted):
    model, _, logits, directory = adapted
    other = qwen3(dict(tp_size=2, fsdp_size=4))
    other.set_params(model.hf_params())
    other.load_adapter(directory)
    assert other.adapter_config == model.adapter_config
    np.testing.assert_allclose(np.asarray(other(IDS)), logits, atol=1e-5, rtol=0)


def test_merging_gives_the_unmerged_logits_and_drops_the_adapter(adapted):
    model, _, logits, directory = adapted
    single = qwen3()
    single.set_params(model.hf_params())
    single.load_adapter(directory)
    merged = single.merged_params()
    assert merged["lm_head.weight"] is single.params["lm_head.weight"]       # an unadapted weight: the same array
    single.merge_adapter()
    assert single.adapter is None and single.adapter_layout is None
    np.testing.assert_allclose(np.asarray(single(IDS)), logits, atol=1e-5, rtol=0)


def test_an_adapter_of_another_model_is_refused_listing_the_shapes(adapted, tmp_path):
    _, _, _, directory = adapted
    wider = qwen3(values={**TINY_QWEN3_MOE, "moe_intermediate_size": 24})
    with pytest.raises(ValueError, match=r"does not fit this model: \d+ shape mismatch\(es\): "
                                         r"base_model\.model\.model\.layers\.1\.mlp\.experts.*\[32, 16\] in the file, "
                                         r"\[32, 24\] for this model"):
        wider.load_adapter(directory)
    deeper = qwen3(values={**TINY_QWEN3_MOE, "num_hidden_layers": 4})
    with pytest.raises(ValueError, match=r"\d+ missing: base_model\.model\.model\.layers\.3\."):
        deeper.load_adapter(directory)
    with pytest.raises(FileNotFoundError, match=r"no adapter_config.json"):
        deeper.load_adapter(tmp_path)


def test_one_adapter_at_a_time_and_an_adapter_argument_needs_one(adapted):
    model, _, _, _ = adapted
    with pytest.raises(ValueError, match=r"already has an adapter; delete_adapter\(\)"):
        model.add_adapter(CONFIG)
    plain = qwen3()
    with pytest.raises(ValueError, match=r"has no adapter; add_adapter"):
        plain.apply(plain.params, IDS, adapter={})
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.self_attn.o_proj.lora_A.weight'"):
        model.apply(model.params, IDS, adapter={})
