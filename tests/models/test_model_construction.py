"""What building a model through the public constructors refuses or warns about."""

import warnings

import pytest

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


def test_pipeline_parallelism_is_refused_when_the_model_is_built():
    config = DistributedConfig(tp_size=4, pp_size=2)  # a legal layout: pp combines with TP
    with pytest.raises(NotImplementedError, match="pp_size=2: pipeline parallelism is not implemented"):
        AutoModelForCausalLM.from_config(CONFIG, config)
    with pytest.raises(NotImplementedError, match="pp_size=2"):
        AutoModelForCausalLM.from_config(CONFIG, config, abstract=True)
