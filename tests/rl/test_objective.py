"""GRPO's objective and advantages against numpy, and the train step with the objective: at ratio 1 with unit
advantages its update is cross entropy's on the completion tokens, its metrics are the terms' token means, and a
batch without the objective's inputs is refused by name."""

import jax
import numpy as np
import optax
import pytest

from moe_jax.causal_lm import Qwen3MoeForCausalLM
from moe_jax.rl import ClippedPolicyObjective, group_advantages
from moe_jax.training import make_train_step, sequence_logprobs

from ..models.hf_reference import TINY_QWEN3_MOE


def test_the_clipped_objective_and_its_terms_are_ppos():
    rng = np.random.default_rng(0)
    logprobs, old = -rng.random((3, 5)).astype(np.float32), -rng.random((3, 5)).astype(np.float32)
    advantages, ref = rng.normal(size=(3, 5)).astype(np.float32), -rng.random((3, 5)).astype(np.float32)
    objective = ClippedPolicyObjective(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.1)
    loss, terms = objective.token_loss(logprobs, {"old_logprobs": old, "advantages": advantages, "ref_logprobs": ref})
    ratio = np.exp(logprobs - old)
    clipped = np.clip(ratio, 0.8, 1.28) * advantages
    kl = np.exp(ref - logprobs) - (ref - logprobs) - 1
    np.testing.assert_allclose(loss, -np.minimum(ratio * advantages, clipped) + 0.1 * kl, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(terms["clipped"], (clipped < ratio * advantages).astype(np.float32))
    np.testing.assert_allclose(terms["logprob_gap"], np.abs(logprobs - old), rtol=1e-6)
    assert objective.batch_keys == ("old_logprobs", "advantages", "ref_logprobs")
    assert ClippedPolicyObjective().batch_keys == ("old_logprobs", "advantages")
    with pytest.raises(ValueError, match="clip_eps=1.5 must be in"):
        ClippedPolicyObjective(clip_eps=1.5)


def test_group_advantages_normalise_within_each_prompts_samples():
    rewards = [1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0]
    advantages = group_advantages(rewards, 4)
    np.testing.assert_allclose(advantages[:4], (np.array([1, 0, 0, 0]) - 0.25) / (np.std([1, 0, 0, 0]) + 1e-6),
                               rtol=1e-5)
    np.testing.assert_array_equal(advantages[4:], 0.0)              # equal rewards teach nothing
    np.testing.assert_allclose(group_advantages(rewards, 4, scale=False)[:4], [0.75, -0.25, -0.25, -0.25])
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages(rewards, 3)


@pytest.fixture(scope="module")
def model():
    model = Qwen3MoeForCausalLM(dict(TINY_QWEN3_MOE, num_hidden_layers=2), devices=jax.devices()[:1])
    model.init_params(seed=3)
    return model


def test_at_ratio_one_with_unit_advantages_the_policy_step_is_cross_entropys(model):
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (4, 7)).astype(np.int32)
    labels = ids.copy()
    labels[:, :3] = -100                                            # the prompt: 3 tokens
    old = np.zeros(ids.shape, np.float32)
    old[:, :-1] = np.asarray(sequence_logprobs(model, model.params, ids))   # what the sampler would have reported
    batch = {"input_ids": ids, "labels": labels, "old_logprobs": old, "advantages": np.ones(ids.shape, np.float32)}
    policy = make_train_step(model, optax.sgd(0.5), objective=ClippedPolicyObjective())
    state, metrics = policy(policy.init_state(), batch)
    ce = make_train_step(model, optax.sgd(0.5))
    ce_state, ce_metrics = ce(ce.init_state(), {"input_ids": ids, "labels": labels})
    # d/dθ [-ratio] = -ratio * d logp = d(-logp) at ratio 1: the same update.
    for name, value in state.params.items():
        np.testing.assert_allclose(value, ce_state.params[name], rtol=2e-5, atol=2e-6, err_msg=name)
    np.testing.assert_allclose(float(metrics["policy_ratio"]), 1.0, atol=1e-5)
    assert float(metrics["policy_logprob_gap"]) < 1e-5 and float(metrics["policy_clipped"]) == 0.0
    np.testing.assert_allclose(float(metrics["ce_loss"]), -1.0, atol=1e-5)    # -mean(ratio * A)
    assert float(ce_metrics["ce_loss"]) > 0
    with pytest.raises(ValueError, match=r"the 'policy' objective needs batch\['advantages'\] \[B, S\]"):
        policy(state, {k: v for k, v in batch.items() if k != "advantages"})
    with pytest.raises(ValueError, match=r"batch\['old_logprobs'\] has shape \[4, 6\]"):
        policy(state, {**batch, "old_logprobs": old[:, :-1]})
