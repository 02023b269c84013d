"""Redundant expert slots on a skewed batch: forward and train-step tokens/s without and with a balanced placement.

    python scripts/bench/bench_eplb.py [--layout fsdp8-ep8] [--redundant 8] [--batch-size 16] [--seq-len 128]
                                       [--hot-rows 0.5] [--steps 5] [--repeats 5] [--hidden 128] [--experts 8]

Model: a small Qwen3-MoE (4 layers, layer 0 dense; `--experts` experts, top-2), fp32, random weights. Batch:
random tokens, the first `--hot-rows` of its rows one repeated token, so most routes go to that token's experts.
Three variants of the same step, each at the dispatch capacity its routing requires (what a run's
`CapacityTracker` settles on; read from a first call at the largest capacity):

    plain      the model without redundant slots (R = 0): plain expert parallelism
    identity   `num_redundant_experts=R`, identity placement (slot s holds expert s % E)
    balanced   the same model and program, `balanced_placement` of the batch's `expert_load`

For the forward (`model.apply`, jitted) and the train step (`make_train_step`, SGD at rate 0 so the routing, and
so the capacity, stays put), loops of `--steps` calls are timed alternately (plain, identity, balanced, plain, ...)
`--repeats` times; each variant's median loop gives tokens/s, and the ratios balanced / plain and balanced /
identity are printed, with each variant's busiest-rank imbalance (max / mean of `ep_rank_load`) and capacity.
Runs on 8 virtual CPU devices unless JAX has accelerators (`JAX_PLATFORMS`); on CPU the devices share the
machine's cores, so the ratio shows the overheads (the weight gather, the buffers) more than a speedup.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from moe_jax import DistributedConfig  # noqa: E402
from moe_jax.causal_lm import Qwen3MoeForCausalLM  # noqa: E402
from moe_jax.distributed.eplb import balanced_placement  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402

VARIANTS = ("plain", "identity", "balanced")


def parse_layout(text: str) -> dict:
    """"tp2-fsdp4-ep4[-all_to_all]" -> DistributedConfig's keyword arguments."""
    values = {}
    for part in text.split("-"):
        if part in ("all_to_all", "all_reduce", "auto"):
            values["ep_implementation"] = part
            continue
        name = part.rstrip("0123456789")
        values[{"tp": "tp_size", "fsdp": "fsdp_size", "ep": "ep_size", "dp": "dp_replicate_size"}[name]] = int(
            part[len(name):])
    return values


def model_config(args) -> dict:
    hidden = args.hidden
    return {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "moe_intermediate_size": hidden, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": hidden // 8, "num_experts": args.experts, "num_experts_per_tok": 2,
            "norm_topk_prob": True, "mlp_only_layers": [0], "decoder_sparse_step": 1, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}


def skewed_batch(args) -> np.ndarray:
    ids = np.random.default_rng(0).integers(0, 256, (args.batch_size, args.seq_len)).astype(np.int32)
    ids[:int(args.hot_rows * args.batch_size)] = 75
    return ids


def imbalance(rank_load) -> float:
    load = np.asarray(rank_load, np.float64)
    return float((load.max(1) / load.mean(1)).max())


def timed_loops(calls: dict, steps: int, repeats: int) -> dict[str, float]:
    """Each variant's median seconds per call, its loops of `steps` calls alternating with the others'."""
    times = {name: [] for name in calls}
    for call in calls.values():
        jax.block_until_ready(call())   # warm: compiled, caches filled
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(steps):
                result = call()
            jax.block_until_ready(result)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="fsdp8-ep8")
    parser.add_argument("--redundant", type=int, default=8, help="num_redundant_experts R")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hot-rows", type=float, default=0.5, help="share of the rows that repeat one token")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    layout = DistributedConfig(**parse_layout(args.layout))
    config, ids = model_config(args), skewed_batch(args)
    plain = Qwen3MoeForCausalLM(config, layout)
    plain.init_params(seed=0)
    slotted = Qwen3MoeForCausalLM(config, layout, num_redundant_experts=args.redundant)
    slotted.set_params(plain.hf_params())
    largest = plain.capacity_schedule.largest
    base = plain.apply(plain.params, ids, capacity=largest)
    placements = {"identity": slotted.identity_expert_placement(),
                  "balanced": slotted.set_expert_placement(balanced_placement(
                      base.expert_load, num_redundant_experts=args.redundant, ep_size=layout.ep_size))}
    models = {"plain": (plain, None), **{name: (slotted, placement) for name, placement in placements.items()}}
    tokens = ids.size
    print(f"{jax.device_count()} {jax.devices()[0].platform} device(s), layout {args.layout}, E={args.experts} "
          f"R={args.redundant}, batch [{args.batch_size}, {args.seq_len}] with {args.hot_rows:.0%} hot rows")

    for mode in ("forward", "train step"):
        calls, notes = {}, {}
        for name, (model, placement) in models.items():
            probe = model.apply(model.params, ids, capacity=largest, inference=mode == "forward",
                                expert_placement=placement)
            capacity = float(probe.statistics.required_capacity)
            notes[name] = f"imbalance {imbalance(probe.ep_rank_load):.2f}, capacity {capacity}"
            if mode == "forward":
                calls[name] = (lambda model=model, placement=placement, capacity=capacity: model.apply(
                    model.params, ids, capacity=capacity, expert_placement=placement).logits)
            else:
                if placement is not None:
                    model.set_expert_placement(placement)   # the train state starts at the model's placement
                train_step = make_train_step(model, optax.sgd(0.0))
                holder = {"state": train_step.init_state(seed=0, capacity=capacity)}

                def step(train_step=train_step, holder=holder):
                    holder["state"], metrics = train_step(holder["state"], {"input_ids": ids})
                    return metrics["loss"]

                calls[name] = step
        seconds = timed_loops(calls, args.steps, args.repeats)
        for name in VARIANTS:
            print(f"{mode:10s} {name:9s} {seconds[name] * 1e3:8.1f} ms/call  {tokens / seconds[name]:9.0f} tokens/s  "
                  f"({notes[name]})")
        print(f"{mode:10s} balanced / plain {seconds['plain'] / seconds['balanced']:.3f}x tokens/s, "
              f"balanced / identity {seconds['identity'] / seconds['balanced']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
