"""`sequence_logprobs` and the train step's routing replay on a tiny Qwen3-MoE: the log probabilities are the
train step's cross entropy (forced routing included), and on 8 devices (token dispatch by all_to_all, all_reduce,
pipeline stages) replaying a one-device forward's routing gives that device's log probabilities."""

import jax
import numpy as np
import optax
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import Qwen3MoeForCausalLM
from moe_jax.training import make_train_step, sequence_logprobs

from ..models.hf_reference import TINY_QWEN3_MOE

CONFIG = dict(TINY_QWEN3_MOE, num_hidden_layers=4)    # dense 0, sparse 1-3: two pipeline stages
BATCH, SEQUENCE = 8, 6
LAYOUTS = {
    "fsdp8_ep8_all_to_all": dict(fsdp_size=8, ep_size=8, ep_implementation="all_to_all"),
    # all_reduce needs ep_size == tp_size.
    "tp2_fsdp4_ep2_all_reduce": dict(tp_size=2, fsdp_size=4, ep_size=2, ep_implementation="all_reduce"),
    "pp2_fsdp2_ep2": dict(pp_size=2, fsdp_size=2, ep_size=2),
}


@pytest.fixture(scope="module")
def single():
    model = Qwen3MoeForCausalLM(CONFIG, devices=jax.devices()[:1], scan_layers=False)
    model.init_params(seed=7)
    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (BATCH, SEQUENCE)).astype(np.int32)
    recorded = np.asarray(model.apply(model.params, ids, return_routing=True).routing)   # what a sampler keeps
    rng = np.random.default_rng(1)
    forced = np.stack([rng.permutation(CONFIG["num_experts"])[:2] for _ in range(recorded.size // 2)])
    forced = forced.reshape(recorded.shape).astype(np.int32)
    forced[:, :, -1] = -1                                  # the last token of each row routes itself
    return model, ids, recorded, forced


def test_logprobs_are_the_train_step_s_cross_entropy_with_the_replayed_routing(single):
    model, ids, recorded, forced = single
    replayed = np.asarray(sequence_logprobs(model, model.params, ids, routing=recorded))
    plain = np.asarray(sequence_logprobs(model, model.params, ids))
    assert replayed.shape == (BATCH, SEQUENCE - 1) and replayed.dtype == np.float32
    np.testing.assert_allclose(replayed, plain, atol=1e-6, rtol=0)
    moved = np.asarray(sequence_logprobs(model, model.params, ids, routing=forced))
    assert np.abs(moved - plain).max() > 1e-4

    train_step = make_train_step(model, optax.sgd(0.0), routing_replay=True)
    state = train_step.init_state()
    _, metrics = train_step(state, {"input_ids": ids, "routing": forced})
    np.testing.assert_allclose(float(metrics["ce_loss"]), -moved.mean(), rtol=1e-6)
    with pytest.raises(ValueError, match=r"routing_replay=True needs batch\['routing'\]"):
        train_step(state, {"input_ids": ids})
    with pytest.raises(ValueError, match=r"does not replay it: build it with make_train_step\(\.\.\., "
                                         r"routing_replay=True\)"):
        make_train_step(model, optax.sgd(0.0))(state, {"input_ids": ids, "routing": forced})
    with pytest.raises(ValueError, match=r"= \(8, 3, 6, 2\) for input_ids of shape \(8, 6\), got \(8, 3, 5, 2\)"):
        train_step(state, {"input_ids": ids, "routing": forced[:, :, 1:]})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replayed_routing_gives_the_one_device_logprobs_on_8_devices(single, layout):
    model, ids, recorded, forced = single
    config = DistributedConfig(**LAYOUTS[layout])
    sharded = Qwen3MoeForCausalLM(CONFIG, config, devices=jax.devices()[:config.num_devices], scan_layers=True)
    sharded.set_params(model.hf_params())
    for routing in (recorded, forced):
        want = np.asarray(sequence_logprobs(model, model.params, ids, routing=routing))
        got = np.asarray(sequence_logprobs(sharded, sharded.params, ids, routing=routing))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
