"""jax.grad through every parallel path gives the single-device gradients: attention (TP), router, and
experts (EP all_to_all / all_reduce, TP experts), for every parameter of a tiny Qwen3-MoE, with layers
unrolled, scanned, and scanned under remat."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import Qwen3MoeForCausalLM

from .hf_reference import TINY_QWEN3_MOE

# (layout, layer options): unrolled and scanned layers; remat on two. HSDP replicas and the all_reduce
# experts: the training curve (tests/training/test_loss_curves.py) and every layout's curve
# (scripts/checks/check_training_layouts.py).
CASES = [
    (dict(tp_size=2, fsdp_size=4, ep_size=4), dict(scan_layers=True, remat="full")),
    (dict(fsdp_size=8, ep_size=8), dict(scan_layers=True, remat="dots_saveable")),
]
# Unrolled layers and tp without EP get their gradients checked through the training curves
# (tests/training/test_loss_curves.py; every layout: scripts/checks/check_training_layouts.py).


def loss_and_grads(model, params, input_ids, targets):
    """Mean token cross-entropy and its gradient wrt every parameter, under HF names (capacity: the largest,
    so no recomputation is needed inside a gradient)."""

    def loss(params):
        logits = model.apply(params, input_ids, inference=False).logits
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return value, dict(model.hf_params(grads))


@pytest.fixture(scope="module")
def single_device():
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, scan_layers=False)
    model.init_params(seed=3)
    # A sharper router, so the top-k choice is far from ties.
    params = {name: (value * 20 if name.endswith("mlp.gate.weight") else value)
              for name, value in model.hf_params().items()}
    rng = np.random.default_rng(1)
    input_ids = jnp.asarray(rng.integers(0, TINY_QWEN3_MOE["vocab_size"], (8, 9)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, TINY_QWEN3_MOE["vocab_size"], (8, 9)), jnp.int32)
    host_params = {name: np.asarray(value) for name, value in params.items()}
    loss, grads = loss_and_grads(model, params, input_ids, targets)
    return host_params, input_ids, targets, float(loss), jax.device_get(grads)


def _case_id(case):
    layout, options = case
    return "-".join([f"{k.split('_')[0]}{v}" for k, v in layout.items()] + [f"{k}={v}" for k, v in options.items()])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gradients_match_single_device(single_device, case):
    layout, options = case
    host_params, input_ids, targets, expected_loss, expected_grads = single_device
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(**layout), **options)
    assert model.layer_stack.scanned == options["scan_layers"]
    model.set_params(host_params)
    loss, grads = loss_and_grads(model, model.params, input_ids, targets)
    assert abs(float(loss) - expected_loss) < 1e-5
    chex.assert_trees_all_close(jax.device_get(dict(grads)), expected_grads, atol=2e-6, rtol=1e-4)
