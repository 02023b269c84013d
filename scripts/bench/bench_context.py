"""Context parallelism: per-device memory against cp, step time of the two strategies, and a long-sequence run that
fits only with cp on the GPU target.

    python scripts/bench/bench_context.py memory [--seq 16384]       # XLA:CPU, 8 virtual devices
    python scripts/bench/bench_context.py time [--seq 8192] [--cp 4] [--rounds 3]
    python scripts/bench/bench_context.py target [--seq 131072] [--layers 48] [--strategies all_gather,ring]

memory: a Qwen3-MoE of hidden 256 (8 heads of 32, 2 KV heads, 8 experts, 2 layers: its activations, not its
parameters, fill a long sequence's step), one row of `--seq` tokens, loss and gradients compiled on cp devices
(cp = 1, 2, 4, 8; both strategies): the step's per-device temporaries from XLA's memory analysis, and each
against the one at half the cp. cp 1 is the one-device attention path.

time: the same model on 8 devices (cp x fsdp), loss-and-gradient step, all_gather and ring alternated `--rounds`
times (A/B/A/B...), the median of each; the 2 cores run all 8 virtual devices, so the ratio is one of total work.

target: Qwen3-30B-A3B (tests/fixtures/configs/qwen3_30b_a3b.json, `--layers` scanned layers), mixed precision,
AdamW, on 16 abstract H100s (two hosts): cp 1 (fsdp16 x ep16, 16 rows: the fewest a cp-1 layout of 16 devices
takes) against cp 8 (fsdp2 x cp8 x ep16, 2 rows), both strategies; each compiled program's bytes per device
against the H100's 80 GiB (`moe_jax.target_compile`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def long_sequence_model(cp: int, strategy: str, devices):
    from moe_jax import AutoModelForCausalLM, DistributedConfig
    from tests.models.test_context_parallel import FIXTURES, LONG_SEQUENCE_CONFIG

    from moe_jax.checkpoint_files import read_config
    config = {**read_config(FIXTURES / "qwen3_moe"), **LONG_SEQUENCE_CONFIG}
    layout = DistributedConfig(cp_size=cp, cp_strategy=strategy, fsdp_size=len(devices) // cp) if len(devices) > 1 \
        else None
    return AutoModelForCausalLM.from_config(config, layout, devices=devices)


def loss_and_gradients(model):
    import jax

    from moe_jax.training.loss import model_loss, predicted_tokens, prediction_targets

    def loss(params, ids):
        targets = prediction_targets(ids)
        return model_loss(model, params, ids, None, targets, total_tokens=predicted_tokens(targets),
                          aux_weight=0.01, capacity=None)[0]

    return jax.jit(jax.value_and_grad(loss))


def memory(seq: int) -> None:
    import jax
    import jax.numpy as jnp

    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    print(f"per-device temporaries of one row of {seq} tokens (loss and gradients), XLA:CPU")
    for strategy in ("all_gather", "ring"):
        previous = None
        for cp in (1, 2, 4, 8):
            model = long_sequence_model(cp, strategy, jax.devices()[:cp])
            compiled = loss_and_gradients(model).lower(model.abstract_params(), ids).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
            ratio = "" if previous is None else f"  x{temp / previous:.3f} of cp {cp // 2}"
            print(f"  {strategy:10s} cp {cp}: {temp / 2**20:9.1f} MiB{ratio}", flush=True)
            previous = temp


def step_time(seq: int, cp: int, rounds: int) -> None:
    import jax
    import numpy as np

    from timing import median_seconds

    ids = np.random.default_rng(0).integers(1, 128, (8 // cp, seq)).astype(np.int32)
    steps = {}
    for strategy in ("all_gather", "ring"):
        model = long_sequence_model(cp, strategy, jax.devices())
        model.init_params(0)
        steps[strategy] = (loss_and_gradients(model), model.params)
    seconds = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (step, params) in steps.items():
            seconds[name].append(median_seconds(step, params, ids, repeats=3))
    medians = {name: float(np.median(values)) for name, values in seconds.items()}
    print(f"cp {cp} x fsdp {8 // cp}, {8 // cp} rows of {seq} tokens, loss and gradients, {rounds} alternated rounds:")
    for name, value in medians.items():
        print(f"  {name:10s} {value * 1e3:8.1f} ms  x{value / medians['all_gather']:.2f} of all_gather")


def target(seq: int, layers: int, strategies: list[str]) -> None:
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from moe_jax import DistributedConfig
    from moe_jax.planning.request import PlanRequest
    from moe_jax.target_compile import compile_for_target

    config = json.loads((ROOT / "tests/fixtures/configs/qwen3_30b_a3b.json").read_text())
    config["num_hidden_layers"] = layers
    cases = [("cp 1, fsdp16 x ep16", DistributedConfig(fsdp_size=16, ep_size=16), 16)]
    cases += [(f"cp 8 {strategy}, fsdp2 x cp8 x ep16",
               DistributedConfig(fsdp_size=2, cp_size=8, ep_size=16, cp_strategy=strategy), 2) for strategy in strategies]
    print(f"Qwen3-30B-A3B, {layers} layers, rows of {seq} tokens, mixed precision, AdamW, 16 x H100 (80 GiB):")
    for name, layout, rows in cases:
        began = time.perf_counter()
        report = compile_for_target(config, hardware="h100", devices=16, distributed_config=layout,
                                    request=PlanRequest(mode="train", batch_size=rows, seq_len=seq,
                                                        mixed_precision=True), scan_layers=True)
        memory = report.largest.memory
        print(f"  {name}: {rows} rows, {memory.total / 2**30:.1f} GiB per device (temporaries "
              f"{memory.temp / 2**30:.1f}): {'fits' if report.fits else 'does not fit'} "
              f"[compiled in {time.perf_counter() - began:.0f} s]", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("memory", "time", "target"))
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--strategies", default="all_gather,ring", help="target: the cp strategies to compile")
    args = parser.parse_args()
    if args.what != "target":
        from moe_jax.host_devices import use_cpu_devices

        use_cpu_devices(8)
        sys.path.insert(0, str(Path(__file__).parent))
    if args.what == "memory":
        memory(args.seq or 16384)
    elif args.what == "time":
        step_time(args.seq or 8192, args.cp, args.rounds)
    else:
        target(args.seq or 131072, args.layers, args.strategies.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
