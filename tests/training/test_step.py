"""The train step itself: no host reads, donated state, the sticky overflow flag, micro-batches, separate
expert/dense optimizers, mixed precision and host offload."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moe_jax.reporting.collectives_report import REDUCTIONS, compile_with_collectives
from moe_jax.training import TrainLoop
from moe_jax.training.optimizers import experts_and_dense, parameter_groups

from ..models.test_apply import jit_names
from .conftest import LAYOUTS, FixtureBatches, build_trainer


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def test_a_step_reads_nothing_on_the_host_and_consumes_its_state(trainers):
    model, train_step = trainers("tp2_fsdp4_ep4")
    state = train_step.init_state()
    batch = {name: jax.device_put(array, model.batch_sharding()) for name, array in FixtureBatches().batch(0).items()}
    train_step(state, batch)                                      # compile outside the guard
    state = train_step.init_state()
    leaf = state.params["lm_head.weight"]
    with jax.transfer_guard_device_to_host("disallow"):
        new_state, metrics = train_step(state, batch)
    assert leaf.is_deleted()                                      # donated: updated in place
    assert new_state.params["lm_head.weight"].sharding == train_step.shardings(state.capacity).params["lm_head.weight"]
    # Optimizer state is laid out like its parameter.
    mu = new_state.opt_state[0].mu["model.layers.1.mlp.experts.gate_up_proj"]
    assert mu.sharding == new_state.params["model.layers.1.mlp.experts.gate_up_proj"].sharding
    assert set(host(metrics)) >= {"loss", "aux_loss", "grad_norm", "dropped", "required_capacity", "applied"}


def test_a_skipping_state_is_returned_unchanged_and_stays_skipping(trainers):
    _, train_step = trainers("tp2_fsdp4_ep4")
    state = train_step.init_state()
    state = state.replace(skipping=jax.device_put(jnp.ones((), jnp.bool_), state.skipping.sharding))
    before = host(state.arrays())
    state, metrics = train_step(state, FixtureBatches().batch(0))
    after = host(state.arrays())
    assert not bool(metrics["applied"]) and bool(after["skipping"])
    jax.tree.map(np.testing.assert_array_equal, after, before)


# heavy: a second compile of the step under a patched backend
@pytest.mark.heavy
def test_on_accelerators_a_skipped_step_is_a_select_with_the_conditionals_results(monkeypatch):
    """Off XLA:CPU the overflow check selects inside the update (a conditional there holds a second copy of the
    whole state); the select gives the conditional's states, applied and skipped."""
    from moe_jax.causal_lm.model import MoeForCausalLM

    results, conds = {}, {}
    for platform in ("cpu", "gpu"):
        monkeypatch.setattr(MoeForCausalLM, "platform", property(lambda self, chosen=platform: chosen))
        model, train_step = build_trainer(LAYOUTS["tp2_fsdp4_ep4"])
        for skipping in (False, True):
            state = train_step.init_state(capacity=model.capacity_schedule.largest)   # drops nothing: applied
            state = state.replace(skipping=jax.device_put(jnp.asarray(skipping), state.skipping.sharding))
            before = host(state.arrays())
            conds[platform] = str(train_step.trace(state, FixtureBatches().batch(0)).jaxpr).count("cond[")
            state, metrics = train_step(state, FixtureBatches().batch(0))
            results[platform, skipping] = host(state.arrays())
            assert bool(metrics["applied"]) != skipping
            if skipping:
                jax.tree.map(np.testing.assert_array_equal, results[platform, skipping], before)
    assert conds["gpu"] == conds["cpu"] - 1       # the update's conditional, and only it, is gone
    for skipping in (False, True):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                     results["gpu", skipping], results["cpu", skipping])


def test_micro_batches_give_the_step_of_the_whole_batch_and_experts_take_their_own_optimizer():
    # Router loss off: it is averaged per micro-batch, while the cross entropy is a global-batch mean. SGD:
    # the update is the gradient itself (Adam would magnify float32 noise in near-zero gradients); the
    # experts' learning rate is 0, the dense parameters' 0.1.
    optimizer = experts_and_dense(optax.sgd(0.0), optax.sgd(0.1))
    results = []
    for grad_accum in (1, 2):
        model, train_step = build_trainer(None, grad_accum=grad_accum, optimizer=optimizer,
                                          config_changes=dict(output_router_logits=False))
        before = host(model.params)
        state, metrics = train_step(train_step.init_state(), FixtureBatches().batch(0))
        results.append((host(metrics), host(state.params)))
    (whole, whole_params), (micro, micro_params) = results
    np.testing.assert_allclose(micro["loss"], whole["loss"], rtol=1e-6)
    np.testing.assert_allclose(micro["grad_norm"], whole["grad_norm"], rtol=1e-5)   # experts' gradients too
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), micro_params, whole_params)
    groups = parameter_groups(whole_params)
    assert {"experts", "dense"} == set(groups.values())
    for name, group in groups.items():
        changed = not np.array_equal(whole_params[name], before[name])
        assert changed == (group == "dense"), name


def test_micro_batches_with_the_router_loss_give_the_step_of_the_whole_batch(trainers):
    """grad_accum=2 with the router loss on (the fixture's output_router_logits=True, coefficient 0.1): each
    micro-batch's router loss enters the gradient weighted by coefficient / grad_accum, so the step's loss
    is the mean of the micro-batches' router losses. The router loss is not additive over rows, so the batch
    is four rows each twice (rows 2i and 2i + 1 alike, one of them padded): both micro-batches (rows a, a + 2,
    ...) are those four rows, and so is the whole batch in every mean. Then the loss, its terms, the
    gradient norm and the AdamW step equal one step on the whole batch. A router-loss weight not divided by
    grad_accum in the gradient (the reported aux_loss still right) moves the gradient norm from 2.06 to 2.45
    and parameters by 6e-3 (two Adam steps); float32 noise is 1e-7 relative in the norm, 4e-6 in the
    parameters (Adam magnifies it where a gradient is near zero)."""
    _, whole = trainers("one_device")
    model, micro = build_trainer(None, grad_accum=2)
    assert micro.aux_coefficient > 0 and model.config.output_router_logits
    batch = {name: np.repeat(array[:4], 2, axis=0) for name, array in FixtureBatches().batch(0).items()}
    whole_state, whole_metrics = whole(whole.init_state(), batch)
    micro_state, micro_metrics = micro(micro.init_state(), batch)
    whole_metrics, micro_metrics = host(whole_metrics), host(micro_metrics)
    assert whole_metrics["aux_loss"] > 0
    for name in ("loss", "ce_loss", "aux_loss"):
        np.testing.assert_allclose(micro_metrics[name], whole_metrics[name], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(micro_metrics["grad_norm"], whole_metrics["grad_norm"], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-4), host(micro_state.params),
                 host(whole_state.params))


def test_mixed_precision_computes_in_bfloat16_and_reduces_gradients_in_float32(trainers):
    """fp32 masters and optimizer state, bf16 compute, fp32 gradient reduction (SPEC §6), read from the
    partitioner's output on an HSDP + EP layout: parameters are gathered in bf16, every cross-device sum
    (all weight gradients: there is no tp here) runs in f32. Before masters were cast at use, the tp2/fsdp4
    step ran over 60 bf16 all-reduces, most of them weight-gradient sums."""
    _, full = trainers("one_device")
    _, mixed = build_trainer(dict(dp_replicate_size=2, fsdp_size=4, ep_size=4), mixed_precision=True)
    batch = FixtureBatches().batch(0)
    state = mixed.init_state()
    compiled, collectives = compile_with_collectives(mixed.lower(state, batch))
    assert collectives[("all-gather", "bf16")] > 0
    assert {dtype for (op, dtype) in collectives if op in REDUCTIONS} <= {"f32", "s32"}, collectives
    mixed_state, mixed_metrics = compiled(state, batch)
    full_state, full_metrics = full(full.init_state(), batch)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves((mixed_state.params, mixed_state.opt_state))
               if leaf.ndim)
    np.testing.assert_allclose(mixed_metrics["loss"], full_metrics["loss"], rtol=2e-2)
    assert not np.isclose(float(mixed_metrics["loss"]), float(full_metrics["loss"]), rtol=1e-6, atol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-2), host(mixed_state.params),
                 host(full_state.params))


def test_host_offload_keeps_the_state_in_pinned_host_memory_and_trains_identically(trainers):
    _, on_device = trainers("one_device")
    _, offloaded = build_trainer(None, offload=True)
    state = offloaded.init_state()
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {"pinned_host"}
    records, expected = [], []
    state, _ = TrainLoop(offloaded, FixtureBatches(), on_step=records.append).run(state, 3)
    TrainLoop(on_device, FixtureBatches(), on_step=expected.append).run(on_device.init_state(), 3)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim} == {"pinned_host"}
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in expected], rtol=1e-6)
    for part, (params_kind, opt_kind) in {"optimizer": ("device", "pinned_host"),
                                          "parameters": ("pinned_host", "device")}.items():
        state = build_trainer(None, offload=part)[1].init_state()
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {params_kind}, part
        assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim} == {opt_kind}


def test_a_batch_the_layout_cannot_split_is_refused(trainers):
    _, train_step = trainers("tp2_fsdp4_ep4")
    with pytest.raises(ValueError, match="batch size 6 cannot be split .* 4 data-parallel group"):
        train_step(train_step.init_state(), {"input_ids": np.zeros((6, 12), np.int32)})
    with pytest.raises(ValueError, match="'input_ids'"):
        train_step(train_step.init_state(), {"tokens": np.zeros((8, 12), np.int32)})


def test_the_step_traces_the_model_s_step_into_its_one_jit_and_checks_its_inputs_at_each_call(trainers):
    """`make_train_step` owns the one jit: the model's step is traced into it, not called as `model.apply`'s
    nested jit; `apply`'s checks run at the step's own call instead."""
    model, train_step = trainers("tp2_fsdp4_ep4")
    state, batch = train_step.init_state(), FixtureBatches().batch(0)
    names = jit_names(train_step.trace(state, batch).jaxpr.jaxpr)
    assert "step_math" not in names, names
    nested = jax.make_jaxpr(lambda params, ids: model.apply(params, ids).logits)(state.params, batch["input_ids"])
    assert "step_math" in jit_names(nested.jaxpr)     # what the check would see if the step nested apply's jit
    params = {name: value for name, value in state.params.items() if name != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"params do not have this model's storage layout: missing \['lm_head"):
        train_step(state.replace(params=params), batch)


# heavy: every rung compiled; one compile per capacity is asserted by the curve tests
@pytest.mark.heavy
def test_precompile_builds_each_rung_s_program_before_the_run_and_the_step_then_compiles_nothing(trainers, monkeypatch):
    """A capacity move mid-run finds its program ready: the precompiled step runs without compiling and gives
    the step a call compiles itself."""
    model, shared_step = trainers("tp2_fsdp4_ep4")
    _, train_step = build_trainer(LAYOUTS["tp2_fsdp4_ep4"])      # its own compilation cache
    ladder = model.capacity_schedule.ladder
    batch = FixtureBatches().batch(0)
    state = train_step.init_state(capacity=ladder[0])
    seconds = train_step.precompile(state, batch, capacities=[ladder[-1], ladder[0]], progress=False)
    assert set(seconds) == {ladder[0], ladder[-1]} and all(value > 0 for value in seconds.values())
    assert train_step.precompile(state, batch, capacities=[ladder[0]], progress=False) == {}
    with pytest.raises(ValueError, match=r"capacity=1.1 is not on the dispatch capacity ladder"):
        train_step.precompile(state, batch, capacities=[1.1], progress=False)

    def compiles(*args):
        raise AssertionError("the step compiled a program precompile built")

    with monkeypatch.context() as patch:
        patch.setattr(train_step, "_jit", compiles)
        for capacity in (ladder[-1], ladder[0]):
            ours, metrics = train_step(train_step.init_state(capacity=capacity), batch)
            expected, expected_metrics = shared_step(shared_step.init_state(capacity=capacity), batch)
            assert float(metrics["loss"]) == float(expected_metrics["loss"])
            jax.tree.map(np.testing.assert_array_equal, host(ours.params), host(expected.params))
    # A batch of another shape is the jitted step's to compile, as without precompile (not an error).
    shorter = {name: array[:, :-2] for name, array in batch.items()}
    _, metrics = train_step(train_step.init_state(capacity=ladder[-1]), shorter)
    assert int(metrics["tokens"]) < int(expected_metrics["tokens"]) and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_the_gradient_norm_leaves_the_optimizer_its_own_squares(max_norm):
    """Without a barrier between them XLA wrote the norm's g * g out once per parameter for AdamW's second moment to
    read back (a full-size buffer per parameter; the bench model's AdamW + norm 28 -> 19 ms without it)."""
    from moe_jax.training.step import clip_by_global_norm

    params = {"a": jnp.ones((64, 128)), "b": jnp.ones((32, 64, 16)), "c": jnp.ones((128,))}
    grads = jax.tree.map(lambda p: p * 0.25, params)
    optimizer = optax.adamw(1e-3)

    def step(params, opt_state, grads):
        clipped, norm = clip_by_global_norm(grads, max_norm)
        updates, opt_state = optimizer.update(clipped, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, norm

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, optimizer.init(params), grads).compile()
    smallest_gradient_bytes = min(g.nbytes for g in jax.tree.leaves(grads) if g.ndim > 1)
    assert compiled.memory_analysis().temp_size_in_bytes < smallest_gradient_bytes
    _, _, norm = compiled(jax.tree.map(jnp.copy, params), optimizer.init(params), grads)
    np.testing.assert_allclose(float(norm), float(optax.tree.norm(grads)), rtol=1e-6)


@pytest.mark.heavy   # the suite checks the placement (below) on one device
def test_optimizer_only_offload_keeps_the_parameters_on_the_device_and_trains_identically():
    """offload="optimizer" on fsdp8/ep8: parameters on the device, the optimizer state in pinned host memory
    between steps; 10 steps' losses equal the run without offload (1e-6)."""
    fsdp8_ep8 = dict(fsdp_size=8, ep_size=8, ep_implementation="all_to_all")
    _, on_device = build_trainer(fsdp8_ep8)
    _, offloaded = build_trainer(fsdp8_ep8, offload="optimizer")
    records, expected = [], []
    state, _ = TrainLoop(offloaded, FixtureBatches(), on_step=records.append).run(offloaded.init_state(), 10)
    TrainLoop(on_device, FixtureBatches(), on_step=expected.append).run(on_device.init_state(), 10)
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.params)} == {"device"}
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim} == {"pinned_host"}
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in expected], rtol=1e-6)
    with pytest.raises(ValueError, match=r"offload='gpu': choose one of \['all', 'optimizer', 'parameters'\]"):
        build_trainer(None, offload="gpu")
