"""Every EP path on every legal 8-device layout gives the single-device outputs and gradients."""

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.distributed.capacity import CapacitySchedule, capacity_ladder
from moe_jax.distributed.expert_parallel import (
    AllToAllEP,
    EPImplementation,
    EPImplementationInterface,
    ExpertGroups,
    build_ep_implementation,
)
from moe_jax.distributed.experts import EP_DISPATCH, LOCAL, TENSOR_PARALLEL, ShardedExperts
from moe_jax.distributed.mesh import MESH_AXES, DeviceLayout, build_mesh
from moe_jax.ops.experts import swiglu_experts

from .experts_reference import reference_swiglu_experts
from .test_mesh import LAYOUTS

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 16, 8, 2


def make_inputs(rows, routing, seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((rows, HIDDEN), dtype=np.float32)
    if routing == "random":
        index = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(rows)])
    elif routing == "all_to_expert_0":
        index = np.stack([[0, 1 + (r % (EXPERTS - 1))] for r in range(rows)])[:, :TOP_K]
        index[:, 0] = 0
    elif routing == "half_experts_idle":
        index = np.stack([rng.permutation(EXPERTS // 2)[:TOP_K] for _ in range(rows)])
    else:
        raise ValueError(routing)
    weights = rng.uniform(0.1, 1.0, (rows, TOP_K)).astype(np.float32)
    params = {
        "gate_up_proj": rng.standard_normal((EXPERTS, 2 * INTERMEDIATE, HIDDEN), dtype=np.float32) * 0.3,
        "down_proj": rng.standard_normal((EXPERTS, HIDDEN, INTERMEDIATE), dtype=np.float32) * 0.3,
    }
    cotangent = rng.standard_normal((rows, HIDDEN), dtype=np.float32)
    return hidden, index.astype(np.int32), weights, params, cotangent


def loss_and_grads_fn(run):
    """Jitted `(hidden, weights, params, index, cotangent) -> ((loss, (output, statistics)), grads)`; routing
    and cotangent are arguments, so every routing of one shape shares one compilation."""

    def loss(hidden, weights, params, index, cotangent):
        output, statistics = run(hidden, index, weights, params)
        return jnp.sum(output * cotangent), (output, statistics)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def loss_and_grads(run, hidden, index, weights, params, cotangent):
    (_, (output, statistics)), grads = loss_and_grads_fn(run)(hidden, weights, params, index, cotangent)
    return output, statistics, grads


SINGLE_DEVICE_STEP = loss_and_grads_fn(
    lambda hidden, index, weights, params: (reference_swiglu_experts(hidden, index, weights, **params), None)
)


def single_device(hidden, index, weights, params, cotangent):
    (_, (output, _)), grads = SINGLE_DEVICE_STEP(hidden, weights, params, index, cotangent)
    return output, grads


@functools.cache
def sharded_step(layout_sizes, implementation, capacity, experts_forward):
    """The sharded loss-and-grads step of one layout, implementation and capacity (compiled once)."""
    _, run = sharded_runner(layout_sizes, implementation, capacity=capacity, experts_forward=experts_forward)
    return loss_and_grads_fn(run)


def layout_cases():
    cases = []
    for tp, fsdp, ep, replicate in LAYOUTS:
        if ep > 1:
            # "auto" in training is all_to_all; its inference choice is tested below.
            names = ["all_to_all"] + (["all_reduce"] if ep == tp else [])
            cases += [((tp, fsdp, ep, replicate), name) for name in names]
        else:
            cases.append(((tp, fsdp, ep, replicate), None))
    return cases


def sharded_runner(layout_sizes, implementation, inference=False, capacity=None,
                   experts_forward=reference_swiglu_experts, **options):
    tp, fsdp, ep, replicate = layout_sizes
    config = DistributedConfig(tp_size=tp, fsdp_size=fsdp, ep_size=ep, dp_replicate_size=replicate)
    layout = DeviceLayout.from_config(config)
    mode = EP_DISPATCH if ep > 1 else (TENSOR_PARALLEL if tp > 1 else LOCAL)
    experts = ShardedExperts(
        mesh=build_mesh(config), layout=layout, mode=mode, num_experts=EXPERTS,
        experts_forward=experts_forward, ep_implementation=implementation or "auto", **options,
    )

    def run(hidden, index, weights, params):
        return experts(hidden, index, weights, params, inference=inference, capacity=capacity)

    return config, run


def run_dropless(build, ep_size, statistics_of, *args):
    """Climb the capacity ladder as a caller does: run at the schedule's capacity, and on overflow rerun at
    the capacity the call required. -> (result, capacities tried)."""
    capacity, tried = CapacitySchedule.for_ep(ep_size).start().capacity, []
    while True:
        tried.append(capacity)
        result = build(capacity)(*args)
        statistics = statistics_of(result)
        required = float(statistics.required_capacity)
        if not required > capacity:
            assert int(statistics.dropped) == 0
            return result, tried
        assert int(statistics.dropped) > 0
        capacity = required


def assert_matches_reference(layout_sizes, implementation, rows, routing, seed=0,
                             experts_forward=reference_swiglu_experts, tolerance=2e-5):
    """Forward and gradients, climbing the capacity ladder as a caller does, equal the single-device ones."""
    hidden, index, weights, params, cotangent = make_inputs(rows, routing, seed)
    expected_out, expected_grads = single_device(hidden, index, weights, params, cotangent)

    def build(capacity):
        return sharded_step(layout_sizes, implementation, capacity, experts_forward)

    result, tried = run_dropless(build, layout_sizes[2], lambda result: result[0][1][1], hidden, weights, params,
                                 index, cotangent)
    (_, (output, statistics)), grads = result
    np.testing.assert_allclose(output, expected_out, rtol=tolerance, atol=tolerance)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)
    assert int(statistics.dropped) == 0
    return statistics, tried


@pytest.mark.parametrize("layout_sizes, implementation", layout_cases())
def test_outputs_and_gradients_match_single_device(layout_sizes, implementation):
    tp, fsdp, ep, replicate = layout_sizes
    # 5 rows per batch: not divisible by tp = 2, 4, 8, so TP slices are uneven (and some empty).
    rows = 5 * fsdp * replicate
    for seed, routing in enumerate(("random", "all_to_expert_0", "half_experts_idle")):
        assert_matches_reference(layout_sizes, implementation, rows, routing, seed)


PRODUCTION_EXPERTS = partial(swiglu_experts, act=jax.nn.silu)
PRODUCTION_CASES = [
    ((2, 4, 4, 1), "all_to_all"), ((8, 1, 8, 1), "all_reduce"), ((1, 8, 8, 1), "all_to_all"),
    ((2, 2, 2, 2), "auto"), ((8, 1, 1, 1), None), ((1, 8, 1, 1), None),
]


@pytest.mark.parametrize("layout_sizes, implementation", PRODUCTION_CASES)
def test_production_experts_match_single_device(layout_sizes, implementation):
    """The experts the models run (SwiGLU over the platform's grouped matmul, with its custom VJP), not the
    one-hot stand-in: outputs and gradients equal the single-device stand-in's."""
    tp, fsdp, ep, replicate = layout_sizes
    for seed, routing in enumerate(("random", "all_to_expert_0")):
        assert_matches_reference(layout_sizes, implementation, 6 * fsdp * replicate, routing, seed,
                                 experts_forward=PRODUCTION_EXPERTS)


@pytest.mark.parametrize("layout_sizes, implementation", [
    ((2, 4, 4, 1), "all_to_all"), ((8, 1, 8, 1), "all_to_all"), ((8, 1, 8, 1), "all_reduce"),
    ((4, 2, 8, 1), "all_to_all"), ((2, 2, 2, 2), "auto"), ((8, 1, 1, 1), None), ((1, 8, 8, 1), "all_to_all"),
])
def test_one_token_per_batch(layout_sizes, implementation):
    tp, fsdp, ep, replicate = layout_sizes
    assert_matches_reference(layout_sizes, implementation, fsdp * replicate, "random")


@pytest.mark.parametrize("layout_sizes", [(2, 4, 4, 1), (8, 1, 8, 1), (1, 8, 8, 1)])
def test_auto_at_inference_matches_too(layout_sizes):
    _, run = sharded_runner(layout_sizes, "auto", inference=True)
    hidden, index, weights, params, _ = make_inputs(16, "random")
    output, _ = jax.jit(run)(hidden, index, weights, params)
    expected = reference_swiglu_experts(hidden, index, weights, **params)
    np.testing.assert_allclose(output, expected, rtol=2e-5, atol=2e-5)


def cancelling_inputs(rows, dtype):
    """Tokens in `dtype` routed to experts 0 and E-1 (different devices whenever ep > 1), where expert E-1 is
    expert 0 with its down projection negated (y1 = -y0 exactly), weighted 0.5 + d and 0.5 in fp32 (Mixtral's
    and DeepSeek-V3's routing weights), d below bf16's and fp16's resolution at 0.5.

    -> (hidden, index, weights, params, expected): summed in fp32 the output is d * y0; a combine that casts
    the weights or sums in bf16/fp16 returns 0."""
    hidden, _, _, params, _ = make_inputs(rows, "random", seed=3)
    params = {"gate_up_proj": params["gate_up_proj"].copy(), "down_proj": params["down_proj"].copy()}
    params["gate_up_proj"][-1] = params["gate_up_proj"][0]
    params["down_proj"][-1] = -params["down_proj"][0]
    d = np.float32(2.0**-13) * (1 + np.random.default_rng(3).random(rows, np.float32))
    weights = np.stack([np.float32(0.5) + d, np.full(rows, 0.5, np.float32)], axis=1)
    index = np.tile(np.array([0, EXPERTS - 1], np.int32), (rows, 1))
    hidden, params = jnp.asarray(hidden, dtype), {k: jnp.asarray(v, dtype) for k, v in params.items()}
    upcast = {k: v.astype(jnp.float32) for k, v in params.items()}
    expected = reference_swiglu_experts(hidden.astype(jnp.float32), index[:, :1], jnp.asarray(d[:, None]), **upcast)
    return hidden, index, jnp.asarray(weights), params, np.asarray(expected)


@pytest.mark.parametrize("layout_sizes, implementation, inference, dtype", [
    ((2, 4, 4, 1), "all_to_all", False, jnp.bfloat16),   # tp slices gathered after the combine
    ((1, 8, 8, 1), "all_to_all", False, jnp.float16),
    ((8, 1, 8, 1), "all_reduce", False, jnp.bfloat16),
    ((8, 1, 8, 1), "auto", True, jnp.bfloat16),           # auto's all_reduce at inference
])
def test_low_precision_combine_sums_in_fp32_and_returns_the_hidden_dtype(layout_sizes, implementation, inference,
                                                                          dtype):
    """bf16/fp16 tokens with fp32 routing weights under every EP implementation: the output is in the hidden
    dtype (the contract `ShardedExperts` checks) and keeps what only an fp32 combine keeps."""
    tp, fsdp, ep, replicate = layout_sizes
    hidden, index, weights, params, expected = cancelling_inputs(4 * fsdp * replicate, dtype)
    assert np.abs(expected).max() > 1e-4  # far from 0, so a low-precision combine (exactly 0) cannot pass
    _, run = sharded_runner(layout_sizes, implementation, inference=inference)
    output, statistics = jax.jit(run)(hidden, index, weights, params)
    assert output.dtype == dtype and int(statistics.dropped) == 0
    # The expert outputs' own rounding (2^-8 relative in bf16) dominates the tolerance.
    np.testing.assert_allclose(np.asarray(output, np.float32), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def test_dropless_under_adversarial_routing_climbs_the_ladder():
    hidden, _, weights, params, cotangent = make_inputs(256, "random")
    index = np.zeros((256, TOP_K), np.int32)
    index[:, 1] = 1  # every pair goes to devices 0 and 1: 32 pairs from each device to each of them
    expected_out, _ = single_device(hidden, index, weights, params, cotangent)

    def build(capacity):
        return jax.jit(sharded_runner((1, 8, 8, 1), "all_to_all", capacity=capacity)[1])

    (output, statistics), tried = run_dropless(build, 8, lambda result: result[1], hidden, index, weights, params)
    np.testing.assert_allclose(output, expected_out, rtol=2e-5, atol=2e-5)
    assert int(statistics.dropped) == 0
    # S = 64 pairs per device; capacities 1.25 and 2 hold 16 rows per peer, 4 holds 32: the first call says
    # it needed 4 and the caller goes there directly (one recomputation, not one per capacity of the ladder).
    assert tried == [1.25, 4.0]
    _, first = build(1.25)(hidden, index, weights, params)
    assert int(first.dropped) > 0 and float(first.required_capacity) == 4.0


def test_all_reduce_overflow_is_reported_and_recomputed_exactly():
    """all_reduce's buffer of local pairs overflows like all_to_all's and the same climb makes it exact."""
    hidden, _, weights, params, cotangent = make_inputs(64, "random")
    index = np.zeros((64, TOP_K), np.int32)
    index[:, 1] = 1  # every pair on device 0's experts (1 expert per device at ep=8): 128 local pairs
    expected_out, _ = single_device(hidden, index, weights, params, cotangent)

    def build(capacity):
        return jax.jit(sharded_runner((8, 1, 8, 1), "all_reduce", capacity=capacity)[1])

    _, first = build(1.25)(hidden, index, weights, params)
    # 128 pairs per device, balanced share 16: 1.25 -> 24 rows; device 0 and 1 hold 64 each -> 4 fits 64.
    assert int(first.dropped) == 2 * (64 - 24) and float(first.required_capacity) == 4.0
    (output, statistics), tried = run_dropless(build, 8, lambda result: result[1], hidden, index, weights, params)
    assert tried == [1.25, 4.0] and int(statistics.dropped) == 0
    np.testing.assert_allclose(output, expected_out, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("layout_sizes, implementation", [((1, 8, 8, 1), "all_to_all"), ((2, 4, 4, 1), "all_to_all"),
                                                          ((8, 1, 8, 1), "all_reduce")])
def test_dispatch_and_combine_are_gathers_both_ways(layout_sizes, implementation):
    """No float scatter-add in the forward or the backward program: XLA:CPU serialises them (they took ~13% of a
    4-device train step's thread time) and GPUs make them non-deterministic."""
    hidden, index, weights, params, cotangent = make_inputs(32, "random")
    _, run = sharded_runner(layout_sizes, implementation, capacity=1.5)
    program = str(jax.make_jaxpr(lambda *args: loss_and_grads_fn(run)(*args))(hidden, weights, params, index,
                                                                            cotangent))
    float_scatters = [line.strip() for line in program.splitlines() if "scatter" in line and ":f32[" in line]
    assert not float_scatters, float_scatters


def test_capacity_ladder():
    assert capacity_ladder(8) == (1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
    assert capacity_ladder(2) == (1.25, 1.5, 2.0)


def test_capacity_factor_drops_and_counts_exactly():
    _, run = sharded_runner((1, 8, 8, 1), "all_to_all", capacity_factor=1.0)
    rows_per_device = 32
    hidden, index, weights, params, _ = make_inputs(8 * rows_per_device, "all_to_expert_0")
    output, statistics = jax.jit(run)(hidden, index, weights, params)
    pairs = rows_per_device * TOP_K
    implementation = AllToAllEP(None, 1, ExpertGroups(("ep_fsdp",), ("tp",), 8, 1, MESH_AXES), capacity_factor=1.0)
    capacity = implementation.buffer_rows(pairs)
    # Independent count: per sender, pairs beyond `capacity` to one peer are dropped, in sorted order.
    expected_dropped, kept = 0, np.zeros((8 * rows_per_device, TOP_K), bool)
    for device in range(8):
        rows = slice(device * rows_per_device, (device + 1) * rows_per_device)
        pair_ids = index[rows].reshape(-1)
        order = np.argsort(pair_ids, kind="stable")
        seen = {}
        for pair in order:
            peer = pair_ids[pair]  # one expert per device at ep=8
            seen[peer] = seen.get(peer, 0) + 1
            if seen[peer] <= capacity:
                kept[rows][pair // TOP_K, pair % TOP_K] = True
            else:
                expected_dropped += 1
    assert int(statistics.dropped) == expected_dropped > 0
    expected = reference_swiglu_experts(hidden, index, weights * kept, **params)
    np.testing.assert_allclose(output, expected, rtol=2e-5, atol=2e-5)


def test_all_reduce_needs_ep_equal_tp():
    with pytest.raises(ValueError, match=r"AllReduceEP needs every rank of the expert group to hold the same batch \(`ep_size == tp_size`\)."):
        sharded_runner((2, 4, 4, 1), "all_reduce")


def test_unknown_name_lists_registered_implementations():
    with pytest.raises(ValueError) as error:
        sharded_runner((2, 4, 4, 1), "fastest")
    assert str(error.value).startswith(
        "`ep_implementation='fastest'` names no registered implementation: use one of 'auto', 'all_to_all', "
        "'all_reduce', 'deepgemm_megamoe'"
    )


def test_deepgemm_megamoe_says_it_is_cuda_pytorch_only():
    with pytest.raises(NotImplementedError, match="exists only for PyTorch on CUDA"):
        sharded_runner((8, 1, 8, 1), "deepgemm_megamoe")


class MaskingEP(EPImplementation):
    """The reference doc's `MyEP` idea in JAX, written against the reference's interface (`__call__` with
    three arguments, `self.experts_forward`): gather the group's rows, run local experts on all of them (other
    devices' experts masked), and sum each device's rows back to it."""

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        axes = self.groups.ep_axes
        everyone = jax.lax.all_gather(hidden_states, axes, tiled=True)
        index = jax.lax.all_gather(top_k_index, axes, tiled=True)
        weights = jax.lax.all_gather(top_k_weights, axes, tiled=True)
        num_local = self.num_local_experts
        mine = (index // num_local) == self.ep_rank()
        local_out = self.experts_forward(
            everyone, jnp.where(mine, index % num_local, num_local), jnp.where(mine, weights, 0.0)
        )
        return jax.lax.psum_scatter(local_out, axes, tiled=True)


def test_user_registered_implementation_runs_end_to_end():
    EPImplementationInterface.register("masking_example", MaskingEP)
    try:
        assert "masking_example" in EPImplementationInterface()
        assert_matches_reference((1, 8, 8, 1), "masking_example", 16, "random")
    finally:
        del EPImplementationInterface._global_mapping["masking_example"]


class KeywordMaskingEP(EPImplementation):
    """MaskingEP written against the keyword interface: the call's experts and capacity come as arguments
    (it records the capacities it was called with), and it is built once for every trace."""

    built = 0
    capacities: list = []

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        KeywordMaskingEP.built += 1

    def __call__(self, hidden_states, top_k_index, top_k_weights, *, experts_forward, capacity=None):
        KeywordMaskingEP.capacities.append(capacity)
        axes = self.groups.ep_axes
        everyone, index, weights = (jax.lax.all_gather(array, axes, tiled=True)
                                    for array in (hidden_states, top_k_index, top_k_weights))
        num_local = self.num_local_experts
        mine = (index // num_local) == self.ep_rank()
        local_out = experts_forward(everyone, jnp.where(mine, index % num_local, num_local),
                                    jnp.where(mine, weights, 0.0))
        return jax.lax.psum_scatter(local_out, axes, tiled=True)


def test_a_user_implementation_taking_the_experts_and_capacity_as_arguments_is_built_once():
    EPImplementationInterface.register("keyword_masking_example", KeywordMaskingEP)
    KeywordMaskingEP.built, KeywordMaskingEP.capacities = 0, []
    try:
        assert_matches_reference((1, 8, 8, 1), "keyword_masking_example", 16, "random")
        _, run = sharded_runner((1, 8, 8, 1), "keyword_masking_example", capacity=3.0)
        jax.eval_shape(run, *make_inputs(16, "random")[:4])
        assert KeywordMaskingEP.built == 2 and KeywordMaskingEP.capacities[-1] == 3.0   # one per runner
        with pytest.raises(RuntimeError, match=r"`experts_forward` is passed to each call"):
            KeywordMaskingEP(None, 1, ExpertGroups(("ep",), ("tp",), 8, 1, MESH_AXES)).experts_forward()
    finally:
        del EPImplementationInterface._global_mapping["keyword_masking_example"]


class HalfWidthEP(EPImplementation):
    """Breaks the contract: returns half of each token's hidden width."""

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states[:, : hidden_states.shape[1] // 2]


def test_a_user_implementation_that_breaks_the_output_contract_is_named_when_traced():
    interface_name = "half_width_example"
    EPImplementationInterface.register(interface_name, HalfWidthEP)
    try:
        _, run = sharded_runner((1, 8, 8, 1), interface_name)
        hidden, index, weights, params, _ = make_inputs(16, "random")
        with pytest.raises(AssertionError, match=r"EP implementation HalfWidthEP must return .*\[N, H\] = \(2, 16\)"):
            jax.eval_shape(run, hidden, index, weights, params)
    finally:
        del EPImplementationInterface._global_mapping[interface_name]


def test_interface_local_override_and_iteration():
    interface = EPImplementationInterface()
    interface["mine"] = MaskingEP
    assert "mine" in interface and "mine" not in EPImplementationInterface()
    assert list(interface)[:4] == ["auto", "all_to_all", "all_reduce", "deepgemm_megamoe"]
    groups = ExpertGroups(("ep_fsdp",), ("tp",), 8, 1, MESH_AXES)
    assert isinstance(build_ep_implementation("mine", None, 1, groups, interface=interface), MaskingEP)


@pytest.mark.parametrize("layout_sizes", [(2, 4, 4, 1), (1, 8, 2, 1), (2, 2, 2, 2)])
def test_efsdp_sharded_expert_weights_give_single_device_results(layout_sizes):
    """Weights stored as the plans shard them (experts over ep, then FSDP over efsdp) are gathered over efsdp
    for compute; outputs and gradients are the single-device ones."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tp, fsdp, ep, replicate = layout_sizes
    config, run = sharded_runner(layout_sizes, "all_to_all", capacity=float(ep))
    layout = DeviceLayout.from_config(config)
    mesh = build_mesh(config)
    assert config.efsdp_size > 1
    expert_spec = P(layout.ep_axes + layout.efsdp_axes, None, None)
    hidden, index, weights, params, cotangent = make_inputs(4 * fsdp * replicate, "random")
    sharded_params = {name: jax.device_put(array, NamedSharding(mesh, expert_spec)) for name, array in params.items()}
    expected_out, expected_grads = single_device(hidden, index, weights, params, cotangent)
    output, _, grads = loss_and_grads(run, hidden, index, weights, sharded_params, cotangent)
    np.testing.assert_allclose(output, expected_out, rtol=2e-5, atol=2e-5)
    for name in params:
        np.testing.assert_allclose(grads[2][name], expected_grads[2][name], rtol=2e-5, atol=2e-5)


def adapter_tagging_experts(hidden, expert_ids, weights, *, gate_up_proj, down_proj, lora):
    """Experts whose output for a row is its adapter index (the `ExpertAdapterRows` index the row reached them
    with) times its routing weight, on every hidden feature: [N, H]; a tp rank returns its share of the
    intermediate dim (tp mode sums them)."""
    mine = expert_ids < gate_up_proj.shape[0]
    share = down_proj.shape[2] / INTERMEDIATE
    tag = lora["down_proj"].index.astype(hidden.dtype) * jnp.sum(jnp.where(mine, weights, 0.0), axis=1) * share
    return jnp.broadcast_to(tag[:, None], hidden.shape)


# (layout, implementation, redundant slots): local, tp, all_to_all alone over ep and beside tp, all_reduce, and
# redundant slots under a placement that moves every expert.
ADAPTER_INDEX_CASES = [((1, 8, 1, 1), None, 0), ((2, 4, 1, 1), None, 0), ((1, 8, 8, 1), "all_to_all", 0),
                       ((2, 4, 4, 1), "all_to_all", 0), ((2, 4, 2, 1), "all_reduce", 0),
                       ((1, 8, 8, 1), "all_to_all", 8)]


@pytest.mark.parametrize("layout_sizes, implementation, redundant", ADAPTER_INDEX_CASES)
def test_each_token_s_adapter_index_reaches_the_rows_its_experts_see(layout_sizes, implementation, redundant):
    """Several adapters on the experts (`AdapterRows` of a [K, E, r, I] factor): whatever way tokens reach their
    experts, each (token, choice) row carries its token's adapter index: out[t] = index[t] * sum_k weights[t, k]."""
    from moe_jax.distributed.eplb import placement_from_slots
    from moe_jax.ops.lora import AdapterRows

    rows, rank, adapters = 32, 2, 3
    hidden, index, weights, params, _ = make_inputs(rows, "random")
    adapter_index = np.random.default_rng(1).integers(0, adapters, rows).astype(np.int32)
    a = np.zeros((adapters, EXPERTS, rank, INTERMEDIATE), np.float32)
    b = np.zeros((adapters, EXPERTS, HIDDEN, rank), np.float32)
    params = {**params, "lora": {"down_proj": AdapterRows(a, b, adapter_index, (0.0, 1.0, 2.0))}}
    if redundant:
        slots = np.random.default_rng(2).permutation(np.arange(EXPERTS + redundant) % EXPERTS)
        params["placement"] = placement_from_slots(slots[None], EXPERTS).layer(0)
    _, run = sharded_runner(layout_sizes, implementation, inference=True, capacity=float(layout_sizes[2]),
                            experts_forward=adapter_tagging_experts, num_redundant_experts=redundant)
    output, _ = jax.jit(run)(hidden, index, weights, params)
    expected = adapter_index * weights.sum(axis=1)
    np.testing.assert_allclose(output, np.broadcast_to(expected[:, None], output.shape), rtol=1e-6, atol=1e-6)


def test_an_implementation_without_adapter_index_is_refused_for_several_adapters_on_the_experts():
    from moe_jax.ops.lora import AdapterRows

    EPImplementationInterface.register("masking_untagged", MaskingEP)
    try:
        _, run = sharded_runner((1, 8, 8, 1), "masking_untagged", experts_forward=adapter_tagging_experts)
        hidden, index, weights, params, _ = make_inputs(16, "random")
        factors = AdapterRows(np.zeros((2, EXPERTS, 1, INTERMEDIATE), np.float32),
                              np.zeros((2, EXPERTS, HIDDEN, 1), np.float32), np.zeros(16, np.int32), (0.0, 1.0))
        with pytest.raises(ValueError, match="EP implementation MaskingEP takes no `adapter_index`"):
            jax.eval_shape(run, hidden, index, weights, {**params, "lora": {"down_proj": factors}})
    finally:
        del EPImplementationInterface._global_mapping["masking_untagged"]
