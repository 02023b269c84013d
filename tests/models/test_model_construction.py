"""What building a model through the public constructors refuses or warns about, and what a config assigned
after construction does."""

import dataclasses
import warnings

import jax
import numpy as np
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.causal_lm import MixtralForCausalLM

from .hf_reference import TINY_MIXTRAL, TINY_QWEN3_MOE

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


def jitter_logits(model, ids) -> np.ndarray:
    """A training forward (router jitter on when the config asks for it) with a fixed key."""
    return np.asarray(model.apply(model.params, ids, inference=False, rng=jax.random.key(3)).logits)


def test_a_config_assigned_after_construction_reaches_the_layers():
    """`model.config = dataclasses.replace(...)` is the frozen config's way to change a setting; the layers used
    to keep the config they were built with (router jitter switched on this way never ran). After the change the
    step, already compiled once with the old config, equals a model built with the new one."""
    model = MixtralForCausalLM(TINY_MIXTRAL, devices=jax.devices()[:1])
    model.init_params(seed=1)
    ids = np.random.default_rng(0).integers(0, TINY_MIXTRAL["vocab_size"], (2, 6)).astype(np.int32)
    before = jitter_logits(model, ids)
    model.config = dataclasses.replace(model.config, router_jitter_noise=0.1)
    built = MixtralForCausalLM({**TINY_MIXTRAL, "router_jitter_noise": 0.1}, devices=jax.devices()[:1])
    built.set_params(model.hf_params())
    after = jitter_logits(model, ids)
    np.testing.assert_allclose(after, jitter_logits(built, ids), rtol=0, atol=1e-6)
    assert not np.allclose(after, before, atol=1e-4)


@pytest.mark.parametrize("change", [dict(hidden_size=64), dict(num_hidden_layers=3), dict(sliding_window=None)])
def test_a_config_change_the_built_model_cannot_follow_is_refused(change):
    """Parameter shapes, the layer count and the layers' kinds are fixed when the model is built: such a change
    says to build a new model, and the model keeps its config."""
    model = MixtralForCausalLM(TINY_MIXTRAL, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=f"model.config \\({next(iter(change))}\\).*build a new model"):
        model.config = dataclasses.replace(model.config, **change)
    assert model.config.hidden_size == TINY_MIXTRAL["hidden_size"]
    assert model.core.config is model.config
