"""In-place weight updates (`update_parameters` on the serving engine, the manager and the generator): a trainer's
new parameters, from another device and dtype, take effect at the next step with no new compilation, and generate
what an engine built on them generates; a LoRA adapter's arrays alone; a tree that does not fit is refused naming
its first bad key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.inference import ContinuousBatchingConfig, Request, RequestSettings, ServingEngine
from moe_jax.lora import LoraConfig

from .test_continuous import fixture_prompts, load

CONFIG = ContinuousBatchingConfig(max_slots=2, page_size=4, max_model_len=32, prefill_chunk=4)


@pytest.fixture(scope="module")
def model():
    return load("qwen3_moe")


def trained(params: dict) -> dict:
    """New parameters as a trainer on another device would hand them over: routers and head reversed (other
    experts, other tokens), on the last device."""
    flipped = ("mlp.gate.weight", "lm_head.weight")
    return {name: jax.device_put(value * (-1.0 if name.endswith(flipped) else 1.0), jax.devices()[-1])
            for name, value in params.items()}


def greedy(engine: ServingEngine, prompts) -> list[list[int]]:
    requests = [Request(f"r{i}", prompt, RequestSettings(max_new_tokens=4)) for i, prompt in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    while engine.has_work():
        engine.step()
    return [request.output.generated_tokens for request in requests]


def test_new_parameters_run_the_same_programs_and_generate_a_fresh_engines_tokens(model):
    prompts, _, _ = fixture_prompts("qwen3_moe")
    engine = ServingEngine(model, CONFIG)
    before = greedy(engine, prompts)
    programs = engine.compilations
    new = trained(model.params)
    engine.update_parameters(new)
    after = greedy(engine, prompts)
    assert engine.compilations == programs and after != before
    assert all(engine.params[name].sharding == model.params[name].sharding for name in model.params)
    # A fresh engine on the new parameters (kept by the model: the manager's test reuses its programs).
    fresh = model.continuous_batching_engine(CONFIG, params=jax.device_put(new, model.storage_shardings()))
    assert greedy(fresh, prompts) == after


def test_a_running_manager_swaps_the_weights_in_between_steps(model):
    prompts, _, _ = fixture_prompts("qwen3_moe")
    with model.init_continuous_batching(continuous_batching_config=CONFIG) as manager:
        before = manager.get_result(manager.add_request(prompts[0], max_new_tokens=4), timeout=60)
        programs = manager.engine.compilations
        manager.update_parameters(trained(model.params))
        after = manager.get_result(manager.add_request(prompts[0], max_new_tokens=4), timeout=60)
    assert manager.engine.compilations == programs and after.generated_tokens != before.generated_tokens
    fresh = model.continuous_batching_engine(CONFIG, params=jax.device_put(trained(model.params),
                                                                          model.storage_shardings()))
    assert greedy(fresh, prompts[:1]) == [after.generated_tokens]


def test_a_tree_that_does_not_fit_is_refused_naming_its_first_bad_key(model):
    engine = ServingEngine(model, CONFIG)
    name = next(iter(model.params))
    with pytest.raises(ValueError, match=rf"\['{name}'\] is missing"):
        engine.update_parameters({key: value for key, value in model.params.items() if key != name})
    with pytest.raises(ValueError, match=r"\['extra'\] is not one of the engine's params"):
        engine.update_parameters({**model.params, "extra": np.zeros(2)})
    with pytest.raises(ValueError, match=rf"\['{name}'\] has shape \(1,"):
        engine.update_parameters({**model.params, name: np.zeros((1,) + model.params[name].shape)})
    with pytest.raises(ValueError, match=rf"\['{name}'\] has dtype int32"):
        engine.update_parameters({**model.params, name: np.zeros(model.params[name].shape, np.int32)})
    engine.update_parameters({**model.params, name: model.params[name].astype(jnp.bfloat16)})   # cast back
    assert engine.params[name].dtype == model.params[name].dtype


def test_the_generator_takes_new_parameters_without_recompiling(model):
    _, _, expected = fixture_prompts("qwen3_moe")
    ids, mask = expected["input_ids"], expected["attention_mask"]
    original = model.params
    model.generate(ids, mask, max_new_tokens=3)
    programs = model.generator.compilations
    new = trained(original)
    try:
        model.generator.update_parameters(new)
        after = model.generate(ids, mask, max_new_tokens=3)
        assert model.generator.compilations == programs
    finally:
        model.params = original
    np.testing.assert_array_equal(after, model.generate(ids, mask, max_new_tokens=3,
                                                       params=jax.device_put(new, model.storage_shardings())))


@pytest.mark.heavy   # the suite's parameter update: the base weights' test above
def test_an_adapters_arrays_are_replaced_alone():
    lora = load("qwen3_moe")
    lora.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    prompts, _, _ = fixture_prompts("qwen3_moe")
    engine = ServingEngine(lora, CONFIG)
    base = greedy(engine, prompts[:2])
    programs = engine.compilations
    adapter = {name: np.asarray(value) + 0.5 for name, value in lora.adapter.items()}   # B != 0: it adapts now
    engine.update_parameters(adapter=adapter)
    adapted = greedy(engine, prompts[:2])
    assert engine.compilations == programs and adapted != base
    lora.set_adapter_params(adapter)
    assert greedy(ServingEngine(lora, CONFIG), prompts[:2]) == adapted
