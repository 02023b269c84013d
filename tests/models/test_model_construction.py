"""What building a model through the public constructors refuses or warns about."""

import warnings

from moe_jax import AutoModelForCausalLM, DistributedConfig

from .hf_reference import TINY_QWEN3_MOE

CONFIG = {**TINY_QWEN3_MOE, "model_type": "qwen3_moe"}
NO_DISPATCH = "the EP plan has no `ep_dispatch_experts` rule"


def built_with_warnings(distributed_config) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_config(CONFIG, distributed_config)
    return [str(warning.message) for warning in caught]


def test_an_ep_plan_without_token_dispatch_warns():
    """The reference silently skips such a plan (docs/design.md); we shard the expert weights and say so."""
    config = DistributedConfig(fsdp_size=8, ep_size=8, ep_plan={"model.layers.*.mlp.experts": "grouped_gemm"})
    messages = [message for message in built_with_warnings(config) if NO_DISPATCH in message]
    assert len(messages) == 1 and messages[0].startswith("ep_size=8 but the EP plan")
    assert "Add `'<...>.mlp.experts': 'ep_dispatch_experts'` to ep_plan" in messages[0]


def test_the_default_ep_plan_does_not_warn():
    assert not [m for m in built_with_warnings(DistributedConfig(fsdp_size=8, ep_size=8)) if NO_DISPATCH in m]


def test_pipeline_stages_are_built_on_the_pp_axis():
    """pp_size > 1 builds (tests/models/test_pipeline.py checks what it computes): layer parameters stored by
    pipeline group, each stage's rows on its devices."""
    config = DistributedConfig(tp_size=4, pp_size=2)
    model = AutoModelForCausalLM.from_config(CONFIG, config)
    assert model.layer_stack.pipeline is not None and model.pipeline_microbatches == 2
    stacked = [name for name in model.layer_stack.members if model.layer_stack.is_stacked(name)]
    assert stacked and all(model.storage_shardings()[name].spec[0] == "pp" for name in stacked)
    assert AutoModelForCausalLM.from_config(CONFIG, config, abstract=True).layer_stack.pipeline is not None
