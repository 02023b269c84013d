"""`moe_jax.nnx.MoeCausalLM`: the engine's parameters as `nnx.Param`s, its `apply` as `__call__`, and the
NNX workflow around it (nnx.Optimizer in nnx.jit, split / merge, orbax state across layouts, HF export)."""

from __future__ import annotations

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import moe_jax
import moe_jax.nnx
from moe_jax import DistributedConfig
from moe_jax.training import make_train_step

from ..heavy import representative
from ..inference.hf_generation import NEW_TOKENS
from ..inference.test_generate import fixture
from ..models.test_apply import count_compilations, jit_names
from ..training.hf_training import CHECKPOINT
from .conftest import adamw, batches, load_module, nnx_train_step

IDS = np.random.default_rng(0).integers(0, 128, (8, 12)).astype(np.int32)


@pytest.mark.parametrize("layout", representative(["one_device", "tp2_fsdp4_ep4", "fsdp8_ep8"],
                                                    suite=("tp2_fsdp4_ep4",)))
def test_the_module_holds_the_sharded_parameters_and_its_logits_are_apply_s(layout):
    model = load_module(layout)
    engine = model.engine
    assert engine.params is None                      # taken over: no second copy kept alive
    params = nnx.state(model, nnx.Param)
    assert len(jax.tree.leaves(params)) == len(engine.layer_stack.members)
    shardings = engine.storage_shardings()
    for name in model.storage_names:
        variable = model.variable(name)
        assert isinstance(variable, nnx.Param)
        assert variable.get_value().sharding == shardings[name]
        assert variable.out_sharding == moe_jax.nnx.module.partition_names(shardings[name].spec, variable.ndim)
        assert variable.mesh is engine.mesh
    # Flax's own helpers read the same layout from the metadata.
    for path, spec in nnx.to_flat_state(nnx.get_partition_spec(params)):
        assert spec.get_value() == shardings[".".join(map(str, path))].spec

    logits = model(IDS)
    expected = engine.apply(model.weights(), IDS, capacity=model.capacity).logits
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected))   # the same compiled program
    jitted = nnx.jit(lambda module, ids: module(ids))(model, IDS)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(expected), rtol=1e-6, atol=1e-6)
    statistics = model.dispatch_statistics.get_value()
    assert int(statistics.dropped) == 0
    if engine.layout.ep_size > 1:
        assert model.capacity == engine.capacity_schedule.largest      # exact without any host check
        assert float(statistics.required_capacity) > 0


def test_adamw_steps_with_nnx_optimizer_in_nnx_jit_give_the_train_step_s_losses():
    model = load_module("tp2_fsdp4_ep4")
    model.train()
    optimizer = moe_jax.nnx.commit_to_mesh(nnx.Optimizer(model, adamw(), wrt=nnx.Param), model)
    step = nnx.jit(nnx_train_step)

    engine = model.engine
    train_step = make_train_step(engine, adamw(), loss_chunk=512)
    state = train_step.init_state(params=model.weights(), capacity=model.capacity)

    ours, theirs = [], []

    def both_steps(batch):
        nonlocal state
        ours.append(float(step(model, optimizer, batch)["loss"]))
        state, metrics = train_step(state, batch)
        theirs.append(float(metrics["loss"]))

    first, *rest = batches(5)
    both_steps(first)
    with count_compilations() as count:        # committed optimizer scalars: one compilation of the step
        for batch in rest:
            both_steps(batch)
    assert count[0] == 0
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert ours[-1] < ours[0]
    # Two separately compiled programs: a gradient near 0 may differ by float noise (~1e-11 absolute), which Adam's
    # first step divides by eps (1e-8): lr * 1e-11 / eps = 3e-6 apart in a parameter (seen in 1 of 1024 q_proj
    # entries when XLA:CPU ordered the fused expert loop's work differently in the two programs).
    chex.assert_trees_all_close(model.weights(), dict(state.params), rtol=1e-5, atol=1e-5)
    # Parameters and optimizer state stay in the plans' shardings through the jitted updates.
    shardings = engine.storage_shardings()
    for name in model.storage_names:
        assert model.variable(name).get_value().sharding.is_equivalent_to(shardings[name], model.variable(name).ndim)
    adam_state = nnx.as_pure(optimizer.opt_state)[0]
    mu = nnx.to_flat_state(adam_state.mu)
    for path, leaf in mu:
        name = ".".join(str(part) for part in path)
        assert leaf.sharding.is_equivalent_to(shardings[name], leaf.ndim), name


def test_a_traced_step_traces_the_engine_s_math_into_the_caller_s_jit():
    """Under a jit (nnx.jit's split / merge, done here by hand to read the jaxpr) `__call__` and `loss` trace
    the engine's `step_math`, not `apply`'s nested jit; an eager call runs `apply` (the test above)."""
    model = load_module("tp2_fsdp4_ep4")
    graphdef, state = nnx.split(model)
    batch = batches(1)[0]

    def step(state, batch):
        module = nnx.merge(graphdef, state)
        (loss, _), grads = nnx.value_and_grad(lambda m: m.loss(**batch), has_aux=True)(module)
        return module(batch["input_ids"]), loss, grads

    assert "step_math" not in jit_names(jax.make_jaxpr(step)(state, batch).jaxpr)


def test_split_and_merge_round_trip():
    model = load_module("tp2_fsdp4_ep4")
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)
    assert merged.engine is model.engine and merged.capacity == model.capacity
    chex.assert_trees_all_equal(merged.weights(), model.weights())
    np.testing.assert_array_equal(np.asarray(merged(IDS)), np.asarray(model(IDS)))


# heavy: orbax restores onto another layout are in the suite through tests/converters/test_orbax_params.py
@pytest.mark.heavy
def test_an_orbax_save_of_nnx_state_restores_onto_another_layout(tmp_path):
    data = batches(3)
    step = nnx.jit(nnx_train_step)
    model = load_module("tp2_fsdp4_ep4")
    model.train()
    optimizer = moe_jax.nnx.commit_to_mesh(nnx.Optimizer(model, adamw(), wrt=nnx.Param), model)
    for batch in data[:2]:
        step(model, optimizer, batch)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "model", nnx.state(model))
    checkpointer.save(tmp_path / "optimizer", nnx.state(optimizer))
    checkpointer.wait_until_finished()
    saved = jax.device_get(model.weights())
    next_loss = float(step(model, optimizer, data[2])["loss"])

    def restore(layout: dict):
        # The restore target: the other layout's module without allocating it (nnx.eval_shape).
        abstract = nnx.eval_shape(lambda: moe_jax.nnx.AutoModelForCausalLM.from_config(
            CHECKPOINT, DistributedConfig(**layout)))
        abstract_optimizer = nnx.eval_shape(lambda: nnx.Optimizer(abstract, adamw(), wrt=nnx.Param))
        graphdef, target = nnx.split(abstract)
        optimizer_graphdef, optimizer_target = nnx.split(abstract_optimizer)
        restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "model", target))
        restored.engine.config = model.engine.config
        restored.train()
        return restored, nnx.merge(optimizer_graphdef, checkpointer.restore(tmp_path / "optimizer", optimizer_target))

    other, other_optimizer = restore(dict(fsdp_size=8, ep_size=8))
    chex.assert_trees_all_equal(jax.device_get(other.weights()), saved)
    shardings = other.engine.storage_shardings()
    assert all(other.variable(name).get_value().sharding == shardings[name] for name in other.storage_names)
    np.testing.assert_allclose(float(step(other, other_optimizer, data[2])["loss"]), next_loss, rtol=1e-6)

    same, same_optimizer = restore(dict(tp_size=2, fsdp_size=4, ep_size=4))
    assert float(step(same, same_optimizer, data[2])["loss"]) == next_loss


def test_save_pretrained_writes_the_module_s_parameters(tmp_path):
    model = load_module("tp2_fsdp4_ep4")
    model.save_pretrained(tmp_path / "hf", progress=False)
    reloaded = moe_jax.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", devices=jax.devices()[:1],
                                                            progress=False)
    chex.assert_trees_all_equal(jax.device_get(reloaded.params), jax.device_get(model.weights()))


def test_buffers_are_not_parameters():
    engine = moe_jax.AutoModelForCausalLM.from_pretrained(
        CHECKPOINT.parent / "deepseek_v3", devices=jax.devices()[:1], progress=False)
    model = moe_jax.nnx.MoeCausalLM(engine)
    buffers = nnx.to_flat_state(nnx.state(model, moe_jax.nnx.Buffer))
    assert buffers and all(path[-1] == "e_score_correction_bias" for path, _ in buffers)
    trainable = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert not any(name.endswith("e_score_correction_bias") for name in trainable)


def test_bad_requests_are_refused():
    engine = moe_jax.AutoModelForCausalLM.from_config(CHECKPOINT / "config.json", devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="no parameters"):
        moe_jax.nnx.MoeCausalLM(engine)
    with pytest.raises(ValueError, match="not on the dispatch capacity ladder"):
        load_module("tp2_fsdp4_ep4", capacity=1.7)


def test_generate_runs_on_the_module_s_parameters():
    model = load_module("one_device")
    expected = fixture("qwen3_moe")
    sequences = model.generate(expected["input_ids"], expected["attention_mask"], max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(sequences, expected["greedy"])       # Transformers' greedy tokens


def test_mixed_precision_layouts_compute_in_bfloat16():
    model = load_module("one_device", compute_dtype="bfloat16")
    assert model.compute_dtype == jax.numpy.bfloat16
    logits = model(IDS)
    expected = model.engine.apply(model.weights(), IDS, compute_dtype=jax.numpy.bfloat16).logits
    assert logits.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(logits, np.float32), np.asarray(expected, np.float32))
    mixed = moe_jax.nnx.MoeCausalLM(
        moe_jax.AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=2, fsdp_mixed_precision=True),
                                                     devices=jax.devices()[:2], progress=False))
    assert mixed.compute_dtype == jax.numpy.bfloat16            # as make_train_step's default


def test_scanned_layer_runs_are_variables_at_their_storage_paths():
    model = load_module("one_device", scan_layers=True)
    assert "1-2" in model.model["layers"]                      # layers 1 and 2 stacked, layer 0 (dense) alone
    stacked = model.variable("model.layers.1-2.mlp.experts.gate_up_proj")
    assert isinstance(stacked, nnx.Param) and stacked.shape[0] == 2
    expected = model.engine.apply(model.weights(), IDS).logits
    np.testing.assert_array_equal(np.asarray(model(IDS)), np.asarray(expected))


def test_routing_replays_through_the_module_s_call_and_loss():
    model = load_module("one_device")
    engine, weights = model.engine, model.weights()
    ids = np.random.default_rng(0).integers(0, engine.config.vocab_size, (2, 6)).astype(np.int32)
    recorded = np.asarray(engine.apply(weights, ids, return_routing=True).routing)
    forced = ((recorded + 1) % engine.config.num_experts).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(model(ids, routing=forced)),
                                  np.asarray(engine.apply(weights, ids, routing=forced).logits))
    assert float(model.loss(ids, routing=forced)[0]) != float(model.loss(ids)[0])
    with pytest.raises(ValueError, match="record it with return_routing=True"):
        model(ids, routing=forced[:, :1])
