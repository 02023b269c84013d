"""The next step's expert load (`moe_jax.training.load_probe`): what the step on that batch then reports, with the
state left as it was."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.training import make_train_step
from moe_jax.training.load_probe import NextLoadProbe

from ..models.test_apply import count_compilations
from .hf_training import CHECKPOINT


def test_the_probe_gives_the_load_the_next_step_reports_and_leaves_the_state():
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False, num_redundant_experts=8)
    train_step = make_train_step(model, optax.adamw(1e-2), grad_accum=2)
    probe = NextLoadProbe(train_step)
    rng = np.random.default_rng(0)
    batches = [{"input_ids": rng.integers(0, 128, (16, 32)).astype(np.int32)} for _ in range(3)]
    for batch in batches:
        batch["input_ids"][:, ::2] = 75
    state = train_step.init_state(seed=0, capacity=model.capacity_schedule.largest)
    for batch in batches:
        before = jax.tree.map(np.asarray, state.params)
        predicted = probe(state, batch)
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)   # not donated
        state, metrics = train_step(state, batch)
        assert predicted.shape == (2, 8) and predicted.sum() == 2 * 16 * 32 * 2     # 2 sparse layers, top-2
        np.testing.assert_array_equal(predicted, np.asarray(metrics["expert_load"]))


def test_a_model_without_sparse_layers_has_no_load_to_probe():
    config = {**AutoModelForCausalLM.from_pretrained(CHECKPOINT, progress=False, devices=jax.devices()[:1])
              .config.to_dict(), "mlp_only_layers": [0, 1, 2]}
    model = AutoModelForCausalLM.from_config(config, devices=jax.devices()[:1])
    model.init_params(seed=0)
    with pytest.raises(ValueError, match="needs a model with sparse layers"):
        NextLoadProbe(make_train_step(model, optax.sgd(0.1)))


def test_a_precompiled_probe_compiles_nothing_when_a_re_placement_runs_it():
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, DistributedConfig(fsdp_size=8, ep_size=8),
                                                 progress=False, num_redundant_experts=8)
    train_step = make_train_step(model, optax.sgd(0.1))
    probe = NextLoadProbe(train_step)
    batch = {"input_ids": np.random.default_rng(0).integers(0, 128, (8, 16)).astype(np.int32)}
    state = train_step.init_state(seed=0, capacity=model.capacity_schedule.largest)
    ladder = model.capacity_schedule.ladder
    seconds = probe.precompile(state, batch, ladder[-2:])
    assert list(seconds) == list(ladder[-2:]) and probe.precompile(state, batch, ladder[-1:]) == {}
    with count_compilations("_load") as compiled:
        for capacity in ladder[-2:]:
            load = probe(state.replace(capacity=capacity), batch)
    assert compiled[0] == 0 and load.sum() == 8 * 16 * 2 * 2
