"""Dropless NNX training below the largest capacity: a step that dropped pairs is undone in the jitted
step (`update_unless_dropped`) and replayed after `update_capacity` raised the capacity."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_jax.nnx
from moe_jax.distributed.capacity import DispatchStatistics

from .conftest import adamw, load_module

# Every token is the same id: all pick the same experts, far beyond the smallest capacity's buffers.
ADVERSARIAL = {"input_ids": np.full((8, 12), 7, np.int32)}


def guarded_step(model, optimizer, batch):
    (loss, _), grads = nnx.value_and_grad(lambda module: module.loss(**batch), has_aux=True)(model)
    applied = moe_jax.nnx.update_unless_dropped(optimizer, model, grads)
    return loss, applied


# heavy: the replay is the train step's in tests/training; the module shares it
@pytest.mark.heavy
def test_a_step_that_dropped_pairs_is_undone_and_replayed_at_the_capacity_it_required():
    model = load_module("tp2_fsdp4_ep4")
    schedule = model.engine.capacity_schedule
    model.set_capacity(schedule.ladder[0])
    model.train()
    optimizer = moe_jax.nnx.commit_to_mesh(nnx.Optimizer(model, adamw(), wrt=nnx.Param), model)
    step = nnx.jit(guarded_step)
    before = jax.device_get(model.weights())

    _, applied = step(model, optimizer, ADVERSARIAL)
    assert not bool(applied)
    chex.assert_trees_all_equal(jax.device_get(model.weights()), before)
    assert int(optimizer.step.get_value()) == 0
    assert model.update_capacity()                         # dropped: replay
    raised = model.capacity
    assert raised > schedule.ladder[0]

    model.set_capacity(schedule.largest)                   # buffers that hold every pair: the exact loss
    exact_loss, _ = model.loss(**ADVERSARIAL)
    model.set_capacity(raised)
    loss, applied = step(model, optimizer, ADVERSARIAL)
    assert bool(applied) and not model.update_capacity()
    assert int(optimizer.step.get_value()) == 1
    np.testing.assert_allclose(float(loss), float(exact_loss), rtol=1e-6)



def test_calm_calls_are_counted_on_the_host_without_changing_the_graph():
    model = load_module("tp2_fsdp4_ep4", capacity=3.0)
    graphdef = nnx.graphdef(model)
    calm = DispatchStatistics(*(jnp.zeros((), jnp.int32),) * 3, jnp.asarray(1.5, jnp.float32))   # fits rung 2.0
    for calls in range(1, 4):
        model.dispatch_statistics.set_value(calm)
        assert not model.update_capacity()
        assert model.capacity_streak.calm_calls == calls and model.capacity == 3.0
    assert nnx.graphdef(model) == graphdef          # an nnx.jit step would not compile again
