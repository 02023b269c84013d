"""The step engine (`model.apply`, `forward`, capacity as the caller's state) on a tiny Qwen3-MoE.

apply is pure and traceable, never reads a device value on the host, compiles once per static key, and a
train-style step (value_and_grad on hidden states, optax, donated state) runs without recompiling; forward
stays exact when a dispatch overflows, and the capacity comes back down after balanced batches.
"""

import contextlib
from functools import partial

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import Qwen3MoeForCausalLM
from moe_jax.distributed.capacity import CapacitySchedule
from moe_jax.distributed.expert_parallel import AllToAllEP, EPImplementation, EPImplementationInterface
from moe_jax.inference import init_cache
from moe_jax.models.outputs import ModelOutput

from .hf_reference import TINY_QWEN3_MOE

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Where compiled programs are cached on disk (the tests' subprocesses, tests/conftest.py; a user's
# JAX_COMPILATION_CACHE_DIR), a program found there is loaded instead of compiled, but it was still asked
# for, which is what these counts are about.
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def count_compilations(name: str | None = None):
    """Counts compilations requested inside the block (compiled, or loaded from the persistent cache):
    `with count_compilations() as count: ...; count[0]`. With `name`, only programs whose function name
    contains it (the backend-compile event names its function; small eager ops a fresh process compiles
    on first use are not counted then)."""
    count = [0]

    def on_duration(event, duration, fun_name=None, **kwargs):
        if event == BACKEND_COMPILE_EVENT and (name is None or (fun_name is not None and name in fun_name)):
            count[0] += 1

    def on_event(event, **kwargs):
        if event == CACHE_HIT_EVENT and name is None:
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


def jit_names(jaxpr) -> list[str]:
    """The names of every jit (pjit) equation in a jaxpr and the jaxprs nested in it (scan bodies, ...): a
    program that calls `model.apply` holds one named `step_math`, one that traces `step_math` itself none."""
    names = []
    for equation in jaxpr.eqns:
        if equation.primitive.name in ("jit", "pjit"):
            names.append(equation.params["name"])
        for inner in jax.extend.core.jaxprs_in_params(equation.params):
            names += jit_names(inner)
    return names


def tokens(batch, sequence, seed=0):
    return np.random.default_rng(seed).integers(0, TINY_QWEN3_MOE["vocab_size"], (batch, sequence)).astype(np.int32)


@pytest.fixture(scope="module")
def single():
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, scan_layers=False)
    model.init_params(seed=5)
    return model


@pytest.fixture(scope="module")
def sharded(single):
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(tp_size=2, fsdp_size=4, ep_size=4),
                                scan_layers=True)
    model.set_params(single.hf_params())
    return model


def test_apply_never_reads_a_device_value_on_the_host(sharded, single):
    ids = jax.device_put(tokens(8, 7), sharded.batch_sharding())  # a global array already on the mesh
    with jax.transfer_guard_device_to_host("disallow"):
        output = sharded.apply(sharded.params, ids, capacity=sharded.capacity_schedule.largest)
        assert isinstance(output, ModelOutput)
    expected = single.apply(single.params, tokens(8, 7)).logits
    np.testing.assert_allclose(np.asarray(output.logits), np.asarray(expected), atol=1e-5, rtol=0)
    assert int(output.statistics.dropped) == 0


def test_forward_dispatches_without_a_host_read_and_checks_on_first_read(sharded, single):
    ids = jax.device_put(tokens(8, 7), sharded.batch_sharding())
    with jax.transfer_guard_device_to_host("disallow"):
        pending = sharded.forward(ids)  # dispatched; nothing read back yet
    np.testing.assert_allclose(np.asarray(pending.logits), np.asarray(single(tokens(8, 7))), atol=1e-5, rtol=0)
    assert int(pending.statistics.dropped) == 0 and pending.result() is pending.result()


def test_apply_called_again_with_the_same_shapes_does_not_recompile(sharded):
    ids = tokens(8, 7, seed=1)
    sharded.apply(sharded.params, ids, capacity=2.0)
    with count_compilations() as count:
        for seed in range(3):
            jax.block_until_ready(sharded.apply(sharded.params, tokens(8, 7, seed), capacity=2.0).logits)
    assert count[0] == 0


def test_return_hidden_gives_the_head_input_and_positions_shift_rope(single):
    ids = tokens(4, 6)
    full = single.apply(single.params, ids)
    hidden = single.apply(single.params, ids, return_hidden=True)
    assert full.hidden_states is None and hidden.logits is None
    head = single.params["lm_head.weight"]
    np.testing.assert_allclose(np.asarray(hidden.hidden_states @ head.T), np.asarray(full.logits), atol=1e-5)
    default = np.broadcast_to(np.arange(6), (4, 6))
    same = single.apply(single.params, ids, positions=default).logits
    np.testing.assert_array_equal(np.asarray(same), np.asarray(full.logits))
    # RoPE is relative: a constant shift changes nothing, stretched distances change the logits.
    shifted = single.apply(single.params, ids, positions=default + 3).logits
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(full.logits), atol=1e-5, rtol=0)
    stretched = single.apply(single.params, ids, positions=default * 2).logits
    assert not np.allclose(np.asarray(stretched), np.asarray(full.logits), atol=1e-3)


def test_batch_the_data_parallel_size_cannot_split_is_refused_by_apply(sharded):
    with pytest.raises(ValueError, match=r"batch size 3 cannot be split over the 4 data-parallel groups of this "
                                         r"layout; use a multiple of 4 \(forward\(\) pads for you\)"):
        sharded.apply(sharded.params, tokens(3, 5))


def test_capacity_off_the_ladder_params_in_the_wrong_layout_and_a_mismatched_cache_are_refused(sharded):
    with pytest.raises(ValueError, match=r"capacity=2.5 is not on the dispatch capacity ladder \[1.25, 1.5, 2.0, 3.0, 4.0\]"):
        sharded.apply(sharded.params, tokens(4, 5), capacity=2.5)
    with pytest.raises(ValueError, match="they are per-layer HF names; pass model.layer_stack.stack"):
        sharded.apply(dict(sharded.hf_params()), tokens(4, 5))
    with pytest.raises(ValueError, match=r"the cache holds 8 rows but input_ids has 4"):
        sharded.apply(sharded.params, tokens(4, 5), cache=init_cache(sharded, 8, 16))
    with pytest.raises(ValueError, match=r"6 new tokens do not fit a cache of 4 slots"):
        sharded.apply(sharded.params, tokens(4, 6), cache=init_cache(sharded, 4, 4))


def test_forward_and_set_params_before_and_with_wrong_parameters():
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE)
    with pytest.raises(ValueError, match=r"The model has no parameters: call init_params\(\), set_params\(\) or "
                                         r"from_pretrained\(\) first."):
        model.forward(tokens(2, 3))
    params = dict(Qwen3MoeForCausalLM(TINY_QWEN3_MOE).init_params(seed=0))
    params["model.layers.9.mlp.gate.weight"] = params.pop("model.layers.1.mlp.gate.weight")
    params["model.norm.weight"] = np.zeros((7,), np.float32)
    with pytest.raises(ValueError) as error:
        model.set_params(params)
    message = str(error.value)
    assert "missing ['model.layers.1.mlp.gate.weight']" in message
    assert "unexpected ['model.layers.9.mlp.gate.weight']" in message
    assert "wrong shapes ['model.norm.weight: (7,) != (32,)']" in message


def skewed_copy(single, gate_scale):
    """A copy of `single` on fsdp8/ep8 whose routers send (almost) every token to expert 0."""
    params = dict(single.hf_params())
    for name in list(params):
        if name.endswith("mlp.gate.weight"):
            weight = np.zeros(params[name].shape, np.float32)
            weight[0] = gate_scale  # expert 0 wins for every token with positive feature sum
            params[name] = weight
    return params


def test_forward_recomputes_an_overflowing_call_and_the_capacity_comes_back_down(single):
    """Through the schedule: an adversarial batch overflows at the first capacity and is recomputed exactly;
    after `patience` balanced batches the capacity steps back down."""
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(fsdp_size=8, ep_size=8), scan_layers=True)
    model.capacity_schedule = CapacitySchedule.for_ep(8, patience=2)
    model.set_params(single.hf_params())
    # Skewed: every token of every device picks expert 0 (one-hot embedding trick: all gates equal but one).
    skewed_params = skewed_copy(single, gate_scale=1.0)
    reference = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, scan_layers=False)
    reference.set_params(skewed_params)
    skewed = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(fsdp_size=8, ep_size=8), scan_layers=True)
    skewed.capacity_schedule = model.capacity_schedule
    skewed.set_params(skewed_params)

    ids = tokens(8, 16, seed=3)
    first = skewed.forward(ids)
    assert first.capacity == 1.25  # dispatched at the first capacity ...
    np.testing.assert_allclose(np.asarray(first.logits), np.asarray(reference(ids)), atol=1e-5, rtol=0)
    assert first.recomputed == 1 and first.capacity > 1.25  # ... overflowed, recomputed where it fitted
    climbed = skewed.forward_capacity[True].capacity
    assert climbed == first.capacity

    # The same schedule on balanced routing: after `patience` calm calls, one step down.
    model.forward_capacity[True] = skewed.forward_capacity[True]
    capacities = []
    for seed in range(3):  # 256 tokens per device: the busiest peer stays within 2x the balanced share
        output = model.forward(tokens(8, 256, seed=10 + seed))
        np.testing.assert_allclose(np.asarray(output.logits), np.asarray(single(tokens(8, 256, seed=10 + seed))),
                                   atol=1e-5, rtol=0)
        capacities.append(model.forward_capacity[True].capacity)
    assert capacities[0] == climbed and capacities[-1] < climbed, capacities


class AlwaysDropsEP(EPImplementation):
    """A broken implementation: right outputs, but it claims to drop a pair at every capacity."""

    accepts_capacity_options = True

    def __init__(self, experts_forward, num_local_experts, groups, *, capacity=None, **options):
        super().__init__(experts_forward, num_local_experts, groups, **options)
        self.inner = AllToAllEP(experts_forward, num_local_experts, groups, capacity=capacity)

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        output, statistics = self.inner(hidden_states, top_k_index, top_k_weights)
        statistics.dropped = statistics.dropped + 1
        statistics.required_capacity = jnp.full_like(statistics.required_capacity, 8.0)
        return output, statistics


def test_a_drop_at_the_largest_capacity_is_an_error_not_a_wrong_result(single):
    EPImplementationInterface.register("always_drops", AlwaysDropsEP)
    try:
        model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(fsdp_size=8, ep_size=8,
                                                                      ep_implementation="always_drops"))
        model.set_params(single.hf_params())
        output = model.forward(tokens(8, 5))
        with pytest.raises(RuntimeError, match=r"pairs were dropped at the largest capacity \(8.0\); its buffers "
                                               r"hold every pair a device sends, so this is a bug"):
            output.result()
        assert output.recomputed == 1  # climbed straight from 1.25 to 8.0, then refused
    finally:
        del EPImplementationInterface._global_mapping["always_drops"]


class CountingEP(AllToAllEP):
    """all_to_all that counts its constructions."""

    built = 0

    def __init__(self, *args, **kwargs):
        CountingEP.built += 1
        super().__init__(*args, **kwargs)


def test_ep_implementations_are_built_once_with_the_model_and_serve_every_trace(single):
    EPImplementationInterface.register("counting", CountingEP)
    try:
        CountingEP.built = 0
        model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(fsdp_size=8, ep_size=8,
                                                                      ep_implementation="counting"))
        model.set_params(single.hf_params())
        implementations = [experts.implementation for experts in model.sharded_experts.values()]
        assert CountingEP.built == len(model.sparse_layers()) == len(implementations)  # one per experts module
        assert all(implementation.schedule is model.capacity_schedule for implementation in implementations)
        ids = tokens(8, 5)
        for capacity in (1.25, 2.0):  # two traces (two static keys), then one under grad
            jax.eval_shape(partial(model.apply, capacity=capacity), model.params, ids)
        jax.eval_shape(jax.grad(lambda params: model.apply(params, ids, capacity=1.25, inference=False).aux_loss),
                       model.params)
        assert CountingEP.built == len(implementations)
        assert all(experts.implementation is built
                   for experts, built in zip(model.sharded_experts.values(), implementations))
    finally:
        del EPImplementationInterface._global_mapping["counting"]


def test_expert_load_counts_each_layer_s_real_tokens_per_expert_on_every_layout(sharded, single):
    """`ModelOutput.expert_load` [L, E]: the tokens each sparse layer routed to each expert (top-k of the softmax
    for Qwen3-MoE), padding not counted, the same whether experts run on one device or dispatch over ep."""
    ids = tokens(8, 7, seed=2)
    mask = np.ones((8, 7), np.int32)
    mask[1, 4:] = mask[5, :2] = 0
    output = single.apply(single.params, ids, attention_mask=mask)
    top_k, experts = TINY_QWEN3_MOE["num_experts_per_tok"], TINY_QWEN3_MOE["num_experts"]
    load = np.asarray(output.expert_load)
    assert load.shape == (len(single.sparse_layers()), experts)
    real = mask.reshape(-1).astype(bool)
    for layer, logits in enumerate(output.router_logits):
        chosen = np.argsort(-np.asarray(logits, np.float64), axis=-1)[real, :top_k]
        np.testing.assert_array_equal(load[layer], np.bincount(chosen.reshape(-1), minlength=experts))
    assert (load.sum(axis=1) == top_k * real.sum()).all()
    dispatched = sharded.apply(sharded.params, ids, attention_mask=mask, capacity=sharded.capacity_schedule.largest)
    np.testing.assert_array_equal(np.asarray(dispatched.expert_load), load)
