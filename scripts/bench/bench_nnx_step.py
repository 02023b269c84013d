"""What the NNX face costs: an NNX train step against `moe_jax.training`'s step, same model, layout, data.

    python scripts/bench/bench_nnx_step.py [--layouts 1,fsdp4-ep4,tp2-fsdp4-ep4] [--batch-size 8] [--seq-len 128]
                                     [--steps 10] [--repeats 5]

Model: a small Qwen3-MoE (hidden 128, 4 layers, 8 experts top-2, fp32), AdamW, random tokens, at the
capacity that never overflows. Per layout, in interleaved loops of `--steps` steps (median of `--repeats`):
(a) `make_train_step` (jitted, state donated), (b) an NNX loop (`nnx.Optimizer` + `nnx.value_and_grad` of
`MoeCausalLM.loss` inside `nnx.jit`, which walks the module graph on every call), (c) the same NNX step
through `nnx.cached_partial` (the graph walked once). Prints ms/step and the ratios (b)/(a), (c)/(a).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

use_cpu_devices(8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import moe_jax.nnx  # noqa: E402
from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402

CONFIG = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
              mlp_only_layers=[0], norm_topk_prob=True, max_position_embeddings=1024)


def parse_layout(text: str) -> dict | None:
    if text == "1":
        return None
    sizes = {"tp": "tp_size", "fsdp": "fsdp_size", "ep": "ep_size"}
    return {sizes[part.rstrip("0123456789")]: int(part[len(part.rstrip("0123456789")):]) for part in text.split("-")}


def nnx_step(model, optimizer, batch):
    (loss, _), grads = nnx.value_and_grad(lambda m: m.loss(**batch), has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


def measure(layout: dict | None, args) -> dict[str, float]:
    config = None if layout is None else DistributedConfig(**layout)
    world = 1 if config is None else config.tp_size * config.fsdp_size * config.dp_replicate_size
    engine = Qwen3MoeForCausalLM(CONFIG, config, devices=jax.devices()[:world])
    engine.init_params(seed=0)
    capacity = engine.capacity_schedule.largest if engine.layout.ep_size > 1 else None
    batch = {"input_ids": np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (args.batch_size, args.seq_len),
                                                            dtype=np.int32)}
    train_step = make_train_step(engine, optax.adamw(1e-4))
    state = train_step.init_state(capacity=capacity)
    # Its own copy of the parameters (the train state is donated to its step).
    model = moe_jax.nnx.MoeCausalLM(engine, jax.tree.map(jax.numpy.copy, dict(state.params)), capacity=capacity)
    model.train()
    optimizer = moe_jax.nnx.commit_to_mesh(nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param), model)
    jitted = nnx.jit(nnx_step)
    cached = nnx.cached_partial(jitted, model, optimizer)

    def run_pure():
        nonlocal state
        for _ in range(args.steps):
            state, metrics = train_step(state, batch)
        return metrics["loss"]

    loops = {"pure": run_pure,
             "nnx": lambda: [jitted(model, optimizer, batch) for _ in range(args.steps)][-1],
             "nnx_cached": lambda: [cached(batch) for _ in range(args.steps)][-1]}
    times = {name: [] for name in loops}
    for loop in loops.values():
        jax.block_until_ready(loop())                      # compile and warm up
    for _ in range(args.repeats):
        for name, loop in loops.items():
            start = time.perf_counter()
            jax.block_until_ready(loop())
            times[name].append((time.perf_counter() - start) / args.steps)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="1,fsdp4-ep4,tp2-fsdp4-ep4")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, flax {flax.__version__}, "
          f"{len(jax.devices())} {jax.devices()[0].platform} devices; batch {args.batch_size}x{args.seq_len}")
    print(f"{'layout':<16} {'pure ms':>8} {'nnx ms':>8} {'cached ms':>9} {'nnx/pure':>9} {'cached/pure':>11}")
    for text in args.layouts.split(","):
        result = measure(parse_layout(text), args)
        print(f"{text:<16} {result['pure'] * 1e3:8.1f} {result['nnx'] * 1e3:8.1f} {result['nnx_cached'] * 1e3:9.1f} "
              f"{result['nnx'] / result['pure']:9.2f} {result['nnx_cached'] / result['pure']:11.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
