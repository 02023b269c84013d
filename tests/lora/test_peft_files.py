"""PEFT's adapter files both ways on Qwen3-MoE: an adapter PEFT 0.21 made on a Transformers 5.23 model (attention
projections and the fused experts, non-zero B) loads with `load_adapter` and gives PeftModel's logits on one device
and on sharded layouts; an adapter moe_jax saves loads in `PeftModel.from_pretrained` with the same logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import moe_jax.causal_lm
from moe_jax import DistributedConfig
from moe_jax.distributed.mesh import DeviceLayout
from moe_jax.lora.peft_files import WEIGHTS_FILE, peft_key

from ..heavy import representative
from ..models.hf_reference import LOGITS_ATOL

pytestmark = [pytest.mark.reference, pytest.mark.peft]

# One device, tp and ep with fsdp, all of fsdp8/ep8, and pipeline stages (with fsdp and ep inside each).
LAYOUTS = [None, dict(tp_size=2, fsdp_size=2, ep_size=4), dict(fsdp_size=8, ep_size=8),
           dict(pp_size=2, fsdp_size=2, ep_size=2)]


def layout_id(layout) -> str:
    return "single" if layout is None else "-".join(f"{k.split('_')[0]}{v}" for k, v in layout.items())


def build(model_type: str, config_values: dict, layout: dict | None, state: dict):
    distributed = DistributedConfig(**layout) if layout else None
    devices = jax.devices()[:DeviceLayout.from_config(distributed).num_devices] if layout else None
    model = moe_jax.causal_lm.MODEL_CLASSES[model_type](config_values, distributed, devices=devices)
    model.set_params(state)
    return model


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory):
    from .peft_reference import TINY_CONFIGS, input_ids, peft_logits, peft_model

    state, model = peft_model("qwen3_moe")
    directory = tmp_path_factory.mktemp("peft_adapter")
    model.save_pretrained(str(directory))
    ids = input_ids()
    return state, directory, ids, peft_logits(model, ids), TINY_CONFIGS["qwen3_moe"]


# The suite runs one device and the two EP layouts; --heavy adds pipeline stages.
@pytest.mark.parametrize("layout", representative(LAYOUTS, suite=("single", "tp2-fsdp2-ep4", "fsdp8-ep8"),
                                                  ids=[layout_id(layout) for layout in LAYOUTS]))
def test_a_peft_adapter_gives_peft_s_logits(peft_adapter, layout):
    state, directory, ids, expected, config = peft_adapter
    model = build("qwen3_moe", config, layout, state)
    model.load_adapter(directory)
    np.testing.assert_allclose(np.asarray(model(ids)), expected, atol=LOGITS_ATOL, rtol=0)
    assert model.params.keys() == model.layer_stack.members.keys()   # the base is untouched: no factor in it


def test_our_keys_are_peft_s(peft_adapter):
    """Every key PEFT wrote is one moe_jax names, nested ParamWrappers' `.base_layer` included, and back."""
    state, directory, _, _, config = peft_adapter
    model = build("qwen3_moe", config, None, state)
    model.load_adapter(directory)
    ours = {peft_key(target, factor) for target in model.adapter_layout.targets for factor in "AB"}
    assert ours == set(load_file(str(directory / WEIGHTS_FILE)))
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in ours   # gate_up_proj


def test_an_adapter_we_save_loads_in_peft_with_our_logits(peft_adapter, tmp_path):
    """Ours -> PEFT on fsdp8/ep8: random factors (A and B) set on our side, saved, read by PeftModel."""
    from moe_jax.lora import LoraConfig

    from .peft_reference import peft_loads, peft_logits

    state, _, ids, _, config = peft_adapter
    model = build("qwen3_moe", config, dict(fsdp_size=8, ep_size=8), state)
    model.add_adapter(LoraConfig(r=4, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "o_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    rng = np.random.default_rng(1)
    model.set_adapter_params({name: 0.2 * rng.standard_normal(array.shape).astype(np.float32)
                              for name, array in model.adapter.items()})
    model.save_adapter(tmp_path / "ours")
    ours = np.asarray(model(ids))
    np.testing.assert_allclose(ours, peft_logits(peft_loads("qwen3_moe", state, tmp_path / "ours"), ids),
                               atol=LOGITS_ATOL, rtol=0)
