"""SwiGLU experts: every backend against the per-expert reference and transformers' eager experts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.ops.experts import swiglu_experts
from moe_jax.ops.grouped_matmul import GROUPED_MATMUL_BACKENDS
from moe_jax.ops.grouped_matmul_backends.tokamax_kernel import tokamax_available

from .experts_reference import swiglu_experts_reference

NUM_TOKENS, TOP_K, NUM_EXPERTS, HIDDEN, INTERMEDIATE = 19, 2, 4, 8, 6
SENTINEL = NUM_EXPERTS


def _backends():
    on_nvidia_gpu = jax.default_backend() == "gpu" and tokamax_available()
    return [name for name in GROUPED_MATMUL_BACKENDS if name != "tokamax" or on_nvidia_gpu]


def _problem(seed, with_sentinels, dtype=jnp.float32, weights_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    expert_ids = rng.integers(0, NUM_EXPERTS, size=(NUM_TOKENS, TOP_K))
    if with_sentinels:
        expert_ids[rng.random((NUM_TOKENS, TOP_K)) < 0.3] = SENTINEL
        expert_ids[0, :] = SENTINEL  # a token no local expert serves
    return dict(
        hidden=jnp.asarray(rng.standard_normal((NUM_TOKENS, HIDDEN)), dtype),
        expert_ids=jnp.asarray(expert_ids, jnp.int32),
        weights=jnp.asarray(rng.random((NUM_TOKENS, TOP_K)), weights_dtype),
        gate_up_proj=jnp.asarray(rng.standard_normal((NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN)) * 0.4, dtype),
        down_proj=jnp.asarray(rng.standard_normal((NUM_EXPERTS, HIDDEN, INTERMEDIATE)) * 0.4, dtype),
    )


DIFFERENTIABLE = ("hidden", "weights", "gate_up_proj", "down_proj")


@functools.cache
def _compiled_value_and_grads(backend, act=jax.nn.silu):
    """jit(problem, cotangent) -> (out, grads by name); backend None means the reference."""
    if backend is None:
        experts = functools.partial(swiglu_experts_reference, act=act)
    else:
        experts = functools.partial(swiglu_experts, act=act, backend=backend)

    @jax.jit
    def value_and_grads(problem, cotangent):
        def run(params):
            return experts(expert_ids=problem["expert_ids"], **params)

        out, vjp = jax.vjp(run, {name: problem[name] for name in DIFFERENTIABLE})
        return out, vjp(cotangent)[0]

    return value_and_grads


def _cotangent(seed=99):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((NUM_TOKENS, HIDDEN)), jnp.float32)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("with_sentinels", [False, True])
def test_matches_reference_values_and_gradients(backend, with_sentinels):
    problem = _problem(seed=1, with_sentinels=with_sentinels)
    out, grads = _compiled_value_and_grads(backend)(problem, _cotangent())
    want_out, want_grads = _compiled_value_and_grads(None)(problem, _cotangent())
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    for name in DIFFERENTIABLE:
        np.testing.assert_allclose(
            np.asarray(grads[name]), np.asarray(want_grads[name]), rtol=1e-5, atol=1e-5, err_msg=name
        )


@pytest.mark.parametrize("backend", _backends())
def test_sentinel_choices_contribute_and_receive_nothing(backend):
    problem = _problem(seed=2, with_sentinels=True)
    sentinel = np.asarray(problem["expert_ids"]) == SENTINEL
    # A non-finite weight on a "not mine" choice must not leak into values or gradients.
    problem["weights"] = jnp.where(jnp.asarray(sentinel), jnp.nan, problem["weights"])
    out, grads = _compiled_value_and_grads(backend)(problem, _cotangent())

    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_array_equal(np.asarray(out)[0], 0.0)  # token 0 has only sentinel choices
    np.testing.assert_array_equal(np.asarray(grads["hidden"])[0], 0.0)
    np.testing.assert_array_equal(np.asarray(grads["weights"])[sentinel], 0.0)
    for name in DIFFERENTIABLE:
        assert np.all(np.isfinite(np.asarray(grads[name]))), name

    # Dropping the sentinel choices by hand (weight 0, any real expert) gives the same result.
    dropped = dict(problem)
    dropped["weights"] = jnp.where(jnp.asarray(sentinel), 0.0, problem["weights"])
    dropped["expert_ids"] = jnp.where(jnp.asarray(sentinel), 0, problem["expert_ids"])
    want_out, want_grads = _compiled_value_and_grads(None)(dropped, _cotangent())
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    for name in ("hidden", "gate_up_proj", "down_proj"):
        np.testing.assert_allclose(
            np.asarray(grads[name]), np.asarray(want_grads[name]), rtol=1e-5, atol=1e-5, err_msg=name
        )


def test_custom_activation():
    problem = _problem(seed=3, with_sentinels=True)
    backend = _backends()[0]
    out, _ = _compiled_value_and_grads(backend, jax.nn.gelu)(problem, _cotangent())
    want, _ = _compiled_value_and_grads(None, jax.nn.gelu)(problem, _cotangent())
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def _cancelling_problem(weights_dtype):
    """bf16 tokens routed to experts 0 and 1, where expert 1 is expert 0 with its down projection negated
    (y1 = -y0 exactly), with weights 0.5 + d and 0.5, d < bf16's resolution at 0.5.

    Summed in fp32 the output is d * y0; in bf16 both weights round to 0.5 and the output is exactly 0.
    """
    problem = _problem(seed=4, with_sentinels=False, dtype=jnp.bfloat16, weights_dtype=jnp.float32)
    down = problem["down_proj"].at[1].set(-problem["down_proj"][0])
    gate_up = problem["gate_up_proj"].at[1].set(problem["gate_up_proj"][0])
    d = np.float32(2.0**-10) * (1 + np.random.default_rng(4).random(NUM_TOKENS, np.float32))  # [N]
    weights = np.stack([np.float32(0.5) + d, np.full(NUM_TOKENS, 0.5, np.float32)], axis=1)  # [N, 2]
    expert_ids = jnp.asarray(np.tile([0, 1], (NUM_TOKENS, 1)), jnp.int32)
    problem.update(expert_ids=expert_ids, weights=jnp.asarray(weights, weights_dtype), gate_up_proj=gate_up,
                   down_proj=down)
    return problem, d


def test_bf16_hidden_with_fp32_mixtral_weights_sums_in_fp32():
    problem, d = _cancelling_problem(jnp.float32)
    out = jax.jit(swiglu_experts)(**problem)
    assert out.dtype == jnp.bfloat16
    # Expert 0 alone, in fp32, scaled by d: what an fp32 sum of the two choices leaves.
    upcast = {k: (v.astype(jnp.float32) if k != "expert_ids" else v) for k, v in problem.items()}
    upcast.update(expert_ids=problem["expert_ids"][:, :1], weights=jnp.asarray(d[:, None]))
    want = np.asarray(swiglu_experts_reference(**upcast))
    assert np.abs(want).max() > 1e-3  # far from 0, so a bf16 sum (exactly 0) cannot pass
    # bf16 rounding of the expert outputs (2^-8 relative) dominates the tolerance.
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=1e-5)


def test_the_fp32_sum_test_sees_only_what_fp32_weights_carry():
    """The same problem with bf16 routing weights: 0.5 + d rounds to 0.5 before any sum, so the choices cancel
    exactly. The test above therefore passes only when d reaches the sum, i.e. when the sum is wider than bf16."""
    problem, _ = _cancelling_problem(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax.jit(swiglu_experts)(**problem), np.float32), 0.0)


def test_shape_errors_name_the_shapes():
    problem = _problem(seed=5, with_sentinels=False)
    problem["down_proj"] = problem["down_proj"][:, :, :-1]
    with pytest.raises(ValueError, match=r"down_proj must be \[E, H, I\] = \[4, 8, 6\]"):
        swiglu_experts(**problem)


@pytest.mark.reference
@pytest.mark.parametrize("with_sentinels", [False, True])
def test_matches_transformers_qwen3_moe_experts(with_sentinels):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTERMEDIATE,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    config._experts_implementation = "eager"
    experts = Qwen3MoeExperts(config)
    problem = _problem(seed=6, with_sentinels=with_sentinels)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.from_numpy(np.array(problem["gate_up_proj"])))
        experts.down_proj.copy_(torch.from_numpy(np.array(problem["down_proj"])))
        # The eager loop skips id == num_experts, the expert-parallel sentinel.
        torch_out = experts(
            torch.from_numpy(np.array(problem["hidden"])),
            torch.from_numpy(np.array(problem["expert_ids"], np.int64)),
            torch.from_numpy(np.array(problem["weights"])),
        )
    out = jax.jit(swiglu_experts)(**problem)
    np.testing.assert_allclose(np.asarray(out), torch_out.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("choices", [[[2, 0]], [[3, SENTINEL]], [[SENTINEL, SENTINEL]],
                                     [[2, 0], [0, 2], [1, SENTINEL], [3, 1], [SENTINEL, SENTINEL]]],
                         ids=["one token", "one token, one choice not mine", "one token, none mine", "five tokens"])
def test_a_few_tokens_match_the_reference_values_and_gradients(choices):
    """A few tokens (a decode step) take their own path (each pair's expert weights gathered, no sort and no tile
    loop): the same values and gradients as the reference."""
    from moe_jax.ops.experts import gathers_experts

    full = _problem(seed=5, with_sentinels=False)
    tokens = len(choices)
    problem = dict(full, hidden=full["hidden"][:tokens], weights=full["weights"][:tokens],
                   expert_ids=jnp.asarray(choices, jnp.int32))
    assert gathers_experts(tokens, TOP_K, full["gate_up_proj"], full["down_proj"])
    # A non-finite weight on a "not mine" choice must not leak in.
    problem["weights"] = jnp.where(problem["expert_ids"] == SENTINEL, jnp.nan, problem["weights"])
    cotangent = _cotangent()[:tokens]

    def value_and_grads(experts, problem):
        out, vjp = jax.vjp(lambda params: experts(expert_ids=problem["expert_ids"], **params),
                           {name: problem[name] for name in DIFFERENTIABLE})
        return out, vjp(cotangent)[0]

    out, grads = jax.jit(functools.partial(value_and_grads, swiglu_experts))(problem)
    # The reference with the "not mine" choices' weights zeroed by hand.
    clean = dict(problem, weights=jnp.where(problem["expert_ids"] == SENTINEL, 0.0, problem["weights"]))
    want_out, want_grads = jax.jit(functools.partial(value_and_grads, swiglu_experts_reference))(clean)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    for name in DIFFERENTIABLE:
        np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(want_grads[name]), rtol=1e-5, atol=1e-5,
                                   err_msg=name)
    mine = np.asarray(problem["expert_ids"]) != SENTINEL
    np.testing.assert_array_equal(np.asarray(grads["weights"])[~mine], 0.0)
    assert np.all(np.isfinite(np.asarray(grads["weights"])))


def test_a_few_tokens_keep_the_dtypes():
    """bf16 hidden states and experts with fp32 routing weights: a bf16 result, summed over K in fp32."""
    problem = _problem(seed=6, with_sentinels=False, dtype=jnp.bfloat16)
    few = dict(problem, hidden=problem["hidden"][:3], expert_ids=problem["expert_ids"][:3],
               weights=problem["weights"][:3])
    out = swiglu_experts(**few)
    assert out.dtype == jnp.bfloat16
    want = swiglu_experts_reference(**{k: (v.astype(jnp.float32) if k != "expert_ids" else v) for k, v in few.items()})
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=3e-2, atol=3e-2)


def test_gathering_is_kept_to_a_few_tokens_and_few_bytes():
    """Past `GATHERED_EXPERTS_MAX_PAIRS` pairs or `GATHERED_EXPERTS_MAX_BYTES` of gathered weights the tokens go
    through the tile loop, which is as fast or faster there (docs/benchmarks.md, "Grouped matmul"); the suite's other
    tests (19 tokens x top-2) run the loop."""
    from moe_jax.ops.experts import GATHERED_EXPERTS_MAX_BYTES, GATHERED_EXPERTS_MAX_PAIRS, gathers_experts

    small = jax.ShapeDtypeStruct((16, 512, 256), jnp.float32), jax.ShapeDtypeStruct((16, 256, 256), jnp.float32)
    large = jax.ShapeDtypeStruct((64, 1024, 2048), jnp.float32), jax.ShapeDtypeStruct((64, 2048, 512), jnp.float32)
    assert gathers_experts(1, 4, *small) and gathers_experts(GATHERED_EXPERTS_MAX_PAIRS // 4, 4, *small)
    assert not gathers_experts(GATHERED_EXPERTS_MAX_PAIRS // 4 + 1, 4, *small)
    assert not gathers_experts(1, 8, *large)
    per_expert = 3 * 2048 * 512 * 4
    assert gathers_experts(1, GATHERED_EXPERTS_MAX_BYTES // per_expert, *large)
    assert not gathers_experts(NUM_TOKENS, TOP_K, *small)


def test_no_tokens():
    """Zero tokens (an empty shard's slice) give an empty result and zero gradients, whichever path runs."""
    problem = _problem(seed=7, with_sentinels=False)
    empty = dict(problem, hidden=problem["hidden"][:0], expert_ids=problem["expert_ids"][:0],
                 weights=problem["weights"][:0])
    assert swiglu_experts(**empty).shape == (0, HIDDEN)
    grads = jax.grad(lambda gate_up: swiglu_experts(**dict(empty, gate_up_proj=gate_up)).sum())(empty["gate_up_proj"])
    np.testing.assert_array_equal(np.asarray(grads), 0.0)
