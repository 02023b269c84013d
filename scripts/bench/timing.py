"""Timing shared by the benchmark scripts: the median of repeated calls after a warm-up, and the hardware
ceiling of a step (its matmul FLOPs at the dense-matmul rate measured in the same run)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_seconds(fn, *args, repeats: int) -> float:
    """Median seconds of `fn(*args)` (jitted by the caller) over `repeats` calls, after one call that compiles
    and warms up; every call is waited for (`jax.block_until_ready`)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops_per_token(config: dict, seq: int) -> float:
    """Forward FLOPs per token of a Qwen3-MoE's matmuls (attention scores counted in full, as computed)."""
    h, heads, kv, d = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attention = h * heads * d * 2 + h * kv * d * 2 + seq * d * heads * 2
    experts = config["num_experts_per_tok"] * 3 * h * config["moe_intermediate_size"] + h * config["num_experts"]
    return 2.0 * (config["num_hidden_layers"] * (attention + experts) + h * config["vocab_size"])


def dense_rate(rows: int, depth: int, cols: int) -> float:
    """FLOP/s of one jitted fp32 [rows, depth] x [depth, cols] matmul on the default device."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((rows, depth)), jnp.float32)
    b = jnp.asarray(np.random.default_rng(1).standard_normal((depth, cols)), jnp.float32)
    return 2.0 * rows * depth * cols / median_seconds(jax.jit(jnp.matmul), a, b, repeats=10)


def model_dense_rate(config: dict, tokens: int) -> float:
    """The practical limit: the best rate among plain dots of the model's shapes (experts' up projection,
    attention's q projection, lm_head)."""
    return max(dense_rate(tokens * config["num_experts_per_tok"], config["hidden_size"],
                          2 * config["moe_intermediate_size"]),
               dense_rate(tokens, config["hidden_size"], config["hidden_size"]),
               dense_rate(tokens, config["hidden_size"], config["vocab_size"]))
