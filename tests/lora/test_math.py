"""LoRA's math (`moe_jax.ops.lora`) against its definition: per expert e, W_e + scaling * B_e A_e."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.nn.linear import linear
from moe_jax.ops.experts import biased_clamped_swiglu_experts, prescaled_swiglu_experts, swiglu_experts
from moe_jax.ops.lora import LoraFactors, grouped_low_rank, low_rank_delta, merged_weight

E, R, H, F = 4, 3, 8, 6   # experts, rank, hidden, intermediate


def random(key, shape, scale=0.3):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def test_a_linear_with_factors_is_the_linear_of_the_merged_weight():
    w, x = random(0, (5, H)), random(1, (2, 7, H))
    factors = LoraFactors(random(2, (R, H)), random(3, (5, R)), 2.0)
    adapted = linear({"weight": w, "lora": {"weight": factors}}, x)
    np.testing.assert_allclose(adapted, linear({"weight": merged_weight(w, factors)}, x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(low_rank_delta(factors), 2.0 * factors.b @ factors.a, rtol=1e-6)


def test_grouped_low_rank_adds_each_row_s_expert_s_update():
    sizes = jnp.asarray([3, 0, 4, 2], jnp.int32)
    x = random(4, (10, H))   # rows past sum(sizes) = 9: no group, no update
    factors = LoraFactors(random(5, (E, R, H)), random(6, (E, 2 * F, R)), 0.5)
    out = grouped_low_rank(x, factors, sizes, backend="tiled")
    experts = np.repeat(np.arange(E), np.asarray(sizes))
    delta = np.asarray(low_rank_delta(factors))                               # [E, 2I, H]
    expected = np.stack([delta[e] @ np.asarray(x[m]) for m, e in enumerate(experts)] + [np.zeros(2 * F)])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def experts_inputs(tokens=12, k=2):
    ids = jax.random.randint(jax.random.key(9), (tokens, k), 0, E + 1)   # E: another device's expert
    return random(10, (tokens, H)), ids, jax.nn.softmax(random(11, (tokens, k), 1.0))


def test_the_experts_with_an_adapter_equal_the_experts_with_merged_weights():
    hidden, ids, weights = experts_inputs()
    gate_up, down = random(12, (E, 2 * F, H)), random(13, (E, H, F))
    lora = {"gate_up_proj": LoraFactors(random(14, (E, R, H)), random(15, (E, 2 * F, R)), 2.0),
            "down_proj": LoraFactors(random(16, (E, R, F)), random(17, (E, H, R)), 2.0)}
    merged = {name: merged_weight(w, lora[name]) for name, w in (("gate_up_proj", gate_up), ("down_proj", down))}
    for tokens in (12, 2):   # 2 tokens: the gathered decode path, which gives way to the sorted one with an adapter
        args = (hidden[:tokens], ids[:tokens], weights[:tokens])
        np.testing.assert_allclose(swiglu_experts(*args, gate_up, down, lora=lora),
                                   swiglu_experts(*args, **merged), rtol=1e-5, atol=1e-6)


def test_gpt_oss_and_llama4_experts_with_an_adapter_equal_their_merged_weights():
    hidden, ids, weights = experts_inputs()
    gate_up, down = random(18, (E, H, 2 * F)), random(19, (E, F, H))      # [E, in, out] both
    biases = random(20, (E, 2 * F)), random(21, (E, H))
    # gpt-oss: PEFT reads [E, in, out] as transposed: A [E, r, in], B [E, out, r], delta transposed.
    oss = {"gate_up_proj": LoraFactors(random(22, (E, R, H)), random(23, (E, 2 * F, R)), 1.5),
           "down_proj": LoraFactors(random(24, (E, R, F)), random(25, (E, H, R)), 1.5)}
    merged = [merged_weight(w, oss[n], transposed=True) for n, w in (("gate_up_proj", gate_up), ("down_proj", down))]
    np.testing.assert_allclose(
        biased_clamped_swiglu_experts(hidden, ids, weights, gate_up, biases[0], down, biases[1], lora=oss),
        biased_clamped_swiglu_experts(hidden, ids, weights, merged[0], biases[0], merged[1], biases[1]),
        rtol=1e-5, atol=1e-6)
    # Llama 4: PEFT reads [E, H, 2I] as [E, out, in]: A [E, r, 2I], B [E, H, r], delta B A.
    llama = {"gate_up_proj": LoraFactors(random(26, (E, R, 2 * F)), random(27, (E, H, R)), 1.5),
             "down_proj": LoraFactors(random(28, (E, R, H)), random(29, (E, F, R)), 1.5)}
    merged = [merged_weight(w, llama[n]) for n, w in (("gate_up_proj", gate_up), ("down_proj", down))]
    np.testing.assert_allclose(prescaled_swiglu_experts(hidden, ids, weights, gate_up, down, lora=llama),
                               prescaled_swiglu_experts(hidden, ids, weights, *merged), rtol=1e-5, atol=1e-6)


def test_the_fused_adapted_tile_loop_equals_the_chained_grouped_matmuls_with_gradients():
    """The tiled backend runs gate_up -> act -> down with both adapters in one loop each way; ragged_dot runs the
    chain as grouped matmuls. Values and gradients (rows, weights, factors) agree."""
    from moe_jax.ops.grouped_swiglu import grouped_swiglu

    sizes = jnp.asarray([5, 0, 7, 3], jnp.int32)
    x = random(30, (17, H))   # two rows in no group
    weights = {"gate_up": random(31, (E, 2 * F, H)), "down": random(32, (E, H, F))}
    lora = {"gate_up_proj": LoraFactors(random(33, (E, R, H)), random(34, (E, 2 * F, R)), 0.7),
            "down_proj": LoraFactors(random(35, (E, R, F)), random(36, (E, H, R)), 0.7)}

    def loss(x, weights, lora, backend):
        out = grouped_swiglu(x, weights["gate_up"], weights["down"], sizes, backend=backend, lora=lora)
        return jnp.sum(out * jnp.cos(out)), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (fused, fused_out), (chained, chained_out) = (grad(x, weights, lora, name) for name in ("tiled", "ragged_dot"))
    np.testing.assert_allclose(fused_out, chained_out, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(jax.tree.leaves(fused), jax.tree.leaves(chained)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
