"""Routing replay through the model (`apply(routing=)`, `return_routing=True`, `models.routing_replay`) on tiny
Qwen3-MoE and DeepSeek-V3: replaying what the router picks changes nothing; forced experts equal a straight-line
MoE block routed by the given ids, gradients included; bad routing is refused with one clear error each."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import DistributedConfig
from moe_jax.causal_lm import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM
from moe_jax.inference import init_cache
from moe_jax.nn.linear import no_constraint

from .hf_reference import TINY_DEEPSEEK_V3, TINY_QWEN3_MOE

MODELS = {"qwen3_moe": (Qwen3MoeForCausalLM, TINY_QWEN3_MOE), "deepseek_v3": (DeepseekV3ForCausalLM, TINY_DEEPSEEK_V3)}
BATCH, SEQUENCE = 2, 6


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    cls, config = MODELS[request.param]
    model = cls(config, scan_layers=False)
    model.init_params(seed=3)
    return model


def _ids(seed=0):
    return np.random.default_rng(seed).integers(0, 128, (BATCH, SEQUENCE)).astype(np.int32)


def _forced(routing, experts, seed=0):
    """Distinct ids per token, each row unlike the recorded one: [B, L, S, K]."""
    rng = np.random.default_rng(seed)
    flat = np.asarray(routing).reshape(-1, routing.shape[-1])
    rows = [rng.choice([e for e in range(experts) if e != row[0]], len(row), replace=False) for row in flat]
    return np.asarray(rows, np.int32).reshape(routing.shape)


def test_replaying_the_recorded_routing_gives_the_same_logits(model):
    ids = _ids()
    recorded = model.apply(model.params, ids, return_routing=True)
    sparse, top_k = len(model.sparse_layers()), model.config.num_experts_per_tok
    assert recorded.routing.shape == (BATCH, sparse, SEQUENCE, top_k) and recorded.routing.dtype == jnp.int32
    plain = model.apply(model.params, ids)
    assert plain.routing is None
    np.testing.assert_array_equal(np.asarray(recorded.logits), np.asarray(plain.logits))
    replayed = model.apply(model.params, ids, routing=np.asarray(recorded.routing), return_routing=True)
    np.testing.assert_allclose(np.asarray(replayed.logits), np.asarray(plain.logits), atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(replayed.routing), np.asarray(recorded.routing))
    # Forced experts are what the layers run (and record), and they change the logits.
    forced = _forced(recorded.routing, model.config.num_experts)
    forced[1, :, 2:] = -1                                        # unrecorded tokens route themselves
    moved = model.apply(model.params, ids, routing=forced, return_routing=True)
    want = np.where(forced >= 0, forced, np.asarray(recorded.routing))
    np.testing.assert_array_equal(np.asarray(moved.routing), want)
    assert np.abs(np.asarray(moved.logits) - np.asarray(plain.logits)).max() > 1e-4


def test_cached_steps_record_and_replay_their_new_tokens_routing(model):
    """A sampler's prefill and decode steps each return their new tokens' routing; joined on the sequence axis
    they are the whole sequence's, which replays through a cached step too."""
    ids = _ids()
    whole = model.apply(model.params, ids, return_routing=True)
    prefill = model.apply(model.params, ids[:, :-1], cache=init_cache(model, BATCH, SEQUENCE), return_routing=True)
    step = model.apply(model.params, ids[:, -1:], cache=prefill.cache, return_routing=True)
    joined = np.concatenate([np.asarray(prefill.routing), np.asarray(step.routing)], axis=2)
    np.testing.assert_array_equal(joined, np.asarray(whole.routing))
    forced = _forced(whole.routing, model.config.num_experts)
    replayed = model.apply(model.params, ids[:, -1:], cache=prefill.cache, routing=forced[:, :, -1:],
                           return_routing=True)
    np.testing.assert_array_equal(np.asarray(replayed.routing), forced[:, :, -1:])


def test_the_replayed_load_decides_the_dispatch_buffers():
    """Under token dispatch (ep 8) the buffers hold the replayed (token, expert) pairs: routing every token to
    experts 0 and 1 overflows the lowest capacity, which the router's own spread does not need."""
    model = Qwen3MoeForCausalLM(TINY_QWEN3_MOE, DistributedConfig(fsdp_size=8, ep_size=8), scan_layers=True)
    model.init_params(seed=3)
    ids = np.random.default_rng(0).integers(0, 128, (8, 32)).astype(np.int32)   # 64 pairs per device
    lowest = model.capacity_schedule.ladder[0]
    own = model.apply(model.params, ids, capacity=lowest, inference=False, return_routing=True)
    crowded = np.broadcast_to(np.asarray([0, 1], np.int32), own.routing.shape)
    replayed = model.apply(model.params, ids, capacity=lowest, inference=False, routing=crowded)
    assert float(replayed.statistics.required_capacity) > max(float(own.statistics.required_capacity), lowest)
    assert int(replayed.statistics.dropped) > 0
    np.testing.assert_array_equal(np.asarray(replayed.expert_load)[:, 2:], 0)


def _reference_block(model, weights, hidden, ids):
    """A straight-line MoE block routed by `ids` [N, K]: the family's weights at the ids, each expert's SwiGLU
    by gathering its weights per token, DeepSeek-V3's shared experts added."""
    config = model.config
    x = hidden.reshape(-1, hidden.shape[-1]).astype(jnp.float32)
    logits = x @ weights["gate"]["weight"].astype(jnp.float32).T
    if model.config.model_type == "deepseek_v3":
        scores = jnp.take_along_axis(jax.nn.sigmoid(logits), ids, axis=-1)
        gates = config.routed_scaling_factor * scores / (scores.sum(-1, keepdims=True) + 1e-20)
    else:
        gates = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
        gates = gates / gates.sum(-1, keepdims=True)
    experts, out = weights["experts"], jnp.zeros_like(x)
    for k in range(ids.shape[1]):
        gate_up = jnp.einsum("nih,nh->ni", experts["gate_up_proj"][ids[:, k]], x)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        out = out + gates[:, k:k + 1] * jnp.einsum("nhi,ni->nh", experts["down_proj"][ids[:, k]], jax.nn.silu(gate) * up)
    out = out.reshape(hidden.shape)
    if "shared_experts" in weights:
        shared = weights["shared_experts"]
        mlp = jax.nn.silu(hidden @ shared["gate_proj"]["weight"].T) * (hidden @ shared["up_proj"]["weight"].T)
        out = out + mlp @ shared["down_proj"]["weight"].T
    return out


def test_forced_experts_equal_a_straight_line_block_and_gradients_reach_the_router(model):
    layer = model.sparse_layers()[0]
    weights = model.nested_weights(model.params)["model"]["layers"][str(layer)]["mlp"]
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((BATCH, SEQUENCE, model.config.hidden_size)),
                         jnp.float32)
    own = model.apply(model.params, _ids(), return_routing=True).routing[:, 0]           # [B, S, K]
    ids = jnp.asarray(_forced(own, model.config.num_experts, seed=4).reshape(-1, own.shape[-1]))
    experts = partial(model.sharded_experts[layer], inference=False, capacity=None)
    probe = jnp.asarray(np.random.default_rng(2).standard_normal(hidden.shape), jnp.float32)

    def block(gate_weight):
        gated = {**weights, "gate": {**weights["gate"], "weight": gate_weight}}
        out, _, _ = model.family.moe_block(model.config, gated, hidden, experts, inference=False, rng=None,
                                           constrain=no_constraint,
                                           route=partial(model.family.route, model.config, replay=ids))
        return out

    def reference(gate_weight):
        return _reference_block(model, {**weights, "gate": {**weights["gate"], "weight": gate_weight}}, hidden, ids)

    gate = weights["gate"]["weight"]
    np.testing.assert_allclose(np.asarray(jax.jit(block)(gate)), np.asarray(reference(gate)), atol=1e-5, rtol=0)
    grad = jax.jit(jax.grad(lambda w: jnp.sum(block(w) * probe)))(gate)
    want = jax.grad(lambda w: jnp.sum(reference(w) * probe))(gate)
    assert np.abs(np.asarray(grad)).max() > 1e-3
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want), atol=1e-5, rtol=1e-4)


def test_bad_routing_is_refused_with_what_and_how(model):
    ids, sparse = _ids(), len(model.sparse_layers())
    good = np.zeros((BATCH, sparse, SEQUENCE, 2), np.int32)
    with pytest.raises(ValueError, match=rf"\[batch, sparse_layers, seq, top_k\] = \({BATCH}, {sparse}, {SEQUENCE}, "
                                         rf"2\) .* got \({BATCH}, {SEQUENCE}, 2\); record it with return_routing"):
        model.apply(model.params, ids, routing=good[:, 0])
    bad = good.copy()
    bad[0, 0, 3, 1] = 8
    with pytest.raises(ValueError, match=r"expert id 8, outside \[0, 8\) \(-1 marks a token that routes itself\)"):
        model.apply(model.params, ids, routing=bad)
    with pytest.raises(ValueError, match="integer expert ids"):
        model.apply(model.params, ids, routing=good.astype(np.float32))


def test_routing_on_a_model_without_experts_is_refused():
    dense = Qwen3MoeForCausalLM({**TINY_QWEN3_MOE, "mlp_only_layers": [0, 1, 2]}, scan_layers=False)
    dense.init_params(seed=0)
    with pytest.raises(ValueError, match="has no sparse \\(MoE\\) layers, so there is no routing to replay: drop "
                                         "routing="):
        dense.apply(dense.params, _ids(), routing=np.zeros((BATCH, 0, SEQUENCE, 2), np.int32))
