"""Redundant expert slots (`num_redundant_experts`) and the expert placement (`set_expert_placement`,
`apply(expert_placement=)`): on a skewed batch a balanced placement evens the ep ranks' work (`ep_rank_load`)
and the dispatch buffers, with the same logits and gradients; a new placement compiles nothing; bad sizes and
placements fail first, clearly (the example of docs/training.md, "Redundant expert slots", on these inputs).
More layouts and families: scripts/checks/check_redundant_experts.py."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import AutoModelForCausalLM, DistributedConfig
from moe_jax.distributed.eplb import balanced_placement, identity_placement, placement_from_slots
from moe_jax.inference import ContinuousBatchingConfig

from ..models.test_apply import count_compilations

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
REDUNDANT = 8
LAYOUTS = {"all_to_all": dict(fsdp_size=8, ep_size=8),
           "all_reduce": dict(tp_size=8, ep_size=8, ep_implementation="all_reduce")}


def skewed_batch(vocab: int) -> np.ndarray:
    """8 rows of 32 tokens, half of them one repeated token: most routes go to that token's top-k experts. (The
    token is one whose skew a balanced placement can even out on both fixtures: with 2 slots per rank, 10 replicas
    of two equally hot experts, say, would leave two ranks with two each.)"""
    ids = np.random.default_rng(0).integers(0, vocab, (8, 32)).astype(np.int32)
    ids[:4] = 75
    return ids


def imbalance(rank_load) -> np.ndarray:
    """max / mean of the ep ranks' pairs, per sparse layer."""
    load = np.asarray(rank_load, np.float64)
    return load.max(1) / load.mean(1)


def load(family: str, layout: dict, **kwargs):
    return AutoModelForCausalLM.from_pretrained(FIXTURES / family, DistributedConfig(**layout), progress=False,
                                                **kwargs)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def qwen3(request):
    layout = LAYOUTS[request.param]
    return load("qwen3_moe", layout), load("qwen3_moe", layout, num_redundant_experts=REDUNDANT)


def test_a_balanced_placement_evens_the_ranks_with_the_same_logits_and_no_new_program(qwen3):
    plain, redundant = qwen3
    ids = skewed_batch(plain.config.vocab_size)
    base = plain.apply(plain.params, ids)
    identity = redundant.apply(redundant.params, ids)          # None: the identity placement
    assert identity.ep_rank_load.shape == (2, 8) and identity.ep_rank_load.dtype == jnp.int32
    np.testing.assert_array_equal(identity.expert_load, base.expert_load)
    np.testing.assert_array_equal(np.asarray(identity.ep_rank_load).sum(1), np.asarray(base.expert_load).sum(1))
    assert (imbalance(base.ep_rank_load) >= 2).all(), base.ep_rank_load

    placement = balanced_placement(identity.expert_load, num_redundant_experts=REDUNDANT, ep_size=8)
    with count_compilations() as compiled:
        balanced = redundant.apply(redundant.params, ids, expert_placement=placement)
        jax.block_until_ready(balanced.logits)
    assert compiled[0] == 0     # the placement is an input of the same program
    assert (imbalance(balanced.ep_rank_load) <= 1.2).all(), balanced.ep_rank_load
    assert (imbalance(balanced.ep_rank_load) < imbalance(identity.ep_rank_load)).all()
    np.testing.assert_array_equal(np.asarray(balanced.ep_rank_load).sum(1), np.asarray(base.expert_load).sum(1))
    for output in (identity, balanced):
        np.testing.assert_allclose(np.asarray(output.logits), np.asarray(base.logits), atol=1e-5, rtol=0)
    assert float(balanced.statistics.required_capacity) < float(base.statistics.required_capacity)
    assert int(balanced.statistics.dropped) == 0


def test_deepseek_v3_shared_experts_and_group_router_through_forward():
    layout = LAYOUTS["all_to_all"]
    plain, model = load("deepseek_v3", layout), load("deepseek_v3", layout, num_redundant_experts=REDUNDANT)
    ids = skewed_batch(plain.config.vocab_size)
    base = plain.forward(ids)
    assert (imbalance(base.ep_rank_load) >= 2).all(), base.ep_rank_load
    placement = model.set_expert_placement(
        balanced_placement(base.expert_load, num_redundant_experts=REDUNDANT, ep_size=8))
    assert model.expert_placement is placement
    output = model.forward(ids)     # forward / __call__ run the model's placement
    assert (imbalance(output.ep_rank_load) <= 1.2).all(), output.ep_rank_load
    np.testing.assert_allclose(np.asarray(output.logits), np.asarray(base.logits), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(output.expert_load, base.expert_load)


def test_gradients_sum_into_the_logical_experts_whatever_the_placement(qwen3):
    plain, redundant = qwen3
    if redundant.distributed_config.ep_implementation == "all_reduce":
        pytest.skip("one layout carries the gradient check")
    ids = skewed_batch(plain.config.vocab_size)
    placement = balanced_placement(plain.apply(plain.params, ids).expert_load, num_redundant_experts=REDUNDANT,
                                   ep_size=8)

    def grad(model):
        def loss(params, placement):
            logits = model.apply(params, ids, inference=False, expert_placement=placement).logits
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0])
        return jax.jit(jax.grad(loss))

    grad_redundant = grad(redundant)
    identity = grad_redundant(redundant.params, redundant.identity_expert_placement())
    with count_compilations() as compiled:
        balanced = grad_redundant(redundant.params, jax.device_put(placement, NamedSharding(redundant.mesh, P())))
    assert compiled[0] == 0
    assert balanced.keys() == plain.params.keys()   # per logical expert: [E, ...], as the checkpoint's
    unreplicated = grad(plain)(plain.params, None)
    for name, expected in unreplicated.items():
        expected = np.asarray(expected)
        for gradient in (identity, balanced):
            # fp32: the replicas' partial sums add up in another order (atol: the entries that cancel to ~0)
            np.testing.assert_allclose(np.asarray(gradient[name]), expected, rtol=1e-6,
                                       atol=1e-6 * np.abs(expected).max(), err_msg=name)


def test_generate_runs_the_models_placement_in_the_same_programs(qwen3):
    plain, redundant = qwen3
    if redundant.distributed_config.ep_implementation == "all_reduce":
        pytest.skip("one layout carries the generate check")
    ids = skewed_batch(plain.config.vocab_size)
    prompts = ids[:, :6]
    expected = redundant.generate(prompts, max_new_tokens=3)       # the identity placement
    redundant.set_expert_placement(balanced_placement(
        redundant.apply(redundant.params, ids).expert_load, num_redundant_experts=REDUNDANT, ep_size=8))
    compiled = redundant.generator.compilations
    np.testing.assert_array_equal(redundant.generate(prompts, max_new_tokens=3), expected)
    assert redundant.generator.compilations == compiled
    redundant.set_expert_placement(redundant.identity_expert_placement())


def test_continuous_batching_rebalances_every_n_engine_steps(qwen3):
    plain, redundant = qwen3
    if redundant.distributed_config.ep_implementation == "all_reduce":
        pytest.skip("one layout carries the serving check")
    prompts = skewed_batch(plain.config.vocab_size)[:, :6]
    expected = redundant.generate(prompts, max_new_tokens=3)[:, 6:]     # the programs of the generate test
    config = ContinuousBatchingConfig(max_slots=8, page_size=8, max_model_len=16, prefill_chunk=8, rebalance_every=1)
    served = redundant.generate_batch([list(row) for row in prompts], continuous_batching_config=config,
                                      max_new_tokens=3)
    np.testing.assert_array_equal([output.generated_tokens for output in served.values()], expected)
    assert (np.asarray(redundant.expert_placement.replica_count) != 2).any()   # re-placed from the served load
    total, placed = redundant.continuous_batching_engine(config).programs.rank_load()
    assert total.shape == (2, 8) and total.sum() > 0 and not placed.any()     # counted; each step's re-placement
    redundant.set_expert_placement(redundant.identity_expert_placement())


def test_bad_sizes_and_placements_are_refused_first(qwen3):
    plain, redundant = qwen3
    config = plain.config.raw
    with pytest.raises(ValueError, match=r"num_redundant_experts=3 gives 8 \+ 3 = 11 physical slots, which do not "
                                         r"split evenly over ep_size=8 ranks; the nearest valid values are 0 and 8"):
        type(plain)(config, DistributedConfig(fsdp_size=8, ep_size=8), num_redundant_experts=3)
    with pytest.raises(ValueError, match=r"ep_size=1: every device already holds every expert"):
        type(plain)(config, DistributedConfig(fsdp_size=8), num_redundant_experts=8)
    with pytest.raises(ValueError, match=r"not supported with pipeline stages \(pp_size=2\) yet"):
        type(plain)(config, DistributedConfig(pp_size=2, fsdp_size=4, ep_size=4), num_redundant_experts=4)
    ids = skewed_batch(plain.config.vocab_size)
    wrong_shape = identity_placement(3, 8, num_redundant_experts=REDUNDANT, ep_size=8)
    with pytest.raises(ValueError, match=r"ExpertPlacement.physical_to_logical has shape \(3, 16\), expected \(2, 16\)"):
        redundant.apply(redundant.params, ids, expert_placement=wrong_shape)
    missing = placement_from_slots(np.tile(np.arange(16) % 7, (2, 1)), 8)   # expert 7 in no slot
    with pytest.raises(ValueError, match=r"logical expert 7 of sparse layer 0 is in no physical slot"):
        redundant.set_expert_placement(missing)
    with pytest.raises(ValueError, match=r"logical expert 7 of sparse layer 0 is in no physical slot"):
        redundant.apply(redundant.params, ids, expert_placement=missing)
    with pytest.raises(ValueError, match=r"needs redundant expert slots, and this model has none"):
        plain.set_expert_placement(identity_placement(2, 8, ep_size=8))
