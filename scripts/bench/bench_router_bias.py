"""DeepSeek-V3's aux-loss-free router bias update on a skewed token stream: the expert load's max / mean per step
with `make_train_step(router_bias_update_rate=GAMMA)` against the same run with GAMMA = 0.

    python scripts/bench/bench_router_bias.py [--gamma 0.05] [--steps 50] [--batch-size 8] [--seq-len 64]
                                              [--hot-ids 4] [--hot-share 0.8] [--lr 1e-4] [--ep 1]

Model: the tiny DeepSeek-V3 fixture (tests/fixtures/models/deepseek_v3: 8 routed experts, top-2, two sparse
layers), fp32, on one device (`--ep N`: fsdp N x ep N over N devices). Data: batch i is `--batch-size` rows of
`--seq-len` tokens, `--hot-share` of them drawn from `--hot-ids` ids (the same few every batch) and the rest
uniform over the vocabulary, a new draw each step. Both runs train with AdamW (`--lr`) from the same weights on the
same batches; only the bias update differs. Each step prints max / mean of `expert_load` (the busiest expert's
tokens over the mean, 1.0 = even) averaged over the sparse layers, for GAMMA = 0 and GAMMA, then the mean of the
last 10 steps. Without the update, training alone drifts the router toward a few experts (max / mean E / K: every
token on the same K); the rate is far above DeepSeek-V3's (0.001) so 50 steps show what it does. Tokens of one id
share their experts whatever the bias, so the hot ids bound how even the load can get. Runs on virtual CPU devices
unless JAX has accelerators (`JAX_PLATFORMS`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from moe_jax.host_devices import use_cpu_devices  # noqa: E402  (imports no JAX)

if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from moe_jax import AutoModelForCausalLM, DistributedConfig  # noqa: E402
from moe_jax.training import make_train_step  # noqa: E402

CHECKPOINT = ROOT / "tests" / "fixtures" / "models" / "deepseek_v3"


def skewed_batch(index: int, args, vocab: int) -> dict[str, np.ndarray]:
    """Batch `index`: most tokens one of the first `hot_ids` ids, the rest uniform (a new draw per index)."""
    rng = np.random.default_rng(index)
    shape = (args.batch_size, args.seq_len)
    hot = rng.integers(0, args.hot_ids, shape)
    ids = np.where(rng.random(shape) < args.hot_share, hot, rng.integers(0, vocab, shape))
    return {"input_ids": ids.astype(np.int32)}


def imbalance_curve(model, gamma: float, args) -> list[float]:
    """Per step: max / mean of the step's expert load, averaged over the sparse layers."""
    train_step = make_train_step(model, optax.adamw(args.lr), router_bias_update_rate=gamma)
    state = train_step.init_state(seed=0, capacity=None if args.ep == 1 else model.capacity_schedule.largest)
    curve = []
    for index in range(args.steps):
        state, metrics = train_step(state, skewed_batch(index, args, model.config.vocab_size))
        load = np.asarray(jax.device_get(metrics["expert_load"]), np.float64)
        curve.append(float(np.mean(load.max(-1) / load.mean(-1))))
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gamma", type=float, default=0.05, help="router_bias_update_rate")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hot-ids", type=int, default=4, help="how many ids most tokens are")
    parser.add_argument("--hot-share", type=float, default=0.8, help="the share of tokens that are hot ids")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--ep", type=int, default=1, help="fsdp N x ep N over N devices (1: one device)")
    args = parser.parse_args(argv)
    layout = None if args.ep == 1 else DistributedConfig(fsdp_size=args.ep, ep_size=args.ep)
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, layout, devices=jax.devices()[:args.ep],
                                                 progress=False)
    print(f"DeepSeek-V3 fixture ({model.config.num_experts} experts, top-{model.config.num_experts_per_tok}, "
          f"{len(model.sparse_layers())} sparse layers) on {args.ep} {jax.devices()[0].platform} device(s); batch "
          f"[{args.batch_size}, {args.seq_len}], {args.hot_share:.0%} of tokens from {args.hot_ids} ids; AdamW "
          f"lr {args.lr}")
    curves = {gamma: imbalance_curve(model, gamma, args) for gamma in (0.0, args.gamma)}
    print(f"expert load max / mean, averaged over sparse layers\n{'step':>5} {'gamma=0':>9} {f'gamma={args.gamma:g}':>12}")
    for step, (plain, updated) in enumerate(zip(*curves.values()), 1):
        print(f"{step:5d} {plain:9.3f} {updated:12.3f}")
    tail = min(10, args.steps)
    print(f"last {tail} steps' mean: gamma=0 {np.mean(curves[0.0][-tail:]):.3f}, "
          f"gamma={args.gamma:g} {np.mean(curves[args.gamma][-tail:]):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
