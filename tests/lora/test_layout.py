"""An adapter's layout on a built model: storage names (scanned runs stacked), shardings that follow the adapted
weight's tensor / expert split, PEFT's initialisation, and factors attached beside the base arrays (not copies)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moe_jax.causal_lm
from moe_jax import DistributedConfig
from moe_jax.lora import LoraConfig
from moe_jax.ops.lora import LoraFactors

from ..models.hf_reference import TINY_QWEN3_MOE

CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


@pytest.fixture(scope="module")
def model():
    model = moe_jax.causal_lm.MODEL_CLASSES["qwen3_moe"](
        TINY_QWEN3_MOE, DistributedConfig(tp_size=2, fsdp_size=2, ep_size=4), devices=jax.devices()[:4],
        scan_layers=True)
    model.init_params(0)
    model.add_adapter(CONFIG, seed=3)
    return model


def test_storage_follows_the_layer_stack(model):
    shapes = model.adapter_layout.storage_shapes()
    assert shapes["model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, 32)          # the dense first layer
    assert shapes["model.layers.1-2.self_attn.q_proj.lora_B.weight"] == (2, 32, 4)     # a scanned run: stacked
    assert shapes["model.layers.1-2.mlp.experts.gate_up_proj.lora_A"] == (2, 8, 4, 32)  # [L, E, r, H]
    assert shapes["model.layers.1-2.mlp.experts.down_proj.lora_B"] == (2, 8, 32, 4)     # [L, E, H, r]
    per_layer = model.adapter_layout.per_layer(model.adapter)
    np.testing.assert_array_equal(per_layer["model.layers.2.mlp.experts.gate_up_proj.lora_A"],
                                  model.adapter["model.layers.1-2.mlp.experts.gate_up_proj.lora_A"][1])


def test_factors_are_split_as_the_weight_they_adapt_without_fsdp(model):
    specs = {name: array.sharding.spec for name, array in model.adapter.items()}
    experts = ("ep_fsdp", "tp")   # tp2 x fsdp2 with ep4: the ep group
    assert specs["model.layers.0.self_attn.q_proj.lora_A.weight"] == P(None, None)     # colwise: B split
    assert specs["model.layers.0.self_attn.q_proj.lora_B.weight"] == P("tp", None)
    assert specs["model.layers.0.self_attn.o_proj.lora_A.weight"] == P(None, "tp")     # rowwise: A split
    assert specs["model.layers.0.self_attn.o_proj.lora_B.weight"] == P(None, None)
    for name in ("gate_up_proj.lora_A", "gate_up_proj.lora_B", "down_proj.lora_A", "down_proj.lora_B"):
        assert specs[f"model.layers.1-2.mlp.experts.{name}"] == P(None, experts, None, None)   # with their experts


def test_initialisation_is_peft_s_a_kaiming_uniform_b_zero(model):
    per_layer = model.adapter_layout.per_layer(model.adapter)
    for name in per_layer:
        values = np.asarray(per_layer[name])
        if ".lora_B" in name:
            assert not values.any(), name
        else:
            bound = 1 / np.sqrt(values.shape[-1])   # U(-1/sqrt(in), 1/sqrt(in)): kaiming_uniform_(a=sqrt(5))
            assert 0.5 * bound < np.abs(values).max() <= bound, name


def test_attach_puts_factors_beside_the_same_base_arrays(model):
    nested = model.nested_weights(model.params, model.adapter)
    attention = nested["model"]["layers"]["1-2"]["self_attn"]
    assert attention["q_proj"]["weight"] is model.params["model.layers.1-2.self_attn.q_proj.weight"]
    factors = attention["q_proj"]["lora"]["weight"]
    assert isinstance(factors, LoraFactors) and factors.scaling == 2.0
    assert factors.a is model.adapter["model.layers.1-2.self_attn.q_proj.lora_A.weight"]
    experts = nested["model"]["layers"]["1-2"]["mlp"]["experts"]
    assert set(experts["lora"]) == {"gate_up_proj", "down_proj"}
    assert "lora" not in model.layer_stack.nest(model.params)["model"]["layers"]["1-2"]["self_attn"]["q_proj"]
