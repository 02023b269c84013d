"""Training only what is asked (`make_train_step(trainable=)`): the state holds the trained arrays and their
optimizer state only, frozen arrays stay bit-identical, and XLA forms no weight gradient of a frozen weight."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest

import moe_jax.causal_lm
from moe_jax import DistributedConfig
from moe_jax.lora import LoraConfig
from moe_jax.training import make_train_step
from moe_jax.training.trainable import freezing, resolve_trainable

from ..models.hf_reference import TINY_QWEN3_MOE

# Widths no other weight has, so the experts' weight gradients are recognisable in the compiled program.
CONFIG = {**TINY_QWEN3_MOE, "moe_intermediate_size": 24}
BATCH = {"input_ids": np.random.default_rng(0).integers(3, 128, (8, 16)).astype(np.int32)}


def qwen3(layout=None, **options):
    model = moe_jax.causal_lm.MODEL_CLASSES["qwen3_moe"](
        CONFIG, DistributedConfig(**layout) if layout else None, devices=jax.devices()[:8 if layout else 1],
        **options)
    model.init_params(0)
    return model


def host(tree):
    return jax.tree.map(np.asarray, tree)


def state_parameter_names(opt_state) -> set[str]:
    """Every parameter name the optimizer state keeps a moment for."""
    names = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        names |= {entry.key for entry in path if isinstance(getattr(entry, "key", None), str)}
    return names


def test_a_lora_state_holds_the_adapter_and_its_moments_only_and_the_base_stays_bit_identical():
    model = qwen3(dict(fsdp_size=8, ep_size=8))
    model.add_adapter(LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    base = host(model.params)
    train_step = make_train_step(model, optax.adamw(1e-2))
    state = train_step.init_state(capacity=model.capacity_schedule.largest)
    assert state.params.keys() == model.adapter.keys()
    adam = state.opt_state[0]
    for moments in (adam.mu, adam.nu):
        assert {name: leaf.shape for name, leaf in moments.items()} == model.adapter_layout.storage_shapes()
    assert state_parameter_names(state.opt_state) == set(model.adapter)
    for _ in range(2):
        state, metrics = train_step(state, BATCH)
    assert bool(metrics["applied"])
    assert all(np.array_equal(base[name], np.asarray(value)) for name, value in model.params.items())
    assert not np.array_equal(np.asarray(state.params["model.layers.1.mlp.experts.gate_up_proj.lora_B"]), 0)


def test_a_glob_trains_its_parameters_only():
    model = qwen3()
    base = host(model.params)
    train_step = make_train_step(model, optax.sgd(1e-1), trainable="*.mlp.gate.*")
    routers = {f"model.layers.{layer}.mlp.gate.weight" for layer in (1, 2)}
    state = train_step.init_state()
    assert set(state.params) == routers
    state, _ = train_step(state, BATCH)
    assert all(not np.array_equal(base[name], np.asarray(state.params[name])) for name in routers)
    params, adapter = train_step.weights(state.params)
    assert adapter is None and params.keys() == base.keys()
    assert all(np.array_equal(base[name], np.asarray(model.params[name])) for name in base)


def test_frozen_weights_get_no_weight_gradient_in_the_compiled_step():
    """The experts' weight gradients are contractions over rows producing [2I, H] and [H, I] per expert; a step
    that trains only attention adapters has none (XLA drops the dead ones the kernels' VJPs would form)."""
    def weight_gradient_dots(trainable) -> int:
        model = qwen3()
        model.add_adapter(LoraConfig(r=4, target_modules=["q_proj"]))
        train_step = make_train_step(model, optax.sgd(1e-2), trainable=trainable)
        text = train_step.lower(train_step.init_state(), BATCH).compile().as_text()
        return len(re.findall(r"= f32\[(?:48,32|32,24)\]\{[^}]*\} dot\([^)]*\), lhs_contracting_dims=\{0\}", text))

    assert weight_gradient_dots("*.experts.*") > 0    # the experts trained: their gradients are formed
    assert weight_gradient_dots(None) == 0            # the adapter alone


def test_a_selection_must_take_a_scanned_run_whole_and_select_something():
    model = qwen3(scan_layers=True)
    with pytest.raises(ValueError, match=r"selects model.layers.1.mlp.gate.weight but not model.layers.2.mlp.gate"
                                         r".*same array \(model.layers.1-2.mlp.gate.weight\).*scan_layers=False"):
        resolve_trainable(model, "model.layers.1.mlp.gate.*")
    with pytest.raises(ValueError, match=r"trainable=\['\*.nothing'\] selects no parameter"):
        resolve_trainable(model, ["*.nothing"])
    assert resolve_trainable(model, lambda name: "layers.1" in name or "layers.2" in name).base
    with pytest.raises(ValueError, match=r"--freeze '\*.router.\*' matches none of the model's parameters"):
        freezing(model, ["*.router.*"])
    frozen_routers = resolve_trainable(model, freezing(model, ["*.mlp.gate.*"]))
    assert "model.layers.1-2.mlp.gate.weight" not in frozen_routers.base and len(frozen_routers.base) > 10
